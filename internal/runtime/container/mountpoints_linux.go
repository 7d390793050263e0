package container

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/interpreter"
	"github.com/kernflux/opendsec/internal/log"
)

// The files opendsec bind-mounts under /.opendsec exist in no image: the
// OCI runtime used to make each of them (and /.opendsec) in the sandbox's
// root before it mounted over it, five new inodes in the writable layer
// per create, each an overlayfs copy through the work dir and an inode
// allocation on the layer's ext4 (without a journal, a scan past every
// inode freed in the last seconds): about 1 ms of crun's ~10 ms of CPU
// (bench/results/2026-12-06-burst-crun.md). Instead every sandbox's root
// has, above the image's layers, one more read-only lower layer that the
// node makes once and shares: /.opendsec (0755, root's) holding an empty
// file (0700, root's) at every such mount point, as crun would have made
// them. The runtime finds the mount points there and creates nothing.
//
// Inside the sandbox nothing changes: /.opendsec is the same directory
// with the same mode and owner, and its files are covered by the same
// read-only bind mounts; the sandbox's root may still remove or replace
// what is not mounted over, which overlayfs records in the sandbox's own
// upper layer and never in the shared one (overlayfs never writes a lower
// layer). On the host the layer lives in the node's shared dir (root's,
// 0700) and is never changed once made: a different set of mount points
// is a new directory (its name is a hash of the set).

// mountPointFiles are the bind mounts' destinations under
// mountPointDirInSandbox: the layer has an empty file at each.
var mountPointFiles = []string{agentInSandbox, initInSandbox, seccompInSandbox, interpreter.PathInSandbox}

// mountPointDirInSandbox is the directory holding mountPointFiles.
const mountPointDirInSandbox = "/.opendsec"

// mountPointLayer is the node's shared mount point layer, made on first
// use.
type mountPointLayer struct {
	once sync.Once
	dir  string
	err  error
	// detached is "/proc/self/fd/N" of a read-only detached clone of the
	// layer's mount (open_tree), which the overlay takes as the layer
	// instead of dir; empty when there is none (see overlayLower).
	detached string
	// fd is the clone's, and dev and ino its root's: overlayLower checks
	// that fd still is the clone before each use.
	fd       int
	dev, ino uint64
	// refused records that an overlay mount refused the detached clone
	// (kernels before 6.15 take no detached mount as a layer): dir from
	// then on.
	refused atomic.Bool
}

// overlayLower is the path an overlay mount should take for the mount
// point layer dir: the detached clone when dir is the node's layer and
// the kernel takes it, else dir. The handle keeps dir.
//
// Why a clone: for each layer the overlay takes a private clone of the
// mount holding it, and first walks every mount on that mount
// (__has_locked_children). dir is on the data dir's file system, whose
// mount holds every sandbox's mounts (each bundle's tmpfs, the layer
// images', the image store's): with a thousand sandboxes on the node each
// create's overlay mount walked thousands (is_subdir, ~0.27 ms of CPU per
// create averaged over a batch of 1000, growing with the node's
// sandboxes). The detached clone has no mounts on it.
func (r *Runtime) overlayLower(dir string) string {
	l := &r.mpLayer
	if dir == "" || dir != l.dir || l.detached == "" || l.refused.Load() {
		return dir
	}
	// The node never closes the fd; should anything in the process close
	// it and the number name another file, the overlay must not take that
	// one: the directory from then on.
	var st unix.Stat_t
	if err := unix.Fstat(l.fd, &st); err != nil || st.Dev != l.dev || st.Ino != l.ino || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		l.refused.Store(true)
		return dir
	}
	return l.detached
}

// mountRootOverlay mounts the overlay of a sandbox's root: mp (the mount
// point layer, "" none) over lower, with upper and work, through mount
// (which gets the options). An overlay that refuses the detached mount
// point layer is mounted again with its directory.
func (r *Runtime) mountRootOverlay(mp string, lower []string, upper, work string, mount func(opts string) error) error {
	opts := func(mp string) string {
		return fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", strings.Join(withLayer(mp, lower), ":"), upper, work)
	}
	use := r.overlayLower(mp)
	o := opts(use)
	if len(o) >= os.Getpagesize() {
		return errdefs.Invalid("rootfs.layers", "overlay options are %d bytes, over the kernel's %d-byte limit: use fewer layers or shorter paths", len(o), os.Getpagesize())
	}
	err := mount(o)
	if err != nil && use != mp && errors.Is(err, unix.EINVAL) {
		r.mpLayer.refused.Store(true)
		err = mount(opts(mp))
	}
	return err
}

