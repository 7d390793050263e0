//go:build !linux

package node

import "golang.org/x/sys/unix"

// freeMB is the space available to unprivileged writers on dir's filesystem.
func freeMB(dir string) (int64, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return 0, err
	}
	return int64(fs.Bavail) * int64(fs.Bsize) >> 20, nil
}
