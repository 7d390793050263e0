//go:build linux && (!amd64 || opendsec_signotify)

package main

import (
	"os"
	"os/signal"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// signalThreads is how many threads catching signals costs init:
// os/signal's.
const signalThreads = 3

// catchSignals makes SIGTERM, SIGINT and SIGCHLD wake the loop through the
// eventfd wake, and keeps fatalSignals from ending init (dropSignals). On
// this architecture with os/signal, which costs three threads for init's
// life (on amd64 an assembly handler does it with none: see
// sig_handler_linux.go).
func catchSignals(wake int, pid1 bool) error {
	sigWakeFD = int64(wake)
	c := make(chan os.Signal, 8)
	signal.Notify(c, unix.SIGTERM, unix.SIGINT, unix.SIGCHLD)
	dropSignals(pid1)
	go func() {
		for s := range c {
			atomic.OrUint64(&sigPending, 1<<uint(s.(unix.Signal)))
			_, _ = unix.Write(wake, (*[8]byte)(unsafe.Pointer(&sigOne))[:])
		}
	}()
	return nil
}

// dropSignals keeps fatalSignals from ending init. As PID 1 they are set
// to SIG_DFL (see sigDefault), but for runtimeFaults; the rest, and every
// one when init is not PID 1, are notified and discarded: Notify, not
// signal.Ignore, because an ignored signal stays ignored across exec.
func dropSignals(pid1 bool) {
	notify := fatalSignals
	if pid1 {
		notify = nil
		for _, sig := range fatalSignals {
			if runtimeFaults[sig] || sigDefault(sig.(unix.Signal)) != nil {
				notify = append(notify, sig)
			}
		}
	}
	c := make(chan os.Signal, 4)
	signal.Notify(c, notify...)
	go func() {
		for range c {
		}
	}()
}
