package osthread

import (
	"fmt"
	"os"
	goruntime "runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// The main goroutine stays on the main thread, so TestMain can hand
// lockedRun the very case Throwaway guards against.
func init() { goruntime.LockOSThread() }

func TestMain(m *testing.M) {
	if unix.Gettid() != unix.Getpid() {
		fmt.Fprintln(os.Stderr, "TestMain is not on the main thread")
		os.Exit(1)
	}
	tid := make(chan int, 1)
	lockedRun(func() { tid <- unix.Gettid() })
	if got := <-tid; got == unix.Getpid() {
		fmt.Fprintf(os.Stderr, "lockedRun ran fn on the main thread (tid %d)\n", got)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// TestThrowawayNeverMainThread runs many throwaway functions: none of them
// may run on the main thread, and each thread ends with its function.
func TestThrowawayNeverMainThread(t *testing.T) {
	const n = 200
	tids := make(chan int, n)
	for range n {
		Throwaway(func() { tids <- unix.Gettid() })
	}
	for range n {
		if tid := <-tids; tid == unix.Getpid() {
			t.Fatalf("fn ran on the main thread (tid %d)", tid)
		}
	}
}
