// Package gosysmon tunes the Go runtime's sysmon thread for the daemons.
package gosysmon

import (
	"os"
	"runtime"
	"strconv"
	"strings"
)

// SlackNS is the timer slack of the Go runtime's sysmon thread.
const SlackNS = 1_000_000

// Slow gives the Go runtime's sysmon thread a timer slack of
// SlackNS (the kernel's default is 50 µs). sysmon sleeps 20 µs at a
// time for as long as it keeps taking Ps from goroutines blocked in
// system calls, which the node's creates (mounts, netlink, fsync) make
// all the time on a busy node: its wake-ups alone were ~0.4 ms of the
// node's ~10 ms of CPU per create in a burst of 1000 (0.07 with the
// slack). With the slack it wakes at most about once
// a millisecond, so a P in a long system call is handed to another
// thread up to a millisecond later. sysmon is the first thread the
// runtime starts (the lowest thread ID after the main thread's), asleep
// in nanosleep(2) between its rounds; if that thread is not found so
// (or not running), or the process may not set another thread's slack
// (CAP_SYS_NICE: the node runs as root), nothing changes.
func Slow() {
	self := os.Getpid()
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return
	}
	tid := 0
	for _, e := range ents {
		if n, err := strconv.Atoi(e.Name()); err == nil && n != self && (tid == 0 || n < tid) {
			tid = n
		}
	}
	if tid == 0 {
		return
	}
	nanosleep := map[string]string{"amd64": "35", "arm64": "101"}[runtime.GOARCH]
	b, err := os.ReadFile("/proc/self/task/" + strconv.Itoa(tid) + "/syscall")
	if f := strings.Fields(string(b)); err != nil || len(f) == 0 || nanosleep == "" || f[0] != nanosleep && f[0] != "running" {
		return
	}
	// Only /proc/<tid> has the file, not /proc/self/task/<tid>.
	_ = os.WriteFile("/proc/"+strconv.Itoa(tid)+"/timerslack_ns", []byte(strconv.Itoa(SlackNS)), 0)
}
