package container

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// The OCI runtime keeps a few small files per container in its state root
// (crun: status, config.json, the exec fifo; runc: state.json), made on
// every create and removed on every delete. The default state root is
// under /run, a tmpfs where systemd is PID 1; on a host whose /run is on
// disk those files cost inode allocation there on every create (on an ext4
// without a journal the kernel scans recently deleted inodes for each new
// one: about a tenth of crun's CPU in a batch). So New puts the default
// state root on a tmpfs of its own, as /run would be. The mount outlives
// the node in the host's mount namespace: a restarted node finds it (and
// its containers' state) and reuses it; after a reboot the containers are
// gone, and so is their state, as with a tmpfs /run. A state root set in
// the config is used as it is.

// stateRootTmpfsSize caps the state root's tmpfs: a container's state is a
// few KiB (crun keeps a copy of config.json), so 64 MiB holds thousands.
const stateRootTmpfsSize = 64 << 20

// stateRootTmpfs mounts a tmpfs (mode 0700, stateRootTmpfsSize) at the
// existing dir root unless it is on a tmpfs already or holds containers'
// state (from a node that ran before this rule: mounting over it would
// hide them; the tmpfs comes with the first start after they are gone).
// It returns what it found or did, for the log; a failed mount leaves the
// state root on disk.
func stateRootTmpfs(root string) (string, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(root, &fs); err != nil {
		return "", fmt.Errorf("stat the file system of state root %s: %w", root, err)
	}
	if fs.Type == unix.TMPFS_MAGIC {
		return "tmpfs (already)", nil
	}
	d, err := os.Open(root)
	if err != nil {
		return "", fmt.Errorf("read state root %s: %w", root, err)
	}
	_, err = d.Readdirnames(1)
	d.Close()
	if err == nil {
		return "on disk: it holds containers' state from before; a tmpfs is mounted at the first start after they are gone", nil
	}
	if !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("read state root %s: %w", root, err)
	}
	opts := fmt.Sprintf("mode=0700,size=%d", stateRootTmpfsSize)
	if err := unix.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		// Slower creates, nothing worse.
		return "on disk: mount a tmpfs: " + err.Error(), nil
	}
	return "tmpfs (mounted, " + opts + ")", nil
}
