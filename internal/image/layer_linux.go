package image

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// erofsMagic is EROFS_SUPER_MAGIC_V1, what statfs(2) reports for a mounted
// EROFS file system.
const erofsMagic = 0xE0F5E1E2

var (
	probeOnce sync.Once
	probeErr  error
)

// probeEROFS reports (as nil) whether this process can make and mount EROFS
// layers: root, the kernel's erofs driver, and mkfs.erofs. It builds and
// mounts a tiny image once per process, so a kernel or tool that only looks
// present is caught at Open rather than at the first sandbox.
func probeEROFS(scratch string) error {
	probeOnce.Do(func() { probeErr = probeEROFSOnce(scratch) })
	return probeErr
}

func probeEROFSOnce(scratch string) error {
	if os.Geteuid() != 0 {
		return errors.New("not root (mounting needs CAP_SYS_ADMIN)")
	}
	fsList, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		return fmt.Errorf("read /proc/filesystems: %w", err)
	}
	if !bytes.Contains(fsList, []byte("\terofs\n")) {
		return errors.New("the kernel has no erofs driver (modprobe erofs)")
	}
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		return errors.New("mkfs.erofs not found (apt-get install erofs-utils)")
	}
	// Guarded like an import's staging dir: another process opening the
	// same store at this moment must not clean the probe away (it then
	// fell back to plain directory layers without a word).
	st, err := newStagingIn(scratch)
	if err != nil {
		return fmt.Errorf("probe erofs: %w", err)
	}
	defer st.cleanup()
	dir := st.dir
	src, mnt, img := filepath.Join(dir, "src"), filepath.Join(dir, "mnt"), filepath.Join(dir, "probe.erofs")
	if err := os.Mkdir(src, 0o755); err != nil {
		return fmt.Errorf("probe erofs: %w", err)
	}
	if err := os.WriteFile(filepath.Join(src, "ok"), []byte("ok"), 0o644); err != nil {
		return fmt.Errorf("probe erofs: %w", err)
	}
	if err := os.Mkdir(mnt, 0o755); err != nil {
		return fmt.Errorf("probe erofs: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := mkfsEROFS(ctx, img, src); err != nil {
		return err
	}
	if err := mountEROFS(img, mnt); err != nil {
		return err
	}
	defer func() { _ = unmount(mnt) }() // a probe mount; its dir is removed next
	if b, err := os.ReadFile(filepath.Join(mnt, "ok")); err != nil || string(b) != "ok" {
		return fmt.Errorf("probe erofs: read back %q: %v", b, err)
	}
	return nil
}

// mkfsEROFS builds an uncompressed EROFS image of dir. Uncompressed keeps
// reads of a lazily fetched file on a shared store to the blocks asked for.
func mkfsEROFS(ctx context.Context, img, dir string) error {
	cmd := exec.CommandContext(ctx, "mkfs.erofs", "--quiet", "-x2", img, dir)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		return fmt.Errorf("mkfs.erofs: %w: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

// mountEROFS mounts the EROFS file img read-only at mnt: straight from the
// file where the kernel can (6.12+), else through a read-only loop device
// that goes away with the mount.
func mountEROFS(img, mnt string) error {
	const flags = unix.MS_RDONLY | unix.MS_NODEV | unix.MS_NOSUID
	err := unix.Mount(img, mnt, "erofs", flags, "")
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.ENOTBLK) && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("mount erofs layer %s: %w", filepath.Base(filepath.Dir(img)), err)
	}
	dev, err := attachLoop(img)
	if err != nil {
		return fmt.Errorf("mount erofs layer %s: %w", filepath.Base(filepath.Dir(img)), err)
	}
	if err := unix.Mount(dev, mnt, "erofs", flags, ""); err != nil {
		detachLoop(dev)
		return fmt.Errorf("mount erofs layer %s from %s: %w", filepath.Base(filepath.Dir(img)), dev, err)
	}
	return nil
}

// loopConfig is struct loop_config (linux/loop.h).
type loopConfig struct {
	fd        uint32
	blockSize uint32
	info      unix.LoopInfo64
	_         [8]uint64
}

// attachLoop binds img to a free loop device, read-only and autoclear (the
// device detaches itself when its last mount goes).
func attachLoop(img string) (string, error) {
	f, err := os.OpenFile(img, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("open layer: %w", err)
	}
	defer f.Close()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("open loop control: %w", err)
	}
	defer ctl.Close()
	for range 32 { // another process may take the free device first
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return "", fmt.Errorf("find free loop device: %w", err)
		}
		dev := fmt.Sprintf("/dev/loop%d", n)
		lf, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return "", fmt.Errorf("open %s: %w", dev, err)
		}
		cfg := loopConfig{fd: uint32(f.Fd())}
		cfg.info.Flags = unix.LO_FLAGS_READ_ONLY | unix.LO_FLAGS_AUTOCLEAR
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, lf.Fd(), unix.LOOP_CONFIGURE, uintptr(unsafe.Pointer(&cfg)))
		lf.Close()
		if errno == 0 {
			return dev, nil
		}
		if errno != unix.EBUSY {
			return "", fmt.Errorf("configure %s: %w", dev, errno)
		}
	}
	return "", fmt.Errorf("no free loop device after 32 tries: %w", errdefs.ErrUnavailable)
}

func detachLoop(dev string) {
	if f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
		_ = unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0)
		f.Close()
	}
}

// isMounted reports whether an EROFS file system is mounted at mnt (and not
// merely a directory that happens to sit on one).
func isMounted(mnt string) bool {
	var sfs unix.Statfs_t
	if err := unix.Statfs(mnt, &sfs); err != nil || uint32(sfs.Type) != erofsMagic {
		return false
	}
	var a, b unix.Stat_t
	if unix.Lstat(mnt, &a) != nil || unix.Lstat(filepath.Dir(mnt), &b) != nil {
		return false
	}
	return a.Dev != b.Dev
}

// unmount detaches the mount at mnt lazily, so a straggling reader (a
// process that still has a file open) cannot make Release fail; the layer's
// blocks go when the last reference does.
func unmount(mnt string) error {
	if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("unmount %s: %w", mnt, err)
	}
	return nil
}

// lockFile takes an exclusive flock on path, waiting until ctx ends.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock %s: %w", filepath.Base(path), err)
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil // closing releases the lock
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", filepath.Base(path), err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", filepath.Base(path), context.Cause(ctx))
		case <-time.After(5 * time.Millisecond):
		}
	}
}
