package container

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// crun's view of the cgroup v1 hierarchies.
//
// crun 1.8 on cgroup v1 puts a container in every hierarchy it finds
// under /sys/fs/cgroup, the cpuset one included, though no sandbox
// setting is a cpuset: a cpuset cgroup per sandbox, made (with the node's
// quietCpuset), given its CPUs and memory nodes and removed again. Each
// of those writes checks the new value against every sibling cpuset
// (validate_change), so with a thousand sandboxes on the node each create
// paid for all of them: crun's `run` of a container cost ~1.0 ms more of
// CPU with its own cpuset than without one, ~1.9 ms more beside 1000
// sibling cpusets (bench/results/2026-12-06-cpuset-view.md).
//
// So where the cpuset controller has a hierarchy of its own, crun runs
// with a /sys/fs/cgroup of its own (cgroupView.apply, in the private mount
// namespaces it runs in): a small tmpfs holding clones of every v1
// hierarchy's mount but the cpuset one, and without the hybrid host's
// cgroup2 mount (which crun refuses). crun skips a hierarchy whose
// directory under /sys/fs/cgroup does not exist, so it neither makes a
// cpuset cgroup nor, on a hybrid host, leaves files under the bare cgroup2
// mount point (hiddencg_linux.go). The container then stays in the cpuset
// cgroup of the thread that started crun: each start moves that thread
// first into one cpuset cgroup all sandboxes share (sharedCpuset, under
// the sandboxes' parent, with all its CPUs), so a sandbox's cgroup
// namespace, whose root is the cgroup it starts in, shows it that one
// cgroup and nothing of the host's cpuset tree. Its tasks file lists only
// the pids of the reader's own PID namespace.

// cgroupView is crun's /sys/fs/cgroup: the entries of root but those in
// drop. The zero value changes nothing.
type cgroupView struct {
	// root is the directory of the v1 mounts, /sys/fs/cgroup (where crun
	// looks); "": no view of its own, only unified unmounted.
	root string
	// drop names the entries of root left out: the cpuset hierarchy's
	// mount point and the cgroup2 one.
	drop map[string]bool
	// unified is the hybrid host's cgroup2 mount point: without a view of
	// its own, crun runs where it is unmounted (hideMount).
	unified string
}

// hidesCpuset reports whether crun runs without the cpuset hierarchy.
func (v cgroupView) hidesCpuset() bool { return v.root != "" }

// crunCgroupView is the view crun runs in on this host: without the
// cpuset hierarchy where cpuset is mounted on its own directly under
// /sys/fs/cgroup (v1 or hybrid), else only without the hybrid host's
// cgroup2 mount (hybrid; "" on a pure v1 or v2 host).
func (m cgroupMounts) crunCgroupView(hybrid string) cgroupView {
	v := cgroupView{unified: hybrid}
	const root = "/sys/fs/cgroup"
	cs, ok := m.v1["cpuset"]
	if m.v2 || !ok || filepath.Dir(cs) != root {
		return v
	}
	for c, mnt := range m.v1 {
		if c != "cpuset" && mnt == cs {
			return v // co-mounted with another controller crun must see
		}
	}
	v.root = root
	v.drop = map[string]bool{filepath.Base(cs): true}
	if hybrid != "" {
		if filepath.Dir(hybrid) != root {
			return cgroupView{unified: hybrid}
		}
		v.drop[filepath.Base(hybrid)] = true
	}
	return v
}

