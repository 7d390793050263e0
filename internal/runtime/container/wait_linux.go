package container

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// exitWatch is how a sandbox's end is seen and kept for Wait.
type exitWatch struct {
	once sync.Once // starts the watcher for one pid
	// latch keeps the end for Wait (runtime.ExitLatch, as every backend).
	*runtime.ExitLatch
	// stopping is set once Stop ends the sandbox, so its end reads as
	// asked for, not as a crash.
	stopping atomic.Bool
	// fsPausing is set while PauseFilesystem ends the sandbox.
	fsPausing atomic.Bool
}

func newExitWatch() exitWatch {
	return exitWatch{ExitLatch: runtime.NewExitLatch()}
}

// watch starts, once per sandbox, the watcher of init's pid: a pidfd the
// Go poller waits on (no thread blocks), or /proc polling where pidfds are
// missing. pid 0 means init is already gone.
func (r *Runtime) watch(sb *sandbox, pid int) {
	sb.exit.once.Do(func() {
		if pid <= 0 {
			r.ended(sb, "init was gone when the node looked")
			return
		}
		go func() {
			waitPidExit(pid)
			r.ended(sb, "")
		}()
	})
}

// ended records how sb's init ended and wakes every Wait. why, when set,
// replaces the reason read from the sandbox's state.
func (r *Runtime) ended(sb *sandbox, why string) {
	st := runtime.ExitStatus{ExitCode: -1, At: time.Now()}
	st.OOMKilled = r.oomKilled(sb.st.CgroupPath)
	switch {
	case why != "":
		st.Reason = why
	case sb.exit.fsPausing.Load():
		st.Reason = "paused keeping only its files"
	case sb.exit.stopping.Load():
		st.Reason = "stopped"
	case st.OOMKilled:
		st.Reason = "a process was killed for memory (the sandbox's memory limit); ask for more memory_mb"
	default:
		st.Reason = "init exited or was killed from outside the sandbox"
	}
	sb.exit.Finish(st)
}

// Wait blocks until sb's init has ended (or ctx ends, or the sandbox is
// deleted before it ever ran).
func (r *Runtime) Wait(ctx context.Context, id string) (runtime.ExitStatus, error) {
	r.mu.Lock()
	sb, ok := r.sandboxes[id]
	r.mu.Unlock()
	if !ok {
		return runtime.ExitStatus{}, errdefs.New(errdefs.ErrNotFound, "sandbox %q not found", id)
	}
	// One that ran has its end recorded by its watcher (Delete killed init).
	return sb.exit.Wait(ctx, id, func() bool { return sb.pid.Load() > 0 })
}

// markGone wakes the Waits of a deleted sandbox.
func (sb *sandbox) markGone() { sb.exit.Gone() }

// oomKilled reports whether the kernel's OOM killer killed a task of the
// cgroup (v2 memory.events, v1 memory.oom_control "oom_kill").
func (r *Runtime) oomKilled(cgroupPath string) bool {
	var file string
	if r.cg.v2 {
		file = filepath.Join(r.cg.unified, cgroupPath, "memory.events")
	} else if mnt := r.cg.v1["memory"]; mnt != "" {
		file = filepath.Join(mnt, cgroupPath, "memory.oom_control")
	}
	if file == "" {
		return false
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "oom_kill "); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n > 0
		}
	}
	return false
}

// waitPidExit returns once pid has exited (a zombie counts: it runs no
// more). It waits on a pidfd through the Go poller; without pidfds
// (kernels before 5.3) it polls /proc.
func waitPidExit(pid int) {
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return
		}
		for pidAlive(pid) {
			time.Sleep(100 * time.Millisecond)
		}
		return
	}
	f := os.NewFile(uintptr(fd), "pidfd")
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		for pidAlive(pid) {
			time.Sleep(100 * time.Millisecond)
		}
		return
	}
	_ = rc.Read(func(fd uintptr) bool {
		// A pidfd is readable once its process has exited.
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 0)
		return err != nil && !errors.Is(err, unix.EINTR) || n > 0
	})
}
