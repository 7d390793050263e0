// Package unixsock makes listening unix sockets in directories of any
// path length: bound through /proc/self/fd/<dir>/<name>, so sun_path's
// 108 bytes never limit where a sandbox's state lives.
package unixsock

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ListenAt makes the listening stream socket name in the directory open
// as dirfd (an O_PATH handle does), replacing a stale socket of an
// earlier run, mode 0600, with backlog pending connections at most (the
// kernel caps it at net.core.somaxconn). The socket is close-on-exec;
// the caller hands the file to a child (ExtraFiles) and closes its copy.
func ListenAt(dirfd int, name string, backlog int) (*os.File, error) {
	if err := unix.Unlinkat(dirfd, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return nil, fmt.Errorf("remove stale socket: %w", err)
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("make socket: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: fmt.Sprintf("/proc/self/fd/%d/%s", dirfd, name)}); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("bind socket: %w", err)
	}
	if err := unix.Fchmodat(dirfd, name, 0o600, 0); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("chmod socket: %w", err)
	}
	if err := unix.Listen(fd, backlog); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("listen on socket: %w", err)
	}
	return f, nil
}
