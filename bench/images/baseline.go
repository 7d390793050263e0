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
	"sync"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// baseline is the paper's rejected alternative: every container gets its
// own root, made by extracting the image's layer tarballs into a fresh
// directory, and runs with `runc run --detach` on it. Every container,
// root and cgroup it makes is removed by remove/close.
type baseline struct {
	cfg      config
	runc     string
	dir      string // holds bundles
	root     string // runc --root
	cgParent string
	cgMounts map[string]string
	cgMode   string
	tmpl     specs.Spec
	disk     disk

	mu   sync.Mutex
	seq  int
	live map[string]string // id -> bundle
}

func newBaseline(ctx context.Context, c config, dir string) (*baseline, error) {
	runc, err := exec.LookPath(c.runc)
	if err != nil {
		return nil, fmt.Errorf("find runc (flag -runc; apt-get install runc): %w", err)
	}
	if _, err := exec.LookPath("tar"); err != nil {
		return nil, fmt.Errorf("find tar: %w", err)
	}
	bl := &baseline{
		cfg: c, runc: runc, dir: filepath.Join(dir, "baseline"), root: filepath.Join(dir, "runc"),
		cgParent: fmt.Sprintf("/opendsec-bench-images-%d", os.Getpid()), live: map[string]string{},
	}
	if bl.cgMounts, bl.cgMode, err = cgroupMounts(); err != nil {
		return nil, err
	}
	if bl.disk, err = diskOf(dir); err != nil {
		return nil, err
	}
	specDir := filepath.Join(dir, "spec")
	for _, d := range []string{bl.dir, specDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("make baseline dir: %w", err)
		}
	}
	if out, err := exec.CommandContext(ctx, runc, "spec", "--bundle", specDir).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("runc spec: %w: %s", err, strings.TrimSpace(string(out)))
	}
	raw, err := os.ReadFile(filepath.Join(specDir, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("read generated config.json: %w", err)
	}
	if err := json.Unmarshal(raw, &bl.tmpl); err != nil {
		return nil, fmt.Errorf("decode generated config.json: %w", err)
	}
	// Our sandboxes' namespaces and limits, a writable root, a long sleep.
	t := &bl.tmpl
	t.Root = &specs.Root{Path: "rootfs", Readonly: false}
	t.Process.Terminal = false
	t.Process.Args = []string{"/bin/sleep", "100000"}
	t.Linux.Namespaces = []specs.LinuxNamespace{
		{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.UTSNamespace},
		{Type: specs.IPCNamespace}, {Type: specs.NetworkNamespace}, {Type: specs.CgroupNamespace},
	}
	mem := c.memoryMB << 20
	quota, period := int64(c.cpu*100000), uint64(100000)
	if t.Linux.Resources == nil {
		t.Linux.Resources = &specs.LinuxResources{}
	}
	t.Linux.Resources.Memory = &specs.LinuxMemory{Limit: &mem, Swap: &mem}
	t.Linux.Resources.CPU = &specs.LinuxCPU{Quota: &quota, Period: &period}
	t.Linux.Resources.Pids = &specs.LinuxPids{Limit: c.pids}
	return bl, nil
}

