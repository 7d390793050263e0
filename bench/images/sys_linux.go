package main

import (
	"bufio"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// disk is the block device holding a directory, whose write counter
// measures bytes written.
type disk struct {
	name string // e.g. vda (from /sys/dev/block/M:m/uevent)
	stat string // /sys/dev/block/M:m/stat
}

func diskOf(dir string) (disk, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return disk{}, fmt.Errorf("stat %s: %w", dir, err)
	}
	base := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	d := disk{name: base, stat: base + "/stat"}
	if _, err := os.Stat(d.stat); err != nil {
		return disk{}, fmt.Errorf("%s is on device %d:%d, which has no block statistics (%v); run with -work on a block-device file system", dir, unix.Major(st.Dev), unix.Minor(st.Dev), err)
	}
	if b, err := os.ReadFile(base + "/uevent"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "DEVNAME="); ok {
				d.name = v
			}
		}
	}
	return d, nil
}

// written syncs every file system and returns the bytes the device has
// written since boot (sectors written x 512, field 7 of its stat file).
func (d disk) written() (int64, error) {
	unix.Sync()
	b, err := os.ReadFile(d.stat)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", d.stat, err)
	}
	f := strings.Fields(string(b))
	if len(f) < 7 {
		return 0, fmt.Errorf("%s: %d fields, want >= 7", d.stat, len(f))
	}
	sectors, err := strconv.ParseInt(f[6], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", d.stat, err)
	}
	return sectors * 512, nil
}

// du is the disk usage (allocated blocks) of the tree at root, not
// crossing into other file systems (a sandbox's overlay root, a mounted
// layer) and counting a hard-linked file once.
func du(root string) int64 {
	var rst unix.Stat_t
	if unix.Lstat(root, &rst) != nil {
		return 0
	}
	seen := map[uint64]bool{}
	var total int64
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		var st unix.Stat_t
		if unix.Lstat(p, &st) != nil {
			return nil
		}
		if st.Dev != rst.Dev {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if st.Nlink > 1 && !d.IsDir() {
			if seen[st.Ino] {
				return nil
			}
			seen[st.Ino] = true
		}
		total += st.Blocks * 512
		return nil
	})
	return total
}

// treeBytes is the bytes of regular file content under root.
func treeBytes(root string) int64 {
	var total int64
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				total += fi.Size()
			}
		}
		return nil
	})
	return total
}

// freeBytes is what an unprivileged writer may still use on dir's file
// system (we keep root's reserve out of the budget too).
func freeBytes(dir string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return int64(st.Bavail) * st.Bsize, nil
}

// cgroupMounts maps each cgroup hierarchy to its mount point (v1
// controllers and the unified one), to remove the baseline's cgroups.
func cgroupMounts() (map[string]string, string, error) {
	out := map[string]string{}
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &st); err != nil {
		return nil, "", fmt.Errorf("statfs /sys/fs/cgroup: %w", err)
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, "", fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
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
		switch qf[0] {
		case "cgroup2":
			out["unified"] = pf[4]
		case "cgroup":
			out[qf[2]] = pf[4]
		}
	}
	mode := "v1 hybrid"
	switch {
	case st.Type == unix.CGROUP2_SUPER_MAGIC:
		mode = "v2 (unified)"
	case out["unified"] == "":
		mode = "v1 legacy"
	}
	return out, mode, sc.Err()
}

// removeCgroup removes the cgroup path in every hierarchy; missing is fine.
func removeCgroup(mounts map[string]string, path string) error {
	var errs []string
	for _, mnt := range mounts {
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

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "unknown"
	}
	return unix.ByteSliceToString(u.Release[:]) + " " + unix.ByteSliceToString(u.Machine[:])
}
