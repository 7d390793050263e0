package gosysmon

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/testutil"
)

// TestSlowSetsSysmonSlack: Slow gives the runtime's first thread after the
// main one, sysmon (asleep in nanosleep between its rounds while the
// process is busy), the timer slack and leaves the main thread's alone.
func TestSlowSetsSysmonSlack(t *testing.T) {
	// Another thread's slack takes CAP_SYS_NICE (the node runs as root).
	testutil.RequiresRoot(t)
	// Keep a P busy with system calls so that sysmon keeps polling
	// (an idle process parks it on a futex, where Slow leaves it).
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			default:
				os.Getppid()
			}
		}
	}()
	self := os.Getpid()
	tid := 0
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if n, _ := strconv.Atoi(e.Name()); n != self && n != 0 && (tid == 0 || n < tid) {
			tid = n
		}
	}
	slack := func(tid int) string {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(tid) + "/timerslack_ns")
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	before := slack(self)
	for range 1000 {
		Slow()
		if slack(tid) == strconv.Itoa(SlackNS) {
			break
		}
	}
	if got := slack(tid); got != strconv.Itoa(SlackNS) {
		t.Fatalf("thread %d (sysmon) has a timer slack of %s ns, want %d", tid, got, SlackNS)
	}
	if got := slack(self); got != before {
		t.Errorf("the main thread's timer slack changed: %s → %s", before, got)
	}
}
