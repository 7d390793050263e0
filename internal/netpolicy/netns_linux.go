package netpolicy

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	goruntime "runtime"
	"sync"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// createNetNS makes a new network namespace, bind-mounts it at path (which
// must not exist) and runs setup inside it on the creating thread. The
// namespace outlives every process in it until removeNetNS.
func createNetNS(path string, setup func() error) (err error) {
	return createNetNSOn(path, "", setup)
}

// createNetNSOn is createNetNS with the mount point at path a hard link
// of the existing file pin where it can be (same file system): the
// mount covers it, and no file is made for it (a new inode costs more
// than a link on some file systems). Without pin, or where the link
// fails for another reason than path existing, path is a new empty file.
func createNetNSOn(path, pin string, setup func() error) (err error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("create netns dir: %w", err)
	}
	linked := false
	if pin != "" {
		lerr := os.Link(pin, path)
		if errors.Is(lerr, os.ErrExist) {
			return fmt.Errorf("create netns file: %w", lerr)
		}
		linked = lerr == nil
	}
	if !linked {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
		if err != nil {
			return fmt.Errorf("create netns file: %w", err)
		}
		f.Close()
	}
	defer func() {
		if err != nil {
			unix.Unmount(path, unix.MNT_DETACH)
			os.Remove(path)
		}
	}()
	done := make(chan error, 1)
	// A fresh goroutine whose thread dies with it if it cannot return to
	// its original namespace, so no goroutine ever runs in the wrong one.
	go func() {
		goruntime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			done <- fmt.Errorf("open current netns: %w", err)
			return
		}
		defer orig.Close()
		rtnlMu.RLock()
		err = unix.Unshare(unix.CLONE_NEWNET)
		rtnlMu.RUnlock()
		if err != nil {
			done <- fmt.Errorf("unshare netns: %w", err)
			return
		}
		src := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		err = unix.Mount(src, path, "none", unix.MS_BIND, "")
		if err != nil {
			err = fmt.Errorf("bind-mount netns: %w", err)
		} else if setup != nil {
			err = setup()
		}
		if serr := netns.Set(orig); serr != nil {
			done <- errors.Join(err, fmt.Errorf("return to original netns: %w", serr))
			return // thread stays locked and is discarded
		}
		goruntime.UnlockOSThread()
		done <- err
	}()
	return <-done
}

// removeNetNS unmounts and removes a namespace file; a missing file is fine.
func removeNetNS(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount netns: %w", err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove netns file: %w", err)
	}
	return nil
}

// inNetNS runs fn on a thread inside the namespace at path (the current one
// when path is empty). Sockets fn opens stay in that namespace.
func inNetNS(path string, fn func() error) error {
	if path == "" {
		return fn()
	}
	target, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer target.Close()
	done := make(chan error, 1)
	go func() {
		goruntime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			done <- fmt.Errorf("open current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			done <- fmt.Errorf("enter netns %s: %w", path, err)
			return
		}
		err = fn()
		if serr := netns.Set(orig); serr != nil {
			done <- errors.Join(err, fmt.Errorf("return to original netns: %w", serr))
			return
		}
		goruntime.UnlockOSThread()
		done <- err
	}()
	return <-done
}

// rtnlMu keeps the node's own RTNL users (the netlink requests of setup and
// teardown, unshare) off RTNL while a sandbox namespace's disable_ipv6 is
// written: the kernel takes RTNL for that write with a trylock and
// restarts the write() until it gets it, a busy loop for as long as
// another holds RTNL.
var rtnlMu sync.RWMutex

// rtnlRead runs f, one netlink request (or a few), holding rtnlMu for
// reading: short, so a writer waits for little.
func rtnlRead(f func() error) error {
	rtnlMu.RLock()
	defer rtnlMu.RUnlock()
	return f()
}

// sandboxNSSetup is what every sandbox namespace gets first, on the
// creating thread inside it: IPv6 off, lo up.
func sandboxNSSetup() error {
	// Set before any interface exists, so every one inherits it: a
	// write to all/disable_ipv6 sets default/disable_ipv6 (and every
	// interface's) as well (Documentation/networking/ip-sysctl.rst),
	// one /proc/sys write less per sandbox. Through the node's own procfs
	// (writeNSSysctl): not a lookup that grows with the sandboxes.
	rtnlMu.Lock()
	err := writeNSSysctl("net/ipv6/conf/all/disable_ipv6", "1")
	rtnlMu.Unlock()
	if err != nil {
		return err
	}
	// lo is ifindex 1 in every namespace (LOOPBACK_IFINDEX): no lookup.
	lo := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: 1, Name: "lo"}}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}

// writeSysctl writes value to /proc/sys/<key> of the calling thread's
// network namespace.
func writeSysctl(key, value string) error {
	p := "/proc/sys/" + key
	if err := os.WriteFile(p, []byte(value), 0o644); err != nil {
		return fmt.Errorf("set sysctl %s: %w", key, err)
	}
	return nil
}

// CreateNetNS makes a network namespace bind-mounted at path (which must
// not exist) and runs setup inside it, for backends that make namespaces
// of their own (gvisor's guest namespace).
func CreateNetNS(path string, setup func() error) error { return createNetNS(path, setup) }

// RemoveNetNS unmounts and removes a namespace file; a missing one is fine.
func RemoveNetNS(path string) error { return removeNetNS(path) }

// InNetNS runs fn on a thread inside the namespace at path.
func InNetNS(path string, fn func() error) error { return inNetNS(path, fn) }

// WaitOperUp waits until the link name of h has its carrier (a veth drops
// what it sends until then), at most 5 s.
func WaitOperUp(ctx context.Context, h *netlink.Handle, name string) error {
	return waitOperUp(ctx, h, name)
}
