// Package osthread runs code on an OS thread that may be left in other
// namespaces and then ends.
//
// Go ends a thread whose goroutine exits while locked to it, except the
// main thread: that one is parked for good instead, still in whatever
// namespace the goroutine left it. /proc/<pid>/ (mountinfo, ns/*, net/*)
// shows the main thread's view to the process itself and to everyone else,
// so a namespace change left on it silently changes what the whole process
// appears to see. Throwaway never runs its function on the main thread.
package osthread