// detach makes l's read-only detached clone of the mount at l.dir
// (open_tree), its fd held for the node's life, and sets l.detached to
// its "/proc/self/fd/N".
func (l *mountPointLayer) detach() error {
	fd, err := unix.OpenTree(unix.AT_FDCWD, l.dir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("clone mount point layer: %w", err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		unix.Close(fd)
		return fmt.Errorf("make mount point layer clone read-only: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return fmt.Errorf("stat mount point layer clone: %w", err)
	}
	l.fd, l.dev, l.ino = fd, st.Dev, st.Ino
	l.detached = "/proc/self/fd/" + strconv.Itoa(fd)
	return nil
}

// mountPoints returns the mount point layer's directory, making it the
// first time (a failure is logged once).
func (r *Runtime) mountPoints(ctx context.Context) (string, error) {
	l := &r.mpLayer
	l.once.Do(func() {
		l.dir, l.err = makeMountPointLayer(r.shared.dir, mountPointFiles)
		if l.err != nil {
			log.G(ctx).Warn("sandbox roots have no shared mount point layer: the OCI runtime makes /.opendsec and its mount points in each sandbox's writable layer, about 1 ms more CPU per create", log.Err(l.err))
			return
		}
		if err := l.detach(); err != nil {
			log.G(ctx).Info("sandbox roots take the mount point layer from its directory: each overlay mount walks the mounts on the data dir's file system", log.Err(err))
		}
	})
	return l.dir, l.err
}

// makeMountPointLayer makes (or finds intact, from an earlier run) the
// layer of empty files at files (absolute paths in the sandbox, all
// directly in mountPointDirInSandbox) in a directory under parent named
// after them.
func makeMountPointLayer(parent string, files []string) (string, error) {
	sum := sha256.Sum256([]byte(strings.Join(files, "\x00")))
	dir := filepath.Join(parent, "mountpoints-"+hex.EncodeToString(sum[:8]))
	if mountPointLayerIntact(dir, files) {
		return dir, nil
	}
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return "", fmt.Errorf("mount point layer: %w", err)
	}
	if err := os.Chmod(parent, 0o700); err != nil {
		return "", fmt.Errorf("mount point layer: %w", err)
	}
	tmp := dir + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return "", fmt.Errorf("mount point layer: %w", err)
	}
	if err := buildMountPointLayer(tmp, files); err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("mount point layer: %w", err)
	}
	// A damaged layer from an earlier run (sandboxes of that run may
	// still have it as a lower layer: they keep the directory they
	// opened) is moved aside, never changed in place.
	if _, err := os.Lstat(dir); err == nil {
		old, err := os.MkdirTemp(parent, "mountpoints-old.")
		if err != nil {
			os.RemoveAll(tmp)
			return "", fmt.Errorf("mount point layer: %w", err)
		}
		if err := os.Rename(dir, filepath.Join(old, "layer")); err != nil {
			os.RemoveAll(tmp)
			return "", fmt.Errorf("mount point layer: move aside %s: %w", dir, err)
		}
	}
	if err := os.Rename(tmp, dir); err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("mount point layer: %w", err)
	}
	return dir, nil
}

// buildMountPointLayer makes the layer in dir (which must not exist).
func buildMountPointLayer(dir string, files []string) error {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	sub := filepath.Join(dir, mountPointDirInSandbox)
	if err := os.Mkdir(sub, 0o755); err != nil {
		return err
	}
	// Modes as crun makes missing mount points (0755 directories, 0700
	// files), not through the umask.
	for _, d := range []string{dir, sub} {
		if err := os.Chmod(d, 0o755); err != nil {
			return err
		}
	}
	for _, f := range files {
		if filepath.Dir(f) != mountPointDirInSandbox {
			return fmt.Errorf("%s is not directly in %s", f, mountPointDirInSandbox)
		}
		p := filepath.Join(dir, f)
		fd, err := unix.Open(p, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o700)
		if err != nil {
			return fmt.Errorf("create %s: %w", p, err)
		}
		unix.Close(fd)
		if err := os.Chmod(p, 0o700); err != nil {
			return err
		}
	}
	return nil
}

// mountPointLayerIntact reports whether dir is exactly the layer of files:
// root's directories of mode 0755 and root's empty regular files of mode
// 0700, nothing else.
func mountPointLayerIntact(dir string, files []string) bool {
	is := func(p string, typ uint32, mode uint32) bool {
		var st unix.Stat_t
		return unix.Lstat(p, &st) == nil && st.Mode&unix.S_IFMT == typ && st.Mode&0o7777 == mode &&
			st.Uid == 0 && st.Gid == 0 && (typ != unix.S_IFREG || st.Size == 0)
	}
	sub := filepath.Join(dir, mountPointDirInSandbox)
	if !is(dir, unix.S_IFDIR, 0o755) || !is(sub, unix.S_IFDIR, 0o755) {
		return false
	}
	if top, err := os.ReadDir(dir); err != nil || len(top) != 1 {
		return false
	}
	ents, err := os.ReadDir(sub)
	if err != nil || len(ents) != len(files) {
		return false
	}
	for _, f := range files {
		if !is(filepath.Join(dir, f), unix.S_IFREG, 0o700) {
			return false
		}
	}
	return true
}

// mountPointsFor is the mount point layer a new root gets: "" when it
// cannot be made (the OCI runtime then makes the mount points in the
// upper layer, as before).
func (r *Runtime) mountPointsFor(ctx context.Context) string {
	mp, err := r.mountPoints(ctx)
	if err != nil {
		return ""
	}
	return mp
}

// resumeMountPoints is the mount point layer for a root mounted again
// whose handle had had: the same one (overlayfs with index=on refuses an
// upper layer under another lower stack); none if it had none; the
// current one if that one is gone (moved aside as damaged).
func (r *Runtime) resumeMountPoints(ctx context.Context, had string) string {
	if had == "" {
		return ""
	}
	if mountPointLayerIntact(had, mountPointFiles) {
		return had
	}
	return r.mountPointsFor(ctx)
}

// withLayer is lower with layer on top ("" none).
func withLayer(layer string, lower []string) []string {
	if layer == "" {
		return lower
	}
	return append([]string{layer}, lower...)
}
