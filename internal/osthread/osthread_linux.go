package osthread

import (
	goruntime "runtime"

	"golang.org/x/sys/unix"
)

// Throwaway runs fn in a new goroutine locked to a thread that ends with it
// (fn may leave the thread in another namespace) and returns at once; fn
// reports back through whatever it closes over. The thread is never the
// main one.
func Throwaway(fn func()) {
	go lockedRun(fn)
}

// lockedRun locks the calling goroutine to its thread and runs fn there,
// or, on the main thread, on another thread while holding the main one.
func lockedRun(fn func()) {
	goruntime.LockOSThread() // never unlocked: the thread ends with fn
	if unix.Gettid() != unix.Getpid() {
		fn()
		return
	}
	// The main thread: held here, it cannot be the new goroutine's.
	done := make(chan struct{})
	go func() {
		goruntime.LockOSThread()
		defer close(done)
		fn()
	}()
	<-done
	goruntime.UnlockOSThread()
}
