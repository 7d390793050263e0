package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// baseline runs plain `runc run` containers of the same rootfs, the peer
// our sandboxes are compared with. Every container, mount and cgroup it
// makes is removed by close.
type baseline struct {
	runc     string
	rootfs   string // lowerdir of every container's overlay
	dir      string // temp dir holding bundles and runc's state
	root     string // runc --root
	cgParent string // cgroup parent of every container, e.g. /opendsec-bench-123
	cg       cgroupInfo
	tmpl     specs.Spec
	stderr   *os.File // runc's stderr; a file so no pipe outlives a detached run
	seq      int
	live     map[string]*runcContainer
	// files are regular-file bind sources of a replayed bundle (e.g. the
	// agent's seccomp filter), by path relative to the bundle.
	files map[string][]byte
}

type runcContainer struct {
	id, bundle string
	mounted    bool
}

// limits are the sandbox resources our node gives by default; the baseline
// container gets the same so both pay for the same cgroup setup.
type limits struct {
	memoryMB int64
	cpu      float64
	pids     int64
}

// newBaseline makes the temp dir and the spec template with `runc spec`.
func newBaseline(ctx context.Context, runcPath, rootfs string, cg cgroupInfo, lim limits) (_ *baseline, retErr error) {
	runc, err := exec.LookPath(runcPath)
	if err != nil {
		return nil, fmt.Errorf("find runc (flag -runc; apt-get install runc): %w", err)
	}
	if _, err := os.Stat(filepath.Join(rootfs, "bin", "sleep")); err != nil {
		return nil, fmt.Errorf("baseline rootfs %s has no bin/sleep (flag -rootfs; build it with deploy/images/build.sh --no-import): %w", rootfs, err)
	}
	dir, err := os.MkdirTemp("", "odbench.")
	if err != nil {
		return nil, fmt.Errorf("make temp dir: %w", err)
	}
	b := &baseline{
		runc: runc, rootfs: rootfs, dir: dir, root: filepath.Join(dir, "runc"),
		cgParent: fmt.Sprintf("/opendsec-bench-%d", os.Getpid()), cg: cg,
		live: map[string]*runcContainer{},
	}
	defer func() {
		if retErr != nil {
			b.close(context.WithoutCancel(ctx))
		}
	}()
	if b.stderr, err = os.Create(filepath.Join(dir, "runc.stderr")); err != nil {
		return nil, fmt.Errorf("create runc stderr file: %w", err)
	}
	specDir := filepath.Join(dir, "spec")
	if err := os.Mkdir(specDir, 0o700); err != nil {
		return nil, fmt.Errorf("make spec dir: %w", err)
	}
	if out, err := exec.CommandContext(ctx, runc, "spec", "--bundle", specDir).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("runc spec: %w: %s", err, strings.TrimSpace(string(out)))
	}
	raw, err := os.ReadFile(filepath.Join(specDir, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("read generated config.json: %w", err)
	}
	if err := json.Unmarshal(raw, &b.tmpl); err != nil {
		return nil, fmt.Errorf("decode generated config.json: %w", err)
	}
	// The adjustments: our rootfs, no terminal, a long-lived process, a
	// writable root, our sandboxes' namespaces and resource limits.
	t := &b.tmpl
	t.Root = &specs.Root{Path: "rootfs", Readonly: false}
	t.Process.Terminal = false
	t.Process.Args = []string{"/bin/sleep", "100000"}
	t.Linux.Namespaces = []specs.LinuxNamespace{
		{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.UTSNamespace},
		{Type: specs.IPCNamespace}, {Type: specs.NetworkNamespace}, {Type: specs.CgroupNamespace},
	}
	mem := lim.memoryMB << 20
	quota, period := int64(lim.cpu*100000), uint64(100000)
	if t.Linux.Resources == nil {
		t.Linux.Resources = &specs.LinuxResources{}
	}
	t.Linux.Resources.Memory = &specs.LinuxMemory{Limit: &mem, Swap: &mem}
	t.Linux.Resources.CPU = &specs.LinuxCPU{Quota: &quota, Period: &period}
	t.Linux.Resources.Pids = &specs.LinuxPids{Limit: lim.pids}
	return b, nil
}

// prepare makes a bundle with a fresh overlay root and the baseline's
// config.json (the untimed part of a baseline create).
func (b *baseline) prepare() (*runcContainer, error) {
	return b.prepareSpec(b.tmpl, "")
}

// prepareSpec is prepare with config sp. Bind mounts whose source is under
// fromBundle (a sandbox's bundle the spec was copied from) are pointed at the
// same place in the new bundle.
func (b *baseline) prepareSpec(sp specs.Spec, fromBundle string) (*runcContainer, error) {
	b.seq++
	c := &runcContainer{id: fmt.Sprintf("odb%d-%d", os.Getpid(), b.seq)}
	c.bundle = filepath.Join(b.dir, c.id)
	b.live[c.id] = c
	for _, d := range []string{"upper", "work", "rootfs"} {
		if err := os.MkdirAll(filepath.Join(c.bundle, d), 0o700); err != nil {
			return c, fmt.Errorf("make bundle dir: %w", err)
		}
	}
	if err := mountOverlay(b.rootfs, filepath.Join(c.bundle, "upper"), filepath.Join(c.bundle, "work"), filepath.Join(c.bundle, "rootfs")); err != nil {
		return c, err
	}
	c.mounted = true
	if fromBundle != "" {
		sp.Mounts = slices.Clone(sp.Mounts)
		for i, m := range sp.Mounts {
			rel, ok := strings.CutPrefix(m.Source, fromBundle+"/")
			if !ok {
				continue
			}
			sp.Mounts[i].Source = filepath.Join(c.bundle, rel)
			if data, ok := b.files[rel]; ok {
				if err := os.WriteFile(sp.Mounts[i].Source, data, 0o444); err != nil {
					return c, fmt.Errorf("write bind source: %w", err)
				}
				continue
			}
			if err := os.MkdirAll(sp.Mounts[i].Source, 0o755); err != nil {
				return c, fmt.Errorf("make bind source: %w", err)
			}
		}
	}
	lin := *sp.Linux
	lin.CgroupsPath = b.cgParent + "/" + c.id
	sp.Linux = &lin
	sp.Hostname = c.id
	raw, err := json.MarshalIndent(&sp, "", "  ")
	if err != nil {
		return c, fmt.Errorf("encode config.json: %w", err)
	}
	if err := os.WriteFile(filepath.Join(c.bundle, "config.json"), raw, 0o600); err != nil {
		return c, fmt.Errorf("write config.json: %w", err)
	}
	return c, nil
}

