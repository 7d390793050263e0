package container

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/osthread"
)

// runc runs in a mount namespace of its own, not in the node's.
//
// Every sandbox keeps mounts in the node's mount namespace (its ext4 layer,
// the tmpfs of its run and log dirs, the pin of its network namespace), and
// the node's file, diff, fork, snapshot and disk-usage code reads them
// there. Each `runc run` reads the whole mountinfo of the namespace it runs
// in, several times, and copies it into the container's: with 1000
// sandboxes that was about 3000 mounts and a third of runc's CPU
// (bench/results/2026-12-02-burst-profile.md). So runc never runs in the
// node's namespace: the runtime makes, once, a private copy of it without
// any sandbox's mounts (the runc namespace), and
//
//   - `runc run` and `runc create` run in a fresh copy of the runc namespace
//     into which the node has moved clones of that one sandbox's mounts
//     (its overlay root, its tmpfs, its network namespace pin) at the very
//     paths of the node's namespace, so config.json needs no change;
//   - every other runc command (state, start, kill, pause, resume, delete)
//     runs in the runc namespace itself: none of them needs a mount.
//
// The runc namespace is private: no mount the node makes later reaches it.
// A path runc needs whose file system was mounted after it was made (a
// state dir on a file system mounted later, as in the XFS fork tests) is
// not the same file there; runc then runs in the node's namespace, as
// before, and the create is only slower.

// runcNamespace is the runtime's runc mount namespace, made on first use.
type runcNamespace struct {
	once sync.Once
	fd   int // open /proc/thread-self/ns/mnt of it; -1: runc runs in the node's
}

// errRuncNS marks a failure to enter a runc namespace: the caller runs
// runc in the node's namespace instead.
var errRuncNS = errors.New("runc mount namespace unusable")

// runcNSFD returns the runc namespace, making it on the first call; -1
// when it cannot be made (runc then runs in the node's namespace).
func (r *Runtime) runcNSFD(ctx context.Context) int {
	r.runcNS.once.Do(func() {
		r.runcNS.fd = -1
		if r.cfg.runcInNodeNS {
			return
		}
		fd, n, err := makeRuncNS(r.sandboxMountFilter(), r.oci.view)
		if err != nil {
			log.G(ctx).Warn("runc runs in the node's mount namespace: every sandbox's mounts slow each runc run", log.Err(err))
			return
		}
		log.G(ctx).Debug("runc mount namespace made", "sandbox_mounts_left_out", n)
		r.runcNS.fd = fd
	})
	return r.runcNS.fd
}

// sandboxMountFilter reports whether a mount (point, file system type) of
// the node's namespace belongs to a sandbox, so the runc namespace leaves
// it out: network namespace pins, and the layer, tmpfs and root mounts in
// a bundle (a dir with config.json, tmp/config.json or a layer image).
func (r *Runtime) sandboxMountFilter() func(point, fstype string) bool {
	return func(point, fstype string) bool {
		if fstype == "nsfs" {
			return true
		}
		switch filepath.Base(point) {
		case layerDir, tmpDir, rootfsDir, runDir, logDir:
		default:
			return false
		}
		dir := filepath.Dir(point)
		for _, f := range []string{configFile, layerImage, seccompFile, filepath.Join(tmpDir, configFile)} {
			if _, err := os.Lstat(filepath.Join(dir, f)); err == nil {
				return true
			}
		}
		return false
	}
}

// makeRuncNS makes the runc namespace on a thread that then ends: a
// private copy of the calling one without the mounts skip selects (the
// sandboxes' mounts there when the node restarted) and, for crun on a
// cgroup v1 or hybrid host, with crun's view of /sys/fs/cgroup
// (cgview_linux.go).
// It returns an open file of the namespace and how many mounts it left
// out.
func makeRuncNS(skip func(point, fstype string) bool, view cgroupView) (int, int, error) {
	type result struct {
		fd, n int
		err   error
	}
	c := make(chan result, 1)
	osthread.Throwaway(func() {
		fd, n, err := func() (int, int, error) {
			if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
				return -1, 0, fmt.Errorf("unshare mount namespace: %w", err)
			}
			if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
				return -1, 0, fmt.Errorf("make mount namespace private: %w", err)
			}
			n, err := detachMounts(skip)
			if err != nil {
				return -1, 0, err
			}
			if err := view.apply(); err != nil {
				return -1, 0, err
			}
			fd, err := unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return -1, 0, fmt.Errorf("open mount namespace: %w", err)
			}
			return fd, n, nil
		}()
		c <- result{fd, n, err}
	})
	res := <-c
	return res.fd, res.n, res.err
}

