package agent

import (
	"errors"
	"os"
	"os/exec"
	"os/signal"
	"sync"

	"golang.org/x/sys/unix"
)

// The reaper owns waiting for children. Children are started with
// startChild, which registers the pid under the same lock as the fork, so an
// exit status can never arrive for a pid nobody knows yet. Two modes share
// the registry:
//   - per child (default): one goroutine Wait4s on each registered pid;
//   - all (PID 1, or a subreaper): one goroutine Wait4(-1)s on SIGCHLD,
//     reaps every child including reparented orphans, and dispatches the
//     registered ones. A per-child waiter that loses the race gets ECHILD and
//     leaves the delivery to it.
//
// exec.Cmd.Wait is never called: it would race with Wait4(-1).
type reaper struct {
	mu      sync.Mutex
	waiters map[int]chan unix.WaitStatus
	all     bool
}

var theReaper = &reaper{waiters: map[int]chan unix.WaitStatus{}}

// reapAll switches the process-wide reaper to reaping every child. It is
// idempotent and cannot be undone.
func (r *reaper) reapAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.all {
		return
	}
	r.all = true
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, unix.SIGCHLD)
	go func() {
		for {
			r.drain()
			<-sig
		}
	}()
}

func (r *reaper) drain() {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || pid <= 0 {
			return
		}
		r.deliver(pid, ws)
	}
}

func (r *reaper) deliver(pid int, ws unix.WaitStatus) {
	r.mu.Lock()
	ch := r.waiters[pid]
	delete(r.waiters, pid)
	r.mu.Unlock()
	if ch != nil {
		ch <- ws
	}
}

// startChild starts cmd and returns a channel that receives its wait status
// exactly once.
func (r *reaper) startChild(cmd *exec.Cmd) (<-chan unix.WaitStatus, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	pid := cmd.Process.Pid
	ch := make(chan unix.WaitStatus, 1)
	r.waiters[pid] = ch
	if !r.all {
		go func() {
			for {
				var ws unix.WaitStatus
				_, err := unix.Wait4(pid, &ws, 0, nil)
				if errors.Is(err, unix.EINTR) {
					continue
				}
				if err == nil {
					r.deliver(pid, ws)
				}
				// ECHILD: an all-children reaper took it and delivered.
				return
			}
		}()
	}
	return ch, nil
}

// exitInfo renders a wait status the way Go's os.ProcessState does.
func exitInfo(ws unix.WaitStatus) (code int32, exited bool, status string) {
	switch {
	case ws.Exited():
		return int32(ws.ExitStatus()), true, "exit status " + itoa(ws.ExitStatus())
	case ws.Signaled():
		s := "signal: " + ws.Signal().String()
		if ws.CoreDump() {
			s += " (core dumped)"
		}
		return -1, false, s
	default:
		return -1, false, "unknown wait status"
	}
}