// run starts n containers of im, cfg.parallel at a time, each: extract
// every layer tarball into a fresh root, write config.json, runc run
// --detach. It refuses to start when n roots would not fit on the disk
// with cfg.marginGiB to spare.
func (bl *baseline) run(ctx context.Context, im *benchImage, n int) (result, error) {
	res := result{n: n}
	free, err := freeBytes(bl.dir)
	if err != nil {
		return res, err
	}
	need := int64(n)*(im.content+im.content/16) + int64(bl.cfg.marginGiB)<<30
	if free < need {
		return res, fmt.Errorf("%d extracted roots of %s need about %s with the %d GiB margin, but only %s is free; lower -baseline-big or -small-count (nothing is scaled down silently)",
			n, human(im.content), human(need), bl.cfg.marginGiB, human(free))
	}
	du0 := du(bl.dir)
	w0, err := bl.disk.written()
	if err != nil {
		return res, err
	}
	ids := make([]string, n)
	each := make([]time.Duration, n)
	errs := make([]error, n)
	jobs := make(chan int)
	var wg sync.WaitGroup
	start := time.Now()
	for range bl.cfg.parallel {
		wg.Go(func() {
			for i := range jobs {
				t0 := time.Now()
				ids[i], errs[i] = bl.start(ctx, im)
				each[i] = time.Since(t0)
			}
		})
	}
	for i := range n {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	res.allRunning = time.Since(start)
	res.each = each
	defer bl.removeAll(context.WithoutCancel(ctx), ids)
	if err := errors.Join(errs...); err != nil {
		return res, err
	}
	for _, id := range ids {
		out, err := exec.CommandContext(ctx, bl.runc, "--root", bl.root, "state", id).Output()
		if err != nil {
			return res, fmt.Errorf("runc state %s: %w", id, err)
		}
		var st struct{ Status string }
		if err := json.Unmarshal(out, &st); err != nil || st.Status != "running" {
			return res, fmt.Errorf("container %s is %q, want running (%v)", id, st.Status, err)
		}
	}
	w1, err := bl.disk.written()
	if err != nil {
		return res, err
	}
	res.written = w1 - w0
	res.du = du(bl.dir) - du0
	return res, nil
}

// start makes one container: its root extracted from im's tarballs, then
// runc run --detach.
func (bl *baseline) start(ctx context.Context, im *benchImage) (string, error) {
	bl.mu.Lock()
	bl.seq++
	id := fmt.Sprintf("odbi%d-%d", os.Getpid(), bl.seq)
	bundle := filepath.Join(bl.dir, id)
	bl.live[id] = bundle
	bl.mu.Unlock()
	rootfs := filepath.Join(bundle, "rootfs")
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		return id, fmt.Errorf("make root: %w", err)
	}
	for _, l := range im.layers {
		out, err := exec.CommandContext(ctx, "tar", "--numeric-owner", "-xzf", l, "-C", rootfs).CombinedOutput()
		if err != nil {
			return id, fmt.Errorf("extract %s: %w: %s", filepath.Base(l), err, strings.TrimSpace(string(out)))
		}
	}
	sp := bl.tmpl
	lin := *sp.Linux
	lin.CgroupsPath = bl.cgParent + "/" + id
	sp.Linux = &lin
	sp.Hostname = id
	raw, err := json.Marshal(&sp)
	if err != nil {
		return id, fmt.Errorf("encode config.json: %w", err)
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), raw, 0o600); err != nil {
		return id, fmt.Errorf("write config.json: %w", err)
	}
	// stderr to a file: no pipe may outlive a detached run.
	ef, err := os.Create(filepath.Join(bundle, "runc.stderr"))
	if err != nil {
		return id, err
	}
	defer ef.Close()
	cmd := exec.CommandContext(ctx, bl.runc, "--root", bl.root, "run", "--detach", "--bundle", bundle, id)
	cmd.Stderr = ef
	if err := cmd.Run(); err != nil {
		msg, _ := os.ReadFile(ef.Name())
		return id, fmt.Errorf("runc run %s: %w: %s", id, err, strings.TrimSpace(string(msg)))
	}
	return id, nil
}

// removeAll removes containers, cfg.parallel at a time.
func (bl *baseline) removeAll(ctx context.Context, ids []string) error {
	sem := make(chan struct{}, bl.cfg.parallel)
	var wg sync.WaitGroup
	errs := make([]error, len(ids))
	for i, id := range ids {
		if id == "" {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[i] = bl.remove(ctx, id)
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// remove deletes the container, its root and its cgroup.
func (bl *baseline) remove(ctx context.Context, id string) error {
	bl.mu.Lock()
	bundle, ok := bl.live[id]
	bl.mu.Unlock()
	if !ok {
		return nil
	}
	if _, err := os.Stat(filepath.Join(bl.root, id)); err == nil {
		if out, err := exec.CommandContext(ctx, bl.runc, "--root", bl.root, "delete", "--force", id).CombinedOutput(); err != nil {
			return fmt.Errorf("runc delete %s: %w: %s", id, err, strings.TrimSpace(string(out)))
		}
	}
	if err := os.RemoveAll(bundle); err != nil {
		return fmt.Errorf("remove bundle: %w", err)
	}
	if err := removeCgroup(bl.cgMounts, bl.cgParent+"/"+id); err != nil {
		return err
	}
	bl.mu.Lock()
	delete(bl.live, id)
	bl.mu.Unlock()
	return nil
}

// close removes every container still alive and the cgroup parent.
func (bl *baseline) close(ctx context.Context) error {
	bl.mu.Lock()
	var ids []string
	for id := range bl.live {
		ids = append(ids, id)
	}
	bl.mu.Unlock()
	err := bl.removeAll(ctx, ids)
	return errors.Join(err, removeCgroup(bl.cgMounts, bl.cgParent))
}
