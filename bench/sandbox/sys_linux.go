package main

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// mountOverlay mounts an overlayfs at target with lower as its only layer.
func mountOverlay(lower, upper, work, target string) error {
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work)
	if err := unix.Mount("overlay", target, "overlay", 0, opts); err != nil {
		return fmt.Errorf("mount overlay %s: %w", target, err)
	}
	return nil
}

// unmount unmounts target, lazily if it is busy.
func unmount(target string) error {
	err := unix.Unmount(target, 0)
	if err == nil || err == unix.EINVAL || err == unix.ENOENT {
		return nil
	}
	if err2 := unix.Unmount(target, unix.MNT_DETACH); err2 != nil {
		return fmt.Errorf("unmount %s: %w", target, err)
	}
	return nil
}

// cgroupInfo says how cgroups are mounted on this host.
type cgroupInfo struct {
	v2     bool              // unified hierarchy only
	mode   string            // "v2 (unified)", "v1 hybrid", "v1 legacy"
	mounts map[string]string // hierarchy (controller list or "unified") -> mount point
	memory string            // where the memory controller is mounted
}

func detectCgroups() (cgroupInfo, error) {
	ci := cgroupInfo{mounts: map[string]string{}}
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &st); err != nil {
		return ci, fmt.Errorf("statfs /sys/fs/cgroup: %w", err)
	}
	ci.v2 = st.Type == unix.CGROUP2_SUPER_MAGIC
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return ci, fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	unified := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 3 {
			continue
		}
		mnt := pf[4]
		switch qf[0] {
		case "cgroup2":
			unified = true
			ci.mounts["unified"] = mnt
		case "cgroup":
			ci.mounts[qf[2]] = mnt
			for _, o := range strings.Split(qf[2], ",") {
				if o == "memory" {
					ci.memory = mnt
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		return ci, fmt.Errorf("read mountinfo: %w", err)
	}
	switch {
	case ci.v2:
		ci.mode = "v2 (unified)"
		ci.memory = "/sys/fs/cgroup"
	case unified:
		ci.mode = "v1 hybrid (v1 controllers + cgroup2 at " + ci.mounts["unified"] + ")"
	default:
		ci.mode = "v1 legacy"
	}
	return ci, nil
}

// removeAll removes the cgroup directory path (relative to each hierarchy's
// root) in every hierarchy; missing ones are fine.
func (ci cgroupInfo) removeAll(path string) error {
	var errs []string
	for _, mnt := range ci.mounts {
		d := filepath.Join(mnt, path)
		if err := unix.Rmdir(d); err != nil && err != unix.ENOENT {
			errs = append(errs, fmt.Sprintf("%s: %v", d, err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("remove cgroup %s: %s", path, strings.Join(errs, "; "))
	}
	return nil
}

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "unknown"
	}
	return unix.ByteSliceToString(u.Release[:]) + " " + unix.ByteSliceToString(u.Machine[:])
}

// freeze writes the freezer of the cgroup at path (relative to the
// hierarchies) and waits until the kernel reports it frozen or thawed: the
// least a pause can cost, the baseline of our PauseSandbox.
func (ci cgroupInfo) freeze(path string, frozen bool) error {
	if ci.v2 || ci.mounts["unified"] != "" && ci.freezerMount() == "" {
		dir := filepath.Join(ci.mounts["unified"], path)
		v := "0"
		if frozen {
			v = "1"
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.freeze"), []byte(v), 0); err != nil {
			return err
		}
		for {
			b, err := os.ReadFile(filepath.Join(dir, "cgroup.events"))
			if err != nil {
				return err
			}
			if strings.Contains(string(b), "frozen "+v) {
				return nil
			}
		}
	}
	file := filepath.Join(ci.freezerMount(), path, "freezer.state")
	want := "THAWED"
	if frozen {
		want = "FROZEN"
	}
	if err := os.WriteFile(file, []byte(want), 0); err != nil {
		return err
	}
	for {
		b, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(b)) == want {
			return nil
		}
	}
}

// freezerMount is where the v1 freezer controller is mounted ("" if not).
func (ci cgroupInfo) freezerMount() string {
	for opts, mnt := range ci.mounts {
		for _, o := range strings.Split(opts, ",") {
			if o == "freezer" {
				return mnt
			}
		}
	}
	return ""
}
