package agent

import (
	"context"
	"errors"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// Busy reports why the agent server is needed, or "" when it may exit: a
// request is in flight (a port tunnel counts while open), it has a child
// process (any: started processes, PTYs, the code interpreter, orphans it
// reaps as a subreaper), or a polling watcher is registered through the
// watcher API. Everything else the server holds may be lost: exited
// processes' output kept for Connect replay, and the freed-memory trim.
func (a *Agent) Busy() string {
	if n, _ := a.act.snapshot(); n > 0 {
		return strconv.Itoa(n) + " requests in flight"
	}
	if hasChildren() {
		return "child processes running"
	}
	a.fs.watch.mu.Lock()
	n := len(a.fs.watch.byID)
	a.fs.watch.mu.Unlock()
	if n > 0 {
		return strconv.Itoa(n) + " watchers registered"
	}
	return ""
}

// WaitIdle returns nil once the agent has been idle (Busy empty, no request
// started or ended) for d without a break, or ctx's error.
func (a *Agent) WaitIdle(ctx context.Context, d time.Duration) error {
	return waitIdle(ctx, d, a.Busy, a.act)
}

// hasChildren reports whether this process has any child, exited or not.
func hasChildren() bool {
	for {
		var info unix.Siginfo
		err := unix.Waitid(unix.P_ALL, 0, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return !errors.Is(err, unix.ECHILD)
	}
}