// apply gives the calling (locked) thread's private mount namespace this
// view: a read-only tmpfs over root holding clones of root's mounts but
// the dropped ones, and its symlinks (cpu -> cpu,cpuacct). Without a view
// of its own it only unmounts the cgroup2 mount.
func (v cgroupView) apply() error {
	if v.root == "" {
		if v.unified != "" {
			return hideMount(v.unified)
		}
		return nil
	}
	ents, err := os.ReadDir(v.root)
	if err != nil {
		return fmt.Errorf("read %s: %w", v.root, err)
	}
	type tree struct {
		name string
		fd   int
	}
	var trees []tree
	links := map[string]string{}
	defer func() {
		for _, t := range trees {
			unix.Close(t.fd)
		}
	}()
	for _, e := range ents {
		name := e.Name()
		if v.drop[name] {
			continue
		}
		p := filepath.Join(v.root, name)
		if e.Type()&os.ModeSymlink != 0 {
			dst, err := os.Readlink(p)
			if err != nil {
				return fmt.Errorf("read link %s: %w", p, err)
			}
			links[name] = dst
			continue
		}
		if !e.IsDir() || !isMountPoint(p) {
			continue
		}
		fd, err := unix.OpenTree(unix.AT_FDCWD, p, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
		if err != nil {
			return fmt.Errorf("clone mount %s: %w", p, err)
		}
		trees = append(trees, tree{name, fd})
	}
	const flags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	if err := unix.Mount("tmpfs", v.root, "tmpfs", flags, "mode=755,size=64k"); err != nil {
		return fmt.Errorf("mount crun's %s: %w", v.root, err)
	}
	for _, t := range trees {
		p := filepath.Join(v.root, t.name)
		if err := os.Mkdir(p, 0o755); err != nil {
			return fmt.Errorf("make crun's %s: %w", p, err)
		}
		if err := unix.MoveMount(t.fd, "", unix.AT_FDCWD, p, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("move mount to crun's %s: %w", p, err)
		}
	}
	for name, dst := range links {
		if err := os.Symlink(dst, filepath.Join(v.root, name)); err != nil {
			return fmt.Errorf("link crun's %s: %w", filepath.Join(v.root, name), err)
		}
	}
	// Nothing crun does belongs on the tmpfs itself (it takes EROFS there
	// for "no such hierarchy").
	if err := unix.Mount("", v.root, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|flags, ""); err != nil {
		return fmt.Errorf("make crun's %s read-only: %w", v.root, err)
	}
	return nil
}

// sharedCpuset is the sandboxes' shared cpuset cgroup: the tasks file of
// <cpuset mount>/<parent>/sandboxes.shared, held open, to which the thread
// that starts crun writes "0" (itself) first. Made again when something
// removed it.
type sharedCpuset struct {
	dir string
	mu  sync.Mutex
	f   *os.File
}

// newSharedCpuset makes the shared cpuset cgroup under parent in the v1
// cpuset hierarchy at mnt and opens its tasks file.
func newSharedCpuset(mnt, parent string) (*sharedCpuset, error) {
	s := &sharedCpuset{dir: filepath.Join(mnt, parent, SharedCpusetName)}
	if err := s.open(); err != nil {
		return nil, err
	}
	return s, nil
}

// open makes the cgroup and the ones above it that are missing, each
// without load balancing of its own (quietCpuset) and with the CPUs and
// memory nodes of the one above when it has none, and opens its tasks
// file.
func (s *sharedCpuset) open() error {
	var chain []string // s.dir and every dir above it up to the first with cpuset files
	for d := s.dir; ; d = filepath.Dir(d) {
		chain = append(chain, d)
		if _, err := os.Stat(filepath.Join(d, "cpuset.cpus")); err == nil && d != s.dir {
			break
		}
		if d == filepath.Dir(d) {
			return fmt.Errorf("no cpuset hierarchy above %s", s.dir)
		}
	}
	for i := len(chain) - 2; i >= 0; i-- {
		d := chain[i]
		if err := os.Mkdir(d, 0o755); err == nil {
			_ = os.WriteFile(filepath.Join(d, "cpuset.sched_load_balance"), []byte("0"), 0)
		} else if !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("make shared cpuset cgroup %s: %w", d, err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			cur, err := os.ReadFile(filepath.Join(d, f))
			if err != nil {
				return fmt.Errorf("read %s: %w", filepath.Join(d, f), err)
			}
			if strings.TrimSpace(string(cur)) != "" {
				continue
			}
			up, err := os.ReadFile(filepath.Join(chain[i+1], f))
			if err != nil {
				return fmt.Errorf("read %s: %w", filepath.Join(chain[i+1], f), err)
			}
			if err := os.WriteFile(filepath.Join(d, f), []byte(strings.TrimSpace(string(up))), 0); err != nil {
				return fmt.Errorf("write %s: %w", filepath.Join(d, f), err)
			}
		}
	}
	f, err := os.OpenFile(filepath.Join(s.dir, "tasks"), os.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s/tasks: %w", s.dir, err)
	}
	if s.f != nil {
		_ = s.f.Close()
	}
	s.f = f
	return nil
}

// join moves the calling (locked) thread into the shared cpuset cgroup:
// what it starts from here on starts there. A cgroup removed under the
// node is made again once. Joins are one at a time (each is a cgroup
// attach, which the kernel serializes anyway).
func (s *sharedCpuset) join() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, err := s.f.Write([]byte("0"))
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.ENODEV) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("join the sandboxes' shared cpuset cgroup %s: %w", s.dir, err)
	}
	// The calling thread may be in crun's mount namespace, which has no
	// cpuset hierarchy: made again on another thread, in the node's.
	c := make(chan error, 1)
	go func() { c <- s.open() }()
	if err := <-c; err != nil {
		return fmt.Errorf("make the sandboxes' shared cpuset cgroup again: %w", err)
	}
	if _, err := s.f.Write([]byte("0")); err != nil {
		return fmt.Errorf("join the sandboxes' shared cpuset cgroup %s: %w", s.dir, err)
	}
	return nil
}
