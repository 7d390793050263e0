package vmm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// StartTime is pid's start time (field 22 of /proc/<pid>/stat, in clock
// ticks since boot), 0 when pid is gone. With the pid it names one
// process: a reused pid has another start time.
func StartTime(pid int) uint64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')') // the command may hold spaces and ')'
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0
	}
	v, _ := strconv.ParseUint(f[19], 10, 64)
	return v
}

// Cmdline is pid's command line, nil when pid is gone or has none (a
// zombie, a kernel thread).
func Cmdline(pid int) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil || len(b) == 0 {
		return nil
	}
	return strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
}

// Is says whether pid is a process whose command line match accepts and,
// when stime is not 0, still the one started at stime.
func Is(pid int, stime uint64, match func(args []string) bool) bool {
	if pid <= 0 || !match(Cmdline(pid)) {
		return false
	}
	return stime == 0 || StartTime(pid) == stime
}

// Find is the pids in /proc, this process's aside, whose command lines
// match accepts: the VMMs no record names (a node killed between the
// VMM's exec and the write of its run file).
func Find(match func(args []string) bool) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		if args := Cmdline(pid); args != nil && match(args) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// WaitExit blocks until the process of pidfd has exited (its pidfd is
// readable; it may not be reaped yet).
func WaitExit(pidfd int) {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for {
		if _, err := unix.Poll(fds, -1); err != nil && errors.Is(err, unix.EINTR) {
			continue
		}
		return
	}
}

// Kill sends SIGKILL to pid. A pid of 0 or less is no process (kill(2)
// would take it for a process group: the node's own); ESRCH is not an
// error.
func Kill(pid int) error {
	if pid <= 0 {
		return nil
	}
	if err := unix.Kill(pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
		return err
	}
	return nil
}

// KillAndWait sends SIGKILL through a pidfd (no reused pid is hit) and
// waits until the process has exited, at most timeout and while ctx
// lasts. A process that is gone already is no error.
func KillAndWait(ctx context.Context, pid int, timeout time.Duration) error {
	if pid <= 0 {
		return nil
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil
		}
		return fmt.Errorf("%w: pidfd of %d: %w", errdefs.ErrInternal, pid, err)
	}
	defer func() { _ = unix.Close(fd) }()
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("%w: kill %d: %w", errdefs.ErrInternal, pid, err)
	}
	deadline := time.Now().Add(timeout)
	for {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 100)
		if n > 0 {
			return nil
		}
		if err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("%w: wait for %d to exit: %w", errdefs.ErrInternal, pid, err)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%w: wait for %d to exit: %w", errdefs.ErrDeadlineExceeded, pid, ctx.Err())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %d still runs %s after SIGKILL", errdefs.ErrInternal, pid, timeout)
		}
	}
}
