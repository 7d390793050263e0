package main

import (
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"
)

// idleThreads waits (up to 2 s) until every thread of pid sleeps in a
// wait (futex, epoll_pwait, ppoll), then returns how many it has.
func idleThreads(pid int) int {
	dir := fmt.Sprintf("/proc/%d/task", pid)
	waits := map[string]bool{fmt.Sprint(syscall.SYS_FUTEX): true, fmt.Sprint(syscall.SYS_EPOLL_PWAIT): true, fmt.Sprint(syscall.SYS_PPOLL): true}
	deadline := time.Now().Add(2 * time.Second)
	for {
		ents, _ := os.ReadDir(dir)
		idle := len(ents) > 0
		for _, e := range ents {
			b, _ := os.ReadFile(dir + "/" + e.Name() + "/syscall")
			nr, _, _ := strings.Cut(string(b), " ")
			idle = idle && waits[nr]
		}
		if idle || time.Now().After(deadline) {
			return len(ents)
		}
		time.Sleep(time.Millisecond)
	}
}
