//go:build !linux

package osthread

import goruntime "runtime"

// Throwaway runs fn in a new goroutine locked to a thread that ends with it.
// Only Linux has per-thread namespaces; elsewhere this is all it does.
func Throwaway(fn func()) {
	go func() {
		goruntime.LockOSThread() // never unlocked: the thread ends with fn
		fn()
	}()
}