// detachMounts lazily unmounts, in the calling thread's mount namespace,
// every mount skip selects, deepest first.
func detachMounts(skip func(point, fstype string) bool) (int, error) {
	f, err := os.Open("/proc/thread-self/mountinfo")
	if err != nil {
		return 0, fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		fields, typ := strings.Fields(pre), strings.Fields(post)
		if !ok || len(fields) < 5 || len(typ) < 1 {
			continue
		}
		if p := unescapeMountPoint(fields[4]); skip(p, typ[0]) {
			points = append(points, p)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("read mountinfo: %w", err)
	}
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	n := 0
	for _, p := range points {
		if unix.Unmount(p, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW) == nil {
			n++
		}
	}
	return n, nil
}

// unescapeMountPoint undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountPoint(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// runcNSPlan is what a runc command needs of a mount namespace: mounts to
// clone from the node's namespace (moved to the same paths), and paths
// that must be the same files in both (else runc runs in the node's).
type runcNSPlan struct {
	mounts []string
	same   []string
}

// inRuncNS runs fn (which starts and waits for a runc process) on a thread
// in the runc namespace: for a plan with mounts, in a fresh copy of it
// holding clones of them. When that namespace cannot be entered, or a path
// of plan.same is not the same file there, fn runs in the node's
// namespace (crun on a hybrid cgroup host: in a private copy of it
// without the cgroup2 mount, which crun refuses). oci is the runtime fn
// runs. fn runs exactly once.
func (r *Runtime) inRuncNS(ctx context.Context, plan runcNSPlan, oci *ociRuntime, fn func() error) error {
	base := r.runcNSFD(ctx)
	if base < 0 {
		return oci.inCgroupView(fn)
	}
	// The runc namespace hides the cgroup2 mount only when the node's
	// runtime needs it; a container another runtime made may need it too.
	hide := ""
	if r.oci.hideUnified == "" {
		hide = oci.hideUnified
	}
	c := make(chan error, 1)
	osthread.Throwaway(func() {
		if err := enterRuncNS(base, plan); err != nil {
			c <- err
			return
		}
		if hide != "" {
			if err := unshareView(cgroupView{unified: hide}); err != nil {
				c <- fmt.Errorf("%w: %w", errRuncNS, err)
				return
			}
		}
		c <- fn()
	})
	err := <-c
	if errors.Is(err, errRuncNS) {
		log.G(ctx).Debug("runc runs in the node's mount namespace", log.Err(err))
		return oci.inCgroupView(fn)
	}
	return err
}

// enterRuncNS moves the calling (locked) thread into the runc namespace
// base, or a fresh copy of it with plan's mounts. Its errors wrap
// errRuncNS.
func enterRuncNS(base int, plan runcNSPlan) error {
	type id struct{ dev, ino uint64 }
	stat := func(p string) (id, error) {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			return id{}, err
		}
		return id{st.Dev, st.Ino}, nil
	}
	want := make([]id, len(plan.same))
	for i, p := range plan.same {
		var err error
		if want[i], err = stat(p); err != nil {
			return fmt.Errorf("%w: stat %s: %w", errRuncNS, p, err)
		}
	}
	var trees []int
	defer func() {
		for _, fd := range trees {
			unix.Close(fd)
		}
	}()
	for _, p := range plan.mounts {
		fd, err := unix.OpenTree(unix.AT_FDCWD, p, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
		if err != nil {
			return fmt.Errorf("%w: clone mount %s: %w", errRuncNS, p, err)
		}
		trees = append(trees, fd)
	}
	// setns into a mount namespace needs a file system context of the
	// thread's own.
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("%w: unshare fs: %w", errRuncNS, err)
	}
	if err := unix.Setns(base, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("%w: enter runc mount namespace: %w", errRuncNS, err)
	}
	for i, p := range plan.same {
		if got, err := stat(p); err != nil || got != want[i] {
			return fmt.Errorf("%w: %s is not the same file there (a file system mounted after it was made)", errRuncNS, p)
		}
	}
	if len(plan.mounts) == 0 {
		return nil
	}
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("%w: unshare mount namespace: %w", errRuncNS, err)
	}
	for i, p := range plan.mounts {
		if err := unix.MoveMount(trees[i], "", unix.AT_FDCWD, p, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("%w: move mount to %s: %w", errRuncNS, p, err)
		}
		// A clone of a shared mount is its peer: keep what runc does
		// here from reaching the node's namespace, and back.
		if err := unix.Mount("", p, "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			return fmt.Errorf("%w: make %s private: %w", errRuncNS, p, err)
		}
	}
	return nil
}

// runPlan is the runc namespace plan of `runc run` or `runc create` of the
// bundle: its root, its tmpfs (or the run and log tmpfs of sandboxes made
// before it) and its network namespace, cloned; the bundle, runc's state
// root and the bind-mounted binaries the same files.
func (r *Runtime) runPlan(bundle, netNS string) runcNSPlan {
	p := runcNSPlan{same: []string{r.cfg.StateRoot, r.cfg.AgentPath, r.cfg.InitPath}}
	if filepath.Base(bundle) == tmpDir && isMountPoint(bundle) {
		// The OCI bundle is the state dir's tmpfs (handleState.OCIInTmp):
		// cloned with the root mounted in it (the clone is recursive); the
		// state dir holding it is the same file.
		p.mounts = append(p.mounts, bundle)
		p.same = append(p.same, filepath.Dir(bundle))
	} else {
		p.same = append(p.same, bundle)
		for _, d := range []string{rootfsDir, tmpDir, runDir, logDir} {
			path := filepath.Join(bundle, d)
			if fi, err := os.Lstat(path); err == nil && fi.IsDir() && isMountPoint(path) {
				p.mounts = append(p.mounts, path)
			}
		}
	}
	if netNS == "" {
		// A recovered sandbox: its network namespace is in config.json.
		netNS = specNetNS(filepath.Join(bundle, configFile))
	}
	if netNS != "" {
		p.mounts = append(p.mounts, netNS)
	}
	return p
}

// specNetNS returns the path of the network namespace config.json joins
// ("" when it makes its own or cannot be read).
func specNetNS(config string) string {
	b, err := os.ReadFile(config)
	if err != nil {
		return ""
	}
	var s struct {
		Linux struct {
			Namespaces []struct{ Type, Path string } `json:"namespaces"`
		} `json:"linux"`
	}
	if json.Unmarshal(b, &s) != nil {
		return ""
	}
	for _, ns := range s.Linux.Namespaces {
		if ns.Type == "network" {
			return ns.Path
		}
	}
	return ""
}

// isMountPoint reports whether path is the root of a mount.
func isMountPoint(path string) bool {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &st); err != nil {
		return false
	}
	return st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 && st.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0
}
