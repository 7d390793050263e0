package vm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
)

const cgroupRoot = "/sys/fs/cgroup"

// minShares is cgroup v1's least cpu.shares.
const minShares = 2

// unified reports whether the host has a pure cgroup v2 hierarchy.
func unified() bool {
	_, err := os.Stat(filepath.Join(cgroupRoot, "cgroup.controllers"))
	return err == nil
}

// makeCgroup makes the QEMU process's cgroup: vcpus cores of CPU time and
// memMB of memory (guest RAM plus MemoryOverheadMB); a best-effort one
// gets the least CPU weight (cpu.shares 2, cpu.weight 1).
func makeCgroup(path string, vcpus int, memMB int64, bestEffort bool) error {
	const period = 100000
	quota := strconv.Itoa(vcpus * period)
	mem := strconv.FormatInt(memMB<<20, 10)
	if unified() {
		dir := filepath.Join(cgroupRoot, path)
		parent := filepath.Dir(dir)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("vm cgroup: %w: %w", errdefs.ErrInternal, err)
		}
		_ = os.WriteFile(filepath.Join(parent, "cgroup.subtree_control"), []byte("+cpu +memory +pids"), 0o644)
		files := map[string]string{
			filepath.Join(dir, "cpu.max"):    quota + " " + strconv.Itoa(period),
			filepath.Join(dir, "memory.max"): mem,
		}
		if bestEffort {
			files[filepath.Join(dir, "cpu.weight")] = "1"
		}
		return writeAll(files)
	}
	for _, c := range cgroupControllers {
		if err := os.MkdirAll(filepath.Join(cgroupRoot, c, path), 0o755); err != nil {
			removeCgroup(path)
			return fmt.Errorf("vm cgroup %s: %w: %w", c, errdefs.ErrInternal, err)
		}
	}
	files := map[string]string{
		filepath.Join(cgroupRoot, "cpu", path, "cpu.cfs_period_us"):        strconv.Itoa(period),
		filepath.Join(cgroupRoot, "cpu", path, "cpu.cfs_quota_us"):         quota,
		filepath.Join(cgroupRoot, "memory", path, "memory.limit_in_bytes"): mem,
	}
	if bestEffort {
		files[filepath.Join(cgroupRoot, "cpu", path, "cpu.shares")] = strconv.Itoa(minShares)
	}
	if err := writeAll(files); err != nil {
		removeCgroup(path)
		return err
	}
	return nil
}

func writeAll(files map[string]string) error {
	for f, v := range files {
		if err := os.WriteFile(f, []byte(v), 0o644); err != nil {
			return fmt.Errorf("vm cgroup %s: %w: %w", filepath.Base(f), errdefs.ErrInternal, err)
		}
	}
	return nil
}

func joinCgroup(path string, pid int) error {
	p := []byte(strconv.Itoa(pid))
	if unified() {
		if err := os.WriteFile(filepath.Join(cgroupRoot, path, "cgroup.procs"), p, 0o644); err != nil {
			return fmt.Errorf("vm cgroup join: %w: %w", errdefs.ErrInternal, err)
		}
		return nil
	}
	for _, c := range cgroupControllers {
		if err := os.WriteFile(filepath.Join(cgroupRoot, c, path, "cgroup.procs"), p, 0o644); err != nil {
			return fmt.Errorf("vm cgroup %s join: %w: %w", c, errdefs.ErrInternal, err)
		}
	}
	return nil
}

// removeCgroup removes the sandbox's cgroup (its processes must be gone).
func removeCgroup(path string) {
	dirs := []string{filepath.Join(cgroupRoot, path)}
	if !unified() {
		dirs = dirs[:0]
		for _, c := range cgroupControllers {
			dirs = append(dirs, filepath.Join(cgroupRoot, c, path))
		}
	}
	for _, d := range dirs {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			continue
		}
	}
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}
