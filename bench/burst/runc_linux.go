package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// runcLoop times `runc run --detach` of c.runcN containers one after the
// other, each on a fresh overlay of c.rootfs (made before its timer starts)
// in its own namespaces (network included) and cgroup with the sandboxes'
// limits, and removes them all afterwards.
func runcLoop(ctx context.Context, c config, r *result) (retErr error) {
	runc, err := exec.LookPath(c.runc)
	if err != nil {
		return fmt.Errorf("find runc (flag -runc): %w", err)
	}
	dir, err := os.MkdirTemp("", "odburst.")
	if err != nil {
		return fmt.Errorf("make temp dir: %w", err)
	}
	root := filepath.Join(dir, "runc")
	cgParent := fmt.Sprintf("/opendsec-burst-%d", os.Getpid())
	var made []string
	defer func() {
		dctx := context.WithoutCancel(ctx)
		var errs []error
		for _, id := range made {
			if out, err := exec.CommandContext(dctx, runc, "--root", root, "delete", "--force", id).CombinedOutput(); err != nil {
				errs = append(errs, fmt.Errorf("runc delete %s: %w: %s", id, err, out))
			}
			if err := unix.Unmount(filepath.Join(dir, id, "rootfs"), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
				errs = append(errs, fmt.Errorf("unmount %s: %w", id, err))
			}
		}
		cgs, _ := filepath.Glob("/sys/fs/cgroup/*" + cgParent)
		if cg := "/sys/fs/cgroup" + cgParent; fileExists(cg) {
			cgs = append(cgs, cg)
		}
		for _, cg := range cgs {
			_ = os.Remove(cg)
		}
		if len(errs) == 0 {
			errs = append(errs, os.RemoveAll(dir))
		}
		retErr = errors.Join(retErr, errors.Join(errs...))
	}()
	tmpl, err := runcSpec(ctx, runc, dir, c)
	if err != nil {
		return err
	}
	stderr, err := os.Create(filepath.Join(dir, "runc.out"))
	if err != nil {
		return fmt.Errorf("create runc output file: %w", err)
	}
	defer stderr.Close()
	var timed time.Duration
	for i := range c.runcN {
		id := fmt.Sprintf("odburst%d-%d", os.Getpid(), i)
		bundle := filepath.Join(dir, id)
		for _, d := range []string{"upper", "work", "rootfs"} {
			if err := os.MkdirAll(filepath.Join(bundle, d), 0o700); err != nil {
				return fmt.Errorf("make bundle: %w", err)
			}
		}
		opts := fmt.Sprintf("lowerdir=%s,upperdir=%s/upper,workdir=%s/work", c.rootfs, bundle, bundle)
		if err := unix.Mount("overlay", filepath.Join(bundle, "rootfs"), "overlay", 0, opts); err != nil {
			return fmt.Errorf("mount overlay: %w", err)
		}
		made = append(made, id)
		sp := tmpl
		lin := *sp.Linux
		lin.CgroupsPath = cgParent + "/" + id
		sp.Linux, sp.Hostname = &lin, id
		raw, err := json.Marshal(&sp)
		if err != nil {
			return fmt.Errorf("encode config.json: %w", err)
		}
		if err := os.WriteFile(filepath.Join(bundle, "config.json"), raw, 0o600); err != nil {
			return fmt.Errorf("write config.json: %w", err)
		}
		// Output to a file: a pipe would stay open in the detached
		// container and the wait would never end.
		if err := stderr.Truncate(0); err != nil {
			return fmt.Errorf("truncate runc output: %w", err)
		}
		cmd := exec.CommandContext(ctx, runc, "--root", root, "run", "--detach", "--bundle", bundle, id)
		cmd.Stdout, cmd.Stderr = stderr, stderr
		t := time.Now()
		err = cmd.Run()
		d := time.Since(t)
		if err != nil {
			out, _ := os.ReadFile(stderr.Name())
			return fmt.Errorf("runc run %s: %w: %s", id, err, strings.TrimSpace(string(out)))
		}
		timed += d
		r.RuncRunMS = append(r.RuncRunMS, ms(d))
	}
	r.RuncTotalMS = ms(timed)
	return nil
}

// runcSpec is `runc spec` adjusted: the rootfs, a long-lived process, the
// sandboxes' namespaces and limits.
func runcSpec(ctx context.Context, runc, dir string, c config) (specs.Spec, error) {
	var sp specs.Spec
	if !fileExists(filepath.Join(c.rootfs, "bin", "sleep")) {
		return sp, fmt.Errorf("rootfs %s has no bin/sleep (flag -rootfs; deploy/images/build.sh --no-import builds it)", c.rootfs)
	}
	specDir := filepath.Join(dir, "spec")
	if err := os.MkdirAll(specDir, 0o700); err != nil {
		return sp, fmt.Errorf("make spec dir: %w", err)
	}
	if out, err := exec.CommandContext(ctx, runc, "spec", "--bundle", specDir).CombinedOutput(); err != nil {
		return sp, fmt.Errorf("runc spec: %w: %s", err, out)
	}
	raw, err := os.ReadFile(filepath.Join(specDir, "config.json"))
	if err != nil {
		return sp, fmt.Errorf("read config.json: %w", err)
	}
	if err := json.Unmarshal(raw, &sp); err != nil {
		return sp, fmt.Errorf("decode config.json: %w", err)
	}
	sp.Root = &specs.Root{Path: "rootfs"}
	sp.Process.Terminal = false
	sp.Process.Args = []string{"/bin/sleep", "100000"}
	sp.Linux.Namespaces = []specs.LinuxNamespace{
		{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.UTSNamespace},
		{Type: specs.IPCNamespace}, {Type: specs.NetworkNamespace}, {Type: specs.CgroupNamespace},
	}
	mem := c.memoryMB << 20
	quota, period := int64(c.cpu*100000), uint64(100000)
	sp.Linux.Resources = &specs.LinuxResources{
		Memory: &specs.LinuxMemory{Limit: &mem, Swap: &mem},
		CPU:    &specs.LinuxCPU{Quota: &quota, Period: &period},
		Pids:   &specs.LinuxPids{Limit: 1024},
	}
	return sp, nil
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// fsInodesUsed is the number of inodes in use on the file system of dir.
func fsInodesUsed(dir string) (int64, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return 0, err
	}
	return int64(fs.Files) - int64(fs.Ffree), nil
}
