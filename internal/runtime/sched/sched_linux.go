package sched

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	goruntime "runtime"
	"strconv"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// SetIdle puts every thread of process pid under SCHED_IDLE. Threads that
// end meanwhile are no error.
func SetIdle(pid int) error {
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("threads of %d: %w", pid, err)
	}
	var errs []error
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		if err := setIdleTID(tid); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func setIdleTID(tid int) error {
	attr := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}
	if err := unix.SchedSetAttr(tid, &attr, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("SCHED_IDLE for thread %d: %w", tid, err)
	}
	return nil
}

// SetIdleAll puts every thread of the processes list returns under
// SCHED_IDLE, listing them again until a pass finds none left to change:
// a process forked meanwhile by one not changed yet is found by the next
// pass, and once all are changed every new one inherits the policy.
func SetIdleAll(list func() ([]int, error)) error {
	const passes = 50
	for range passes {
		pids, err := list()
		if err != nil {
			return err
		}
		changed := false
		for _, pid := range pids {
			tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
			if err != nil {
				continue // gone
			}
			for _, t := range tasks {
				tid, err := strconv.Atoi(t.Name())
				if err != nil {
					continue
				}
				if p, err := Policy(tid); err != nil || p == unix.SCHED_IDLE {
					continue // gone, or done
				}
				if err := setIdleTID(tid); err != nil {
					return err
				}
				changed = true
			}
		}
		if !changed {
			return nil
		}
	}
	return fmt.Errorf("SCHED_IDLE: the processes kept changing over %d passes", passes)
}

// Policy is thread tid's scheduling policy (unix.SCHED_*).
func Policy(tid int) (uint32, error) {
	a, err := unix.SchedGetAttr(tid, 0)
	if err != nil {
		return 0, err
	}
	return a.Policy, nil
}

// StartIdle starts cmd so that it runs under SCHED_IDLE from its first
// instruction: it is forked from an OS thread that has the policy (a child
// inherits it), which is then thrown away. Every thread the child makes
// inherits it too, so nothing of it ever runs at normal priority.
func StartIdle(cmd *exec.Cmd) error {
	return Start(cmd, StartOptions{Idle: true})
}

// StartOptions say what a command started with Start runs with from its
// first instruction.
type StartOptions struct {
	// Idle: under SCHED_IDLE.
	Idle bool
	// Cookie: with a core-scheduling cookie of its own (its threads never
	// share an SMT core with another cookie's).
	Cookie bool
}

// Start starts cmd from an OS thread given what o asks (a child inherits a
// thread's policy and core-scheduling cookie). The thread's policy is set
// back after (CAP_SYS_NICE); a thread that keeps either (a cookie cannot be
// dropped) stays locked and ends with its goroutine, so no other goroutine
// runs with them.
func Start(cmd *exec.Cmd, o StartOptions) error {
	if !o.Idle && !o.Cookie {
		return cmd.Start()
	}
	errc := make(chan error, 1)
	go func() {
		goruntime.LockOSThread()
		tid := unix.Gettid()
		var old *unix.SchedAttr
		if o.Idle {
			a, err := unix.SchedGetAttr(tid, 0)
			if err != nil {
				goruntime.UnlockOSThread()
				errc <- fmt.Errorf("scheduling policy of thread %d: %w", tid, err)
				return
			}
			if err := setIdleTID(tid); err != nil {
				goruntime.UnlockOSThread()
				errc <- err
				return
			}
			old = a
		}
		keep := false
		var err error
		if o.Cookie {
			if err = unix.Prctl(prSchedCore, prSchedCoreCreate, 0, pidTypePID, 0); err != nil {
				err = fmt.Errorf("core scheduling cookie for the starting thread: %w", err)
			} else {
				keep = true
			}
		}
		if err == nil {
			err = cmd.Start()
		}
		if old != nil {
			old.Size = unix.SizeofSchedAttr
			if unix.SchedSetAttr(tid, old, 0) != nil {
				keep = true
			}
		}
		if !keep {
			goruntime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// prctl PR_SCHED_CORE (linux/prctl.h) and its pid types.
const (
	prSchedCore       = 62
	prSchedCoreGet    = 0
	prSchedCoreCreate = 1
	pidTypePID        = 0
	pidTypeTGID       = 1
)

// CreateCookie gives process pid (all its threads) a new core-scheduling
// cookie of its own.
func CreateCookie(pid int) error {
	if err := unix.Prctl(prSchedCore, prSchedCoreCreate, uintptr(pid), pidTypeTGID, 0); err != nil {
		return fmt.Errorf("core scheduling cookie for %d: %w", pid, err)
	}
	return nil
}

// Cookie is thread tid's core-scheduling cookie (0: none).
func Cookie(tid int) (uint64, error) {
	var c uint64
	if err := unix.Prctl(prSchedCore, prSchedCoreGet, uintptr(tid), pidTypePID, uintptr(unsafe.Pointer(&c))); err != nil {
		return 0, fmt.Errorf("core scheduling cookie of %d: %w", tid, err)
	}
	return c, nil
}

// KernelCoreSched is nil when the kernel answers PR_SCHED_CORE (it was
// built with CONFIG_SCHED_CORE), else the error it gives (EINVAL).
var KernelCoreSched = sync.OnceValue(func() error {
	_, err := Cookie(os.Getpid())
	return err
})

// Core decides core scheduling for this host once.
var Core = sync.OnceValue(func() CoreDecision {
	b, err := os.ReadFile(SMTActivePath)
	return DecideCore(string(b), err, KernelCoreSched())
})