// run times `runc run --detach` of a prepared container until it returns.
func (b *baseline) run(ctx context.Context, c *runcContainer) (time.Duration, error) {
	return b.timed(ctx, "run", "--detach", "--bundle", c.bundle, c.id)
}

// create and start time `runc create` and `runc start` separately, as
// our node runs them.
func (b *baseline) create(ctx context.Context, c *runcContainer) (time.Duration, error) {
	return b.timed(ctx, "create", "--bundle", c.bundle, c.id)
}

// createListening is create for a config whose init takes the agent's
// socket as fd 3 (--listen-fd 3), as our node runs it: the socket is bound
// at sock and listening before the timer starts and is handed over with
// --preserve-fds 1.
func (b *baseline) createListening(ctx context.Context, c *runcContainer, sock string) (time.Duration, error) {
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		return 0, fmt.Errorf("make agent socket dir: %w", err)
	}
	var lc net.ListenConfig
	l, err := lc.Listen(ctx, "unix", sock)
	if err != nil {
		return 0, fmt.Errorf("listen on agent socket: %w", err)
	}
	ul := l.(*net.UnixListener)
	ul.SetUnlinkOnClose(false) // the socket stays for the agent
	defer ul.Close()
	f, err := ul.File()
	if err != nil {
		return 0, fmt.Errorf("agent socket file: %w", err)
	}
	defer f.Close()
	return b.timedFiles(ctx, []*os.File{f}, "create", "--preserve-fds", "1", "--bundle", c.bundle, c.id)
}

func (b *baseline) start(ctx context.Context, c *runcContainer) (time.Duration, error) {
	return b.timed(ctx, "start", c.id)
}

// exec times `runc exec <id> true` until it returns.
func (b *baseline) exec(ctx context.Context, c *runcContainer) (time.Duration, error) {
	return b.timed(ctx, "exec", c.id, "true")
}

func (b *baseline) timed(ctx context.Context, args ...string) (time.Duration, error) {
	return b.timedFiles(ctx, nil, args...)
}

// timedFiles is timed with extra files for runc (fd 3 on).
func (b *baseline) timedFiles(ctx context.Context, extra []*os.File, args ...string) (time.Duration, error) {
	if err := b.stderr.Truncate(0); err != nil {
		return 0, fmt.Errorf("truncate runc stderr: %w", err)
	}
	cmd := exec.CommandContext(ctx, b.runc, append([]string{"--root", b.root}, args...)...)
	cmd.Stderr = b.stderr // stdin and stdout are /dev/null
	cmd.ExtraFiles = extra
	start := time.Now()
	err := cmd.Run()
	d := time.Since(start)
	if err != nil {
		msg, _ := os.ReadFile(b.stderr.Name())
		return 0, fmt.Errorf("runc %s: %w: %s", args[0], err, strings.TrimSpace(string(msg)))
	}
	return d, nil
}

// remove deletes the container, its mount, bundle and cgroup.
func (b *baseline) remove(ctx context.Context, c *runcContainer) error {
	var errs []error
	if _, err := os.Stat(filepath.Join(b.root, c.id)); err == nil {
		if out, err := exec.CommandContext(ctx, b.runc, "--root", b.root, "delete", "--force", c.id).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("runc delete %s: %w: %s", c.id, err, strings.TrimSpace(string(out))))
		}
	}
	if c.mounted {
		if err := unmount(filepath.Join(c.bundle, "rootfs")); err != nil {
			errs = append(errs, err)
		} else {
			c.mounted = false
		}
	}
	if !c.mounted {
		if err := os.RemoveAll(c.bundle); err != nil {
			errs = append(errs, fmt.Errorf("remove bundle: %w", err))
		}
	}
	if err := b.cg.removeAll(b.cgParent + "/" + c.id); err != nil {
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		delete(b.live, c.id)
	}
	return errors.Join(errs...)
}

// close removes every container still alive, the cgroup parent and the
// temp dir.
func (b *baseline) close(ctx context.Context) error {
	var errs []error
	for _, c := range b.live {
		errs = append(errs, b.remove(ctx, c))
	}
	if b.stderr != nil {
		b.stderr.Close()
	}
	errs = append(errs, b.cg.removeAll(b.cgParent))
	if len(b.live) == 0 {
		errs = append(errs, os.RemoveAll(b.dir))
	} else {
		errs = append(errs, fmt.Errorf("left %s in place: %d containers could not be removed", b.dir, len(b.live)))
	}
	return errors.Join(errs...)
}
