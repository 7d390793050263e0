package netpolicy

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Sandbox namespaces write their sysctls through a procfs mount of the
// node's own, detached (fsopen/fsmount: attached nowhere, gone with its
// last file descriptor), which is replaced every procSysUses writes.
//
// Why: every network namespace has its own /proc/sys/net, and all their
// dentries hang off the one /proc/sys of a procfs superblock under the
// same name, in one dcache hash chain; a lookup of /proc/sys/net walks it
// (proc_sys_compare takes the global sysctl_lock for each entry). Through
// the host's /proc that chain holds one entry per live sandbox whose
// /proc/sys was ever looked up, so the one write every create makes cost
// O(sandboxes on the node): ~0.5 ms more with 1000 of them
// (BenchmarkNetNS). A superblock of the node's own holds at most
// procSysUses namespaces' entries, and its dentries go with it.
const procSysUses = 64

type procSysMount struct {
	fd   int // the mount's root; closed when retired and unused
	uses int // writes made through it
	refs int // writes in flight
}

var procSys struct {
	mu  sync.Mutex
	cur *procSysMount // guarded by mu
	// off is set once a detached mount could not be made (an old kernel,
	// a node without the privilege): the host's /proc serves.
	off atomic.Bool
}

// newProcSysMount makes a detached procfs mount.
func newProcSysMount() (*procSysMount, error) {
	fsfd, err := unix.Fsopen("proc", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("fsopen proc: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return nil, fmt.Errorf("create proc superblock: %w", err)
	}
	fd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOEXEC|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return nil, fmt.Errorf("fsmount proc: %w", err)
	}
	return &procSysMount{fd: fd}, nil
}

func acquireProcSys() (*procSysMount, error) {
	procSys.mu.Lock()
	defer procSys.mu.Unlock()
	if m := procSys.cur; m == nil || m.uses >= procSysUses {
		n, err := newProcSysMount()
		if err != nil {
			return nil, err
		}
		if m != nil {
			m.uses = -1 // retired: the last release closes it
			if m.refs == 0 {
				unix.Close(m.fd)
			}
		}
		procSys.cur = n
	}
	m := procSys.cur
	m.uses++
	m.refs++
	return m, nil
}

func releaseProcSys(m *procSysMount) {
	procSys.mu.Lock()
	defer procSys.mu.Unlock()
	m.refs--
	if m.refs == 0 && procSys.cur != m {
		unix.Close(m.fd)
	}
}

// writeNSSysctl writes value to /proc/sys/<key> of the calling thread's
// network namespace through the node's detached procfs mount; where none
// can be made, through /proc.
func writeNSSysctl(key, value string) error {
	if procSys.off.Load() {
		return writeSysctl(key, value)
	}
	m, err := acquireProcSys()
	if err != nil {
		procSys.off.Store(true)
		return writeSysctl(key, value)
	}
	defer releaseProcSys(m)
	fd, err := unix.Openat(m.fd, "sys/"+key, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("set sysctl %s: %w", key, err)
	}
	defer unix.Close(fd)
	n, err := unix.Write(fd, []byte(value))
	if err == nil && n != len(value) {
		err = errors.New("short write")
	}
	if err != nil {
		return fmt.Errorf("set sysctl %s: %w", key, err)
	}
	return nil
}
