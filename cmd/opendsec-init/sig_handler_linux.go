//go:build linux && amd64 && !opendsec_signotify

package main

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// Implemented in sig_linux_amd64.s; the first two are called by the
// kernel only.
func sigHandler() //nolint:unused // the kernel calls it
func sigReturn()  //nolint:unused // the kernel calls it
func sigAddrs() (handler, restorer uintptr)

// signalThreads is how many threads catching signals costs init.
const signalThreads = 0

// sigChain holds the Go runtime's handler of each signal in chainMask
// (runtimeFaults): sigHandler passes a fault raised by the kernel on to it.
var (
	sigChain  [65]uintptr
	chainMask uint64 //nolint:unused // read by sig_linux_amd64.s
)

// kSigaction is the kernel's struct sigaction on amd64.
type kSigaction struct {
	handler, flags, restorer, mask uint64
}

const (
	saSiginfo  = 0x4
	saRestorer = 0x04000000
	saOnstack  = 0x08000000
	saRestart  = 0x10000000
)

// catchSignals makes SIGTERM, SIGINT and SIGCHLD wake the loop through the
// eventfd wake, and keeps fatalSignals from ending init (see sigDefault),
// with no thread of its own: os/signal would add three that stay for
// init's life (a goroutine locked to a thread that keeps the signal mask,
// the runtime's template thread that locking brings, and one blocked in
// signal_recv), and every thread on the host costs each later container
// create (crun's pivot_root walks them all). Instead init's own handler,
// a few instructions of assembly run by whichever thread the kernel picks,
// records the signal in sigPending and writes to the eventfd: the
// self-pipe trick. Masks are no way out: the runtime unblocks SIGCHLD,
// SIGTERM and SIGINT on every thread it starts (sysmon's first), so a
// signalfd would miss each signal one of those threads takes.
//
// The runtime still believes its handler is installed for these signals,
// so a server it forks gets them back at SIG_DFL (and exec resets any
// handler anyway). Faults of init itself raised by the kernel (SIGSEGV,
// SIGBUS... with si_code > 0) still reach the runtime's handler; the same
// signals sent by a process (kill -SEGV 1, si_code <= 0) are dropped.
func catchSignals(wake int, pid1 bool) error {
	sigWakeFD = int64(wake)
	h, r := sigAddrs()
	set := func(sig unix.Signal) error {
		act := kSigaction{handler: uint64(h), flags: saSiginfo | saOnstack | saRestart | saRestorer, restorer: uint64(r), mask: ^uint64(0)}
		return sigaction(sig, &act, nil)
	}
	for _, sig := range []unix.Signal{unix.SIGTERM, unix.SIGINT, unix.SIGCHLD} {
		if err := set(sig); err != nil {
			return &opError{"catch " + sig.String(), err}
		}
	}
	for _, s := range fatalSignals {
		sig := s.(unix.Signal)
		if runtimeFaults[sig] {
			var old kSigaction
			if err := sigaction(sig, nil, &old); err != nil {
				return &opError{"read the handler of " + sig.String(), err}
			}
			if old.handler > 1 { // not SIG_DFL or SIG_IGN: the runtime's
				sigChain[sig] = uintptr(old.handler)
				chainMask |= 1 << uint(sig)
			}
		} else if pid1 && sigDefault(sig) == nil {
			continue
		}
		if err := set(sig); err != nil {
			return &opError{"catch " + sig.String(), err}
		}
	}
	return nil
}

func sigaction(sig unix.Signal, act, old *kSigaction) error {
	_, _, errno := unix.RawSyscall6(unix.SYS_RT_SIGACTION, uintptr(sig), uintptr(unsafe.Pointer(act)), uintptr(unsafe.Pointer(old)), sigsetSize, 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}
