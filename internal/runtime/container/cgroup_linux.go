package container

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime"
)

// cgroupMounts describes where the cgroup hierarchies are mounted.
type cgroupMounts struct {
	v2      bool              // unified hierarchy only (production)
	unified string            // cgroup2 mount point, if any (v2, or hybrid's unified)
	v1      map[string]string // v1 controller (memory, cpuacct, pids, name=systemd...) -> mount point
}

// detectCgroups reads /proc/self/mountinfo and statfs(/sys/fs/cgroup).
func detectCgroups() (cgroupMounts, error) {
	m := cgroupMounts{v1: map[string]string{}}
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &st); err != nil {
		return m, fmt.Errorf("statfs /sys/fs/cgroup: %w", err)
	}
	m.v2 = st.Type == unix.CGROUP2_SUPER_MAGIC
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return m, fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 3 {
			continue
		}
		mnt := unescapeMount(pf[4])
		switch qf[0] {
		case "cgroup2":
			if m.unified == "" {
				m.unified = mnt
			}
		case "cgroup":
			for _, opt := range strings.Split(qf[2], ",") {
				switch opt {
				case "rw", "ro", "relatime", "noatime", "nosuid", "nodev", "noexec", "clone_children", "xattr", "nsdelegate":
					continue
				}
				if strings.Contains(opt, "=") && !strings.HasPrefix(opt, "name=") {
					continue
				}
				if _, dup := m.v1[opt]; !dup {
					m.v1[opt] = mnt
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		return m, fmt.Errorf("read mountinfo: %w", err)
	}
	if m.v2 && m.unified == "" {
		m.unified = "/sys/fs/cgroup"
	}
	return m, nil
}

func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// dirs returns every directory the cgroup path can have on the host: one per
// v1 hierarchy, plus the unified one.
func (m cgroupMounts) dirs(path string) []string {
	seen := map[string]bool{}
	var out []string
	add := func(mnt string) {
		d := filepath.Join(mnt, path)
		if !seen[d] {
			seen[d] = true
			out = append(out, d)
		}
	}
	if !m.v2 {
		for _, mnt := range m.v1 {
			add(mnt)
		}
	}
	if m.unified != "" {
		add(m.unified)
	}
	return out
}

// remove removes every directory of the cgroup path (runc delete normally
// does; this covers a crash between steps). A cgroup whose last task is still
// exiting reports EBUSY for a moment, so it retries until ctx or 5 s.
func (m cgroupMounts) remove(ctx context.Context, path string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var errs []error
	for _, d := range m.dirs(path) {
		for {
			err := unix.Rmdir(d)
			if err == nil || errors.Is(err, unix.ENOENT) {
				break
			}
			if !errors.Is(err, unix.EBUSY) || ctx.Err() != nil {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return errors.Join(errs...)
}

// setPidsMax makes the cgroup path (the sandboxes' parent) in the pids
// hierarchy and writes its pids.max: the kernel then refuses a fork
// anywhere under it past limit, however the sandboxes' own limits add up.
// On v2 it first enables the pids controller down to path, as runc does
// for a container's cgroup.
func (m cgroupMounts) setPidsMax(path string, limit int64) error {
	root := m.unified
	if !m.v2 {
		root = m.v1["pids"]
	}
	if root == "" {
		return errors.New("no pids cgroup hierarchy is mounted")
	}
	dir := root
	for _, elem := range strings.Split(strings.Trim(filepath.Clean(path), "/"), "/") {
		if m.v2 {
			if err := enablePids(dir); err != nil {
				return err
			}
		}
		dir = filepath.Join(dir, elem)
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("make cgroup: %w", err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.FormatInt(limit, 10)), 0); err != nil {
		return fmt.Errorf("write pids.max: %w", err)
	}
	return nil
}

// enablePids adds the pids controller to a v2 cgroup's subtree_control
// unless it is there.
func enablePids(dir string) error {
	f := filepath.Join(dir, "cgroup.subtree_control")
	b, err := os.ReadFile(f)
	if err != nil {
		return fmt.Errorf("read %s: %w", f, err)
	}
	for _, c := range strings.Fields(string(b)) {
		if c == "pids" {
			return nil
		}
	}
	if err := os.WriteFile(f, []byte("+pids"), 0); err != nil {
		return fmt.Errorf("enable the pids controller in %s: %w", f, err)
	}
	return nil
}

// pidsMaxFile is the pids.max of the cgroup path.
func (m cgroupMounts) pidsMaxFile(path string) string {
	if m.v2 {
		return filepath.Join(m.unified, path, "pids.max")
	}
	return filepath.Join(m.v1["pids"], path, "pids.max")
}

// existing returns the cgroup directories of path that exist.
func (m cgroupMounts) existing(path string) []string {
	var out []string
	for _, d := range m.dirs(path) {
		if _, err := os.Stat(d); err == nil {
			out = append(out, d)
		}
	}
	return out
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return -1, nil
	}
	return strconv.ParseInt(s, 10, 64)
}

// stats reads memory, cpu and pids use of the cgroup path.
func (m cgroupMounts) stats(path string) (runtime.Stats, error) {
	var st runtime.Stats
	var err error
	if m.v2 {
		d := filepath.Join(m.unified, path)
		if st.MemoryBytes, err = readInt(filepath.Join(d, "memory.current")); err != nil {
			return st, fmt.Errorf("read memory.current: %w", err)
		}
		if st.Pids, err = readInt(filepath.Join(d, "pids.current")); err != nil {
			return st, fmt.Errorf("read pids.current: %w", err)
		}
		b, err := os.ReadFile(filepath.Join(d, "cpu.stat"))
		if err != nil {
			return st, fmt.Errorf("read cpu.stat: %w", err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
				us, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
				if err != nil {
					return st, fmt.Errorf("parse cpu.stat: %w", err)
				}
				st.CPUNanos = us * 1000
			}
		}
		st.MemoryCacheBytes, _ = readKeyed(filepath.Join(d, "memory.stat"), "file")
		st.MemoryLimitBytes, _ = readInt(filepath.Join(d, "memory.max"))
		st.PidsLimit, _ = readInt(filepath.Join(d, "pids.max"))
		st.MemoryLimitBytes, st.PidsLimit = max(st.MemoryLimitBytes, 0), max(st.PidsLimit, 0)
		return st, nil
	}
	if st.MemoryBytes, err = readInt(filepath.Join(m.v1["memory"], path, "memory.usage_in_bytes")); err != nil {
		return st, fmt.Errorf("read memory.usage_in_bytes: %w", err)
	}
	if st.Pids, err = readInt(filepath.Join(m.v1["pids"], path, "pids.current")); err != nil {
		return st, fmt.Errorf("read pids.current: %w", err)
	}
	cpu, err := readInt(filepath.Join(m.v1["cpuacct"], path, "cpuacct.usage"))
	if err != nil {
		return st, fmt.Errorf("read cpuacct.usage: %w", err)
	}
	st.CPUNanos = uint64(cpu)
	mem := filepath.Join(m.v1["memory"], path)
	st.MemoryCacheBytes, _ = readKeyed(filepath.Join(mem, "memory.stat"), "total_cache")
	st.MemoryLimitBytes, _ = readInt(filepath.Join(mem, "memory.limit_in_bytes"))
	st.PidsLimit, _ = readInt(filepath.Join(m.v1["pids"], path, "pids.max"))
	st.MemoryLimitBytes, st.PidsLimit = max(st.MemoryLimitBytes, 0), max(st.PidsLimit, 0)
	return st, nil
}

// cpusetLoadBalanced reports whether the v1 cpuset hierarchy's root
// balances load across all its CPUs (cpuset.sched_load_balance 1, the
// kernel's default): then the scheduler's domains span every CPU whatever
// the flag of a cpuset below says, and setting it to 0 changes nothing
// but what writes to that cpuset cost (quietCpuset).
func (m cgroupMounts) cpusetLoadBalanced() bool {
	mnt, ok := m.v1["cpuset"]
	if m.v2 || !ok {
		return false
	}
	b, err := os.ReadFile(filepath.Join(mnt, "cpuset.sched_load_balance"))
	return err == nil && strings.TrimSpace(string(b)) == "1"
}

// quietCpuset makes the sandbox's v1 cpuset cgroup at path before the OCI
// runtime does, with cpuset.sched_load_balance 0 (only where
// cpusetLoadBalanced holds: the caller checks). A new cpuset starts with
// the flag set, and on cgroup v1 the kernel then rebuilds the scheduler's
// domains whenever its CPUs change (the runtime copies the parent's into
// it) and again when it is removed: each rebuild walks every cpuset on the
// host (generate_sched_domains, dl_rebuild_rd_accounting) under the
// cpuset lock, to arrive at the same one domain, so with a thousand
// sandboxes on the node every create and every stop paid for all of them.
// Best effort: the runtime makes the cgroup as before when this fails (the
// parent does not exist yet at the node's first create). The OCI runtime
// takes the existing directory as it is, and Delete removes it with the
// others.
func (m cgroupMounts) quietCpuset(path string) {
	dir := filepath.Join(m.v1["cpuset"], path)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return
	}
	_ = os.WriteFile(filepath.Join(dir, "cpuset.sched_load_balance"), []byte("0"), 0)
}
