package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

var (
	_ runtime.Runtime     = (*Runtime)(nil)
	_ runtime.Pauser      = (*Runtime)(nil)
	_ runtime.Snapshotter = (*Runtime)(nil)
	_ runtime.Forker      = (*Runtime)(nil)
)

const (
	handleVersion = 1
	// agentPort is where the agent listens on the sandbox's loopback. It is
	// in the checkpoint, so restored sandboxes listen on it too.
	agentPort      = 7710
	agentInSandbox = "/.opendsec/agent"
	rootfsDir      = "rootfs"
	stubDir        = "stub"
	// launchDir (in the state dir) is bind-mounted read-only at
	// launchInSandbox: Launch writes the agent's env file there before
	// `runsc start`.
	launchDir       = "launch"
	launchInSandbox = "/.opendsec/launch"
	launchEnvFile   = "env"
	defaultPids     = 1024
	imageDir        = "checkpoint"
	exitFile        = "exit.json"
	defaultPath     = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

// defaultCaps is Docker's default capability set (as the container
// backend's), enforced by gVisor's kernel.
var defaultCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

// handleState is the backend's blob in runtime.Handle.State.
type handleState struct {
	Bundle       string `json:"bundle"`
	OwnsStateDir bool   `json:"owns_state_dir,omitempty"`
	// RestoreFrom is the checkpoint Start restores instead of running init.
	RestoreFrom string `json:"restore_from,omitempty"`
	// Overlay: rootfs is an overlay mount of several layers the backend made.
	Overlay bool `json:"overlay,omitempty"`
	// MemoryMB and PidsLimit are the sandbox's limits, for Stats.
	MemoryMB  int64 `json:"memory_mb,omitempty"`
	PidsLimit int64 `json:"pids_limit,omitempty"`
	// DiskMB is the root overlay's size limit (0: none).
	DiskMB int64 `json:"disk_mb,omitempty"`
	// Network is the node's tap attachment, which Start wires.
	Network *runtime.NetworkAttachment `json:"network,omitempty"`
}

type sandbox struct {
	id      string
	st      handleState
	network runtime.NetworkMode
	op      sync.Mutex
	// prestarted: `runsc create` made it (Prestart); started: it runs.
	prestarted bool
	started    bool
	deleted    bool
	// exit keeps init's end for Wait.
	exit *runtime.ExitLatch
	// parking: the watcher (its watched channel) whose process's exit is
	// Reclaim's checkpoint (the sandbox lives on, paused, in reclaimDir):
	// that watcher returns without ending the sandbox, however late.
	// watched is closed when the current watcher returned. reclaimed: no
	// sandbox process runs, Resume restores it from reclaimDir.
	parking   atomic.Pointer[chan struct{}]
	watched   chan struct{}
	reclaimed atomic.Bool
}

func (sb *sandbox) ended() bool { return sb.exit.Ended() }

func (sb *sandbox) finish(es runtime.ExitStatus) { sb.exit.Finish(es) }

// Runtime is the gvisor backend.
type Runtime struct {
	cfg     Config
	runsc   string
	version string

	// seccomp is Docker's default profile for defaultCaps, which the
	// Sentry enforces on the guest's syscalls (--oci-seccomp).
	seccomp *specs.LinuxSeccomp

	mu        sync.Mutex
	sandboxes map[string]*sandbox
}

// New checks that runsc is there and works, and returns the backend.
func New(ctx context.Context, cfg Config) (runtime.Runtime, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	path, err := exec.LookPath(cfg.RunscPath)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition,
			"gvisor.runsc_path: runsc binary %q not found (install it with scripts/install-deps.sh, which builds a pinned runsc): %v", cfg.RunscPath, err)
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "gvisor backend needs root (euid is %d)", os.Geteuid())
	}
	out, err := exec.CommandContext(ctx, path, "--version").Output()
	if err != nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "gvisor.runsc_path: run %s --version: %v", path, err)
	}
	if err := os.MkdirAll(cfg.StateRoot, 0o700); err != nil {
		return nil, fmt.Errorf("create runsc state root: %w", err)
	}
	version := strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
	prof, err := seccomp.GetDefaultProfile(&specs.Spec{Process: &specs.Process{
		Capabilities: &specs.LinuxCapabilities{Bounding: defaultCaps, Effective: defaultCaps, Permitted: defaultCaps},
	}})
	if err != nil {
		return nil, fmt.Errorf("default seccomp profile: %w", err)
	}
	return &Runtime{cfg: cfg, runsc: path, version: version, seccomp: prof, sandboxes: map[string]*sandbox{}}, nil
}

// Info describes the backend.
func (r *Runtime) Info() runtime.Info {
	return runtime.Info{Name: Name, Version: r.version + " (" + r.cfg.Platform + ")", Capabilities: runtime.CapabilitiesOf(r, true)}
}

// ValidateOptions refuses every option: the gvisor backend has none.
func (r *Runtime) ValidateOptions(opts map[string]string) error {
	for k := range opts {
		return errdefs.Invalid("backend_options."+k, "the gvisor backend has no options; remove it")
	}
	return nil
}

func validateSpec(s runtime.Spec) error {
	if err := runtime.ValidateSpec(s, runtime.SpecRules{
		Backend: Name, MinMemoryMB: 32, MemoryWhy: "runsc's sentry and the agent need it", MinCPU: 0.01,
		MinPids: 1, DefaultPids: defaultPids,
		Networks: []runtime.NetworkMode{runtime.NetworkTap}, NetworkHint: "it needs a tap attachment (its namespace routes for the guest, whose packets runsc sends past the namespace's netfilter): give mode tap",
	}); err != nil {
		return err
	}
	return validateNetwork(s.Network)
}

// Create prepares the bundle: config.json and, for several layers, a
// read-only overlay of them. Writes go to runsc's in-memory root overlay
// (--overlay2=root:memory), which is part of a checkpoint.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (runtime.Handle, error) {
	return r.create(ctx, spec, "")
}

func (r *Runtime) create(ctx context.Context, spec runtime.Spec, restoreFrom string) (_ runtime.Handle, retErr error) {
	if err := validateSpec(spec); err != nil {
		return runtime.Handle{}, err
	}
	sb := &sandbox{id: spec.ID, network: spec.Network.Mode, exit: runtime.NewExitLatch()}
	r.mu.Lock()
	if _, ok := r.sandboxes[spec.ID]; ok {
		r.mu.Unlock()
		return runtime.Handle{}, errdefs.New(errdefs.ErrAlreadyExists, "sandbox %q already exists", spec.ID)
	}
	r.sandboxes[spec.ID] = sb
	r.mu.Unlock()
	if _, err := os.Lstat(filepath.Join(r.cfg.StateRoot, spec.ID+"_sandbox:"+spec.ID+".state")); err == nil {
		r.forget(spec.ID)
		return runtime.Handle{}, errdefs.New(errdefs.ErrAlreadyExists, "sandbox %q already exists in runsc state %s", spec.ID, r.cfg.StateRoot)
	}
	sb.st = handleState{Bundle: spec.StateDir, RestoreFrom: restoreFrom, DiskMB: spec.Resources.DiskMB,
		MemoryMB: spec.Resources.MemoryMB, PidsLimit: spec.Resources.PidsLimit}
	if spec.Network.Mode == runtime.NetworkTap {
		n := spec.Network
		sb.st.Network = &n
	}
	if _, err := os.Stat(spec.StateDir); errors.Is(err, os.ErrNotExist) {
		sb.st.OwnsStateDir = true
	}
	defer func() {
		if retErr != nil {
			r.cleanup(sb)
			r.forget(spec.ID)
		}
	}()
	if err := os.MkdirAll(filepath.Join(spec.StateDir, rootfsDir), 0o700); err != nil {
		return runtime.Handle{}, fmt.Errorf("create state dir: %w", err)
	}
	lower, err := spec.Rootfs.Dirs(ctx, spec.ID)
	if err != nil {
		return runtime.Handle{}, fmt.Errorf("mount image layers: %w", err)
	}
	// The layers are read-only and shared, and runsc's gofer needs the
	// agent's mount point in the root: the lowest layer of a read-only
	// overlay (no upper: runsc's memory overlay takes the writes) is a stub
	// of the backend's with it.
	stub := filepath.Join(spec.StateDir, stubDir)
	if err := os.MkdirAll(filepath.Join(stub, filepath.Dir(agentInSandbox)), 0o755); err != nil {
		return runtime.Handle{}, fmt.Errorf("make agent mount point: %w", err)
	}
	if err := os.WriteFile(filepath.Join(stub, agentInSandbox), nil, 0o755); err != nil {
		return runtime.Handle{}, fmt.Errorf("make agent mount point: %w", err)
	}
	for _, d := range []string{filepath.Join(stub, launchInSandbox), filepath.Join(spec.StateDir, launchDir)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return runtime.Handle{}, fmt.Errorf("make launch dir: %w", err)
		}
	}
	root := filepath.Join(spec.StateDir, rootfsDir)
	if err := unix.Mount("overlay", root, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(append(lower, stub), ":")); err != nil {
		return runtime.Handle{}, fmt.Errorf("mount overlay root: %w", err)
	}
	sb.st.Overlay = true
	b, err := json.Marshal(r.ociSpec(spec, root))
	if err != nil {
		return runtime.Handle{}, fmt.Errorf("encode config.json: %w", err)
	}
	if err := os.WriteFile(filepath.Join(spec.StateDir, "config.json"), b, 0o600); err != nil {
		return runtime.Handle{}, fmt.Errorf("write config.json: %w", err)
	}
	return r.handle(sb)
}

func (r *Runtime) handle(sb *sandbox) (runtime.Handle, error) {
	hs, err := json.Marshal(sb.st)
	if err != nil {
		return runtime.Handle{}, fmt.Errorf("encode handle: %w", err)
	}
	return runtime.Handle{ID: sb.id, Version: handleVersion, State: hs}, nil
}

func (r *Runtime) ociSpec(s runtime.Spec, root string) *specs.Spec {
	hostname := s.Guest.Hostname
	if hostname == "" {
		hostname = s.ID
	}
	args := []string{agentInSandbox, "--listen", fmt.Sprintf("tcp:127.0.0.1:%d", agentPort), "--log-level", "warn",
		"--env-file", filepath.Join(launchInSandbox, launchEnvFile)}
	if s.Guest.User != "" {
		args = append(args, "--default-user", s.Guest.User)
	}
	if s.Guest.Workdir != "" {
		args = append(args, "--default-workdir", s.Guest.Workdir)
	}
	env := runtime.MergeEnv([]string{defaultPath}, s.Guest.Env)
	mem := s.Resources.MemoryMB << 20
	quota := int64(s.Resources.CPU * 100000)
	period := uint64(100000)
	pids := s.Resources.PidsLimit
	if pids == 0 {
		pids = defaultPids
	}
	netns := specs.LinuxNamespace{Type: specs.NetworkNamespace}
	if s.Network.Mode == runtime.NetworkTap {
		netns.Path = filepath.Join(s.StateDir, guestNetNS)
	}
	return &specs.Spec{
		Version:  specs.Version,
		Hostname: hostname,
		Root:     &specs.Root{Path: root, Readonly: false},
		Process: &specs.Process{User: specs.User{UID: 0, GID: 0}, Args: args, Env: env, Cwd: "/",
			Capabilities: &specs.LinuxCapabilities{Bounding: defaultCaps, Effective: defaultCaps, Permitted: defaultCaps}},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "mode=755"}},
			{Destination: "/tmp", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev", "mode=1777"}},
			{Destination: agentInSandbox, Type: "bind", Source: r.cfg.AgentPath, Options: []string{"bind", "ro"}},
			{Destination: launchInSandbox, Type: "bind", Source: filepath.Join(s.StateDir, launchDir), Options: []string{"bind", "ro"}},
		},
		Annotations: map[string]string{"org.opendsec.sandbox.id": s.ID},
		Linux: &specs.Linux{
			Seccomp:     r.seccomp,
			CgroupsPath: filepath.Join(r.cfg.CgroupParent, s.ID),
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.UTSNamespace},
				{Type: specs.IPCNamespace}, netns,
			},
			Resources: &specs.LinuxResources{
				Memory: &specs.LinuxMemory{Limit: &mem},
				CPU:    &specs.LinuxCPU{Quota: &quota, Period: &period},
				Pids:   &specs.LinuxPids{Limit: pids},
			},
		},
	}
}

// globalArgs are runsc's flags for every command on sandbox sb
// (nil: a sandbox this instance does not know). The root overlay is in
// memory, at most the disk quota.
func (r *Runtime) globalArgs(sb *sandbox) []string {
	n, overlay := "none", "root:memory"
	if sb != nil && sb.network == runtime.NetworkTap {
		n = "sandbox"
	}
	if sb != nil && sb.st.DiskMB > 0 {
		overlay += fmt.Sprintf(",size=%dm", sb.st.DiskMB)
	}
	args := []string{"--root", r.cfg.StateRoot, "--platform", r.cfg.Platform, "--network", n, "--overlay2", overlay, "--oci-seccomp"}
	if r.cfg.DebugLogDir != "" {
		args = append(args, "--debug", "--debug-log", filepath.Clean(r.cfg.DebugLogDir)+"/")
	}
	return args
}

func (r *Runtime) runscOut(ctx context.Context, sb *sandbox, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, r.runsc, append(r.globalArgs(sb), args...)...)
	// Files, never pipes: a detached sandbox inherits runsc's stdio and
	// would hold a pipe open (exec.Cmd.Wait would wait for it).
	outf, err := os.CreateTemp("", "runsc-out-")
	if err != nil {
		return nil, fmt.Errorf("runsc output file: %w", err)
	}
	defer os.Remove(outf.Name())
	defer outf.Close()
	errf, err := os.CreateTemp("", "runsc-err-")
	if err != nil {
		return nil, fmt.Errorf("runsc output file: %w", err)
	}
	defer os.Remove(errf.Name())
	defer errf.Close()
	cmd.Stdout, cmd.Stderr = outf, errf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	runErr := cmd.Run()
	out, _ := os.ReadFile(outf.Name())
	if runErr != nil {
		stderr, _ := os.ReadFile(errf.Name())
		msg := lastLine(string(stderr))
		if strings.Contains(msg, "does not exist") || strings.Contains(msg, "not found") {
			return nil, errdefs.New(errdefs.ErrNotFound, "runsc %s: sandbox not found: %s", args[0], msg)
		}
		return nil, fmt.Errorf("runsc %s: %w: %s", args[0], runErr, msg)
	}
	return out, nil
}

// lastLine is the last non-warning line of runsc's stderr.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if l := strings.TrimSpace(lines[i]); l != "" && !strings.HasPrefix(l, "W") && !strings.HasPrefix(l, "I") {
			return l
		}
	}
	return strings.TrimSpace(s)
}

func (r *Runtime) get(id string) (*sandbox, error) {
	r.mu.Lock()
	sb, ok := r.sandboxes[id]
	r.mu.Unlock()
	if !ok {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox %q not found", id)
	}
	return sb, nil
}

func (r *Runtime) forget(id string) {
	r.mu.Lock()
	delete(r.sandboxes, id)
	r.mu.Unlock()
}

// Start runs the sandbox: `runsc run --detach`, or `runsc restore
// --detach` of its checkpoint for a restored or forked sandbox.
func (r *Runtime) Start(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	if sb.started || sb.ended() {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q was started or stopped already; create a new one", id)
	}
	if sb.prestarted {
		return r.launch(ctx, sb, nil)
	}
	args := []string{"run", "--detach", "--bundle", sb.st.Bundle, id}
	if sb.st.Network != nil {
		if err := setupGuestNet(ctx, *sb.st.Network, filepath.Join(sb.st.Bundle, guestNetNS)); err != nil {
			return fmt.Errorf("wire sandbox %s's network: %w", id, err)
		}
	}
	if sb.st.RestoreFrom != "" {
		args = []string{"restore", "--detach", "--image-path", sb.st.RestoreFrom, "--bundle", sb.st.Bundle, id}
	}
	if _, err := r.runscOut(ctx, sb, args...); err != nil {
		return err
	}
	sb.started = true
	r.startWatch(sb)
	return nil
}

// startWatch watches the sandbox's current runsc process.
func (r *Runtime) startWatch(sb *sandbox) {
	w := make(chan struct{})
	sb.watched = w
	go func() {
		defer close(w)
		r.watch(sb, w)
	}()
}

// watch waits for the sandbox's init to end (`runsc wait`); watched is this
// watcher's watched channel.
func (r *Runtime) watch(sb *sandbox, watched chan struct{}) {
	out, err := r.runscOut(context.Background(), sb, "wait", sb.id)
	if p := sb.parking.Load(); p != nil && *p == watched {
		return // Reclaim's checkpoint ended it; the sandbox lives on
	}
	es := runtime.ExitStatus{ExitCode: -1, Reason: "init exited", At: time.Now()}
	var w struct {
		ExitStatus int `json:"exitStatus"`
	}
	if err == nil && json.Unmarshal(out, &w) == nil {
		// runsc reports a signal death as 128+n; SIGKILL is a kill.
		es.ExitCode = w.ExitStatus
		if w.ExitStatus == 128+int(syscall.SIGKILL) {
			es.ExitCode, es.Reason = -1, "killed"
		}
	} else if err != nil {
		es.Reason = "sandbox gone: " + err.Error()
	}
	// For a Recover after a node restart: runsc may go on reporting a
	// sandbox whose init ended as running.
	if b, err := json.Marshal(es); err == nil {
		_ = os.WriteFile(filepath.Join(sb.st.Bundle, exitFile), b, 0o600)
	}
	sb.finish(es)
}

// Wait blocks until the sandbox's init ended.
func (r *Runtime) Wait(ctx context.Context, id string) (runtime.ExitStatus, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.ExitStatus{}, err
	}
	return sb.exit.Wait(ctx, id, func() bool {
		sb.op.Lock()
		defer sb.op.Unlock()
		return sb.started
	})
}

// Stop sends SIGTERM to every process, then SIGKILL after the timeout.
func (r *Runtime) Stop(ctx context.Context, id string, opts runtime.StopOptions) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	if !sb.started {
		if sb.prestarted {
			// Made by runsc create and never run: nothing to signal.
			if _, err := r.runscOut(ctx, sb, "delete", "--force", id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
				return fmt.Errorf("stop sandbox %s: %w", id, err)
			}
		}
		sb.finish(runtime.ExitStatus{ExitCode: -1, Reason: "stopped", At: time.Now()})
		return nil
	}
	if sb.reclaimed.Load() {
		// No sandbox process: it ends here (Delete removes the checkpoint).
		sb.finish(runtime.ExitStatus{ExitCode: -1, Reason: "stopped", At: time.Now()})
		return nil
	}
	// A paused sandbox must run to take the signal.
	_, _ = r.runscOut(ctx, sb, "resume", id)
	if opts.Timeout > 0 {
		if _, err := r.runscOut(ctx, sb, "kill", "--all", id, "TERM"); err == nil {
			t := time.NewTimer(opts.Timeout)
			select {
			case <-sb.exit.Done():
				t.Stop()
				return nil
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return fmt.Errorf("stop sandbox %s: %w", id, ctx.Err())
			}
		}
	}
	if _, err := r.runscOut(ctx, sb, "kill", "--all", id, "KILL"); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		select {
		case <-sb.exit.Done():
			return nil
		default:
		}
		return fmt.Errorf("kill sandbox %s: %w", id, err)
	}
	select {
	case <-sb.exit.Done():
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stop sandbox %s: %w", id, ctx.Err())
	}
}

// Delete removes the runsc container, the overlay and the state dir if the
// backend made it.
func (r *Runtime) Delete(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		// Unknown to this instance (a node restart without Recover): what
		// runsc still knows of it goes.
		out, err := r.runscOut(ctx, nil, "state", id)
		if err != nil {
			return nil
		}
		var s struct {
			Bundle string `json:"bundle"`
		}
		_ = json.Unmarshal(out, &s)
		if _, err := r.runscOut(ctx, nil, "delete", "--force", id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("delete sandbox %s: %w", id, err)
		}
		if s.Bundle != "" {
			r.cleanup(&sandbox{st: handleState{Bundle: s.Bundle}})
		}
		return nil
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	if !sb.started && !sb.deleted {
		// Never ran: waiters get not found.
		sb.deleted = true
		sb.exit.Gone()
	}
	if _, err := r.runscOut(ctx, sb, "delete", "--force", id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return fmt.Errorf("delete sandbox %s: %w", id, err)
	}
	if sb.started {
		sb.finish(runtime.ExitStatus{ExitCode: -1, Reason: "deleted", At: time.Now()})
	}
	sb.exit.Gone()
	r.cleanup(sb)
	r.forget(id)
	return nil
}

func (r *Runtime) cleanup(sb *sandbox) {
	if sb.st.Bundle == "" {
		return
	}
	// Also for a sandbox this instance does not know (no handle state):
	// the root is always an overlay now.
	_ = unix.Unmount(filepath.Join(sb.st.Bundle, rootfsDir), unix.MNT_DETACH)
	_ = removeNetNS(filepath.Join(sb.st.Bundle, guestNetNS))
	if sb.st.OwnsStateDir {
		_ = os.RemoveAll(sb.st.Bundle)
		return
	}
	for _, n := range []string{rootfsDir, stubDir, launchDir, "config.json", imageDir, exitFile, reclaimDir} {
		_ = os.RemoveAll(filepath.Join(sb.st.Bundle, n))
	}
}

type runscState struct {
	Status string `json:"status"`
	Pid    int    `json:"pid"`
}

// Status reports the sandbox's state from runsc.
func (r *Runtime) Status(ctx context.Context, id string) (runtime.Status, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Status{}, err
	}
	select {
	case <-sb.exit.Done():
		return runtime.Status{State: runtime.StateStopped, ExitCode: sb.exit.Status().ExitCode}, nil
	default:
	}
	if !sb.started && !sb.prestarted {
		return runtime.Status{State: runtime.StateCreated}, nil
	}
	if sb.reclaimed.Load() {
		return runtime.Status{State: runtime.StatePaused}, nil
	}
	out, err := r.runscOut(ctx, sb, "state", id)
	if err != nil {
		return runtime.Status{}, err
	}
	var s runscState
	if err := json.Unmarshal(out, &s); err != nil {
		return runtime.Status{}, fmt.Errorf("decode runsc state: %w", err)
	}
	switch s.Status {
	case "running":
		return runtime.Status{State: runtime.StateRunning, Pid: s.Pid}, nil
	case "paused":
		return runtime.Status{State: runtime.StatePaused, Pid: s.Pid}, nil
	case "created":
		return runtime.Status{State: runtime.StateCreated, Pid: s.Pid}, nil
	default:
		return runtime.Status{State: runtime.StateStopped}, nil
	}
}

// Recover re-attaches to a sandbox runsc still knows.
func (r *Runtime) Recover(ctx context.Context, h runtime.Handle) error {
	if h.Version != handleVersion {
		return errdefs.New(errdefs.ErrInvalidArgument, "handle version %d is not %d", h.Version, handleVersion)
	}
	var st handleState
	if err := json.Unmarshal(h.State, &st); err != nil {
		return errdefs.New(errdefs.ErrInvalidArgument, "decode handle: %v", err)
	}
	sb := &sandbox{id: h.ID, st: st, exit: runtime.NewExitLatch()}
	if st.Network != nil {
		sb.network = runtime.NetworkTap
	}
	var spec specs.Spec
	if b, err := os.ReadFile(filepath.Join(st.Bundle, "config.json")); err == nil && json.Unmarshal(b, &spec) == nil && spec.Linux != nil {
		for _, ns := range spec.Linux.Namespaces {
			if ns.Type == specs.NetworkNamespace && ns.Path != "" {
				sb.network = runtime.NetworkTap
			}
		}
	}
	out, err := r.runscOut(ctx, sb, "state", h.ID)
	if errors.Is(err, errdefs.ErrNotFound) && hasReclaimed(st.Bundle) {
		// Reclaimed: its checkpoint is the sandbox, paused.
		sb.started = true
		sb.reclaimed.Store(true)
	} else if errors.Is(err, errdefs.ErrNotFound) {
		// Prepared, never started.
		if spec.Annotations["org.opendsec.sandbox.id"] != h.ID {
			return errdefs.New(errdefs.ErrNotFound, "sandbox %q is gone", h.ID)
		}
	} else if err != nil {
		return err
	} else {
		var s runscState
		_ = json.Unmarshal(out, &s)
		sb.started = true
		// runsc may still say running for a sandbox whose init was
		// killed: its sandbox process is the truth.
		var es runtime.ExitStatus
		if b, err := os.ReadFile(filepath.Join(st.Bundle, exitFile)); err == nil && json.Unmarshal(b, &es) == nil {
			sb.finish(es)
		} else if s.Status == "stopped" || s.Pid <= 0 || unix.Kill(s.Pid, 0) != nil {
			sb.finish(runtime.ExitStatus{ExitCode: -1, Reason: "stopped before the node restarted", At: time.Now()})
		}
	}
	r.mu.Lock()
	if _, ok := r.sandboxes[h.ID]; ok {
		r.mu.Unlock()
		return nil
	}
	r.sandboxes[h.ID] = sb
	r.mu.Unlock()
	if sb.started && !sb.ended() && !sb.reclaimed.Load() {
		r.startWatch(sb)
	}
	return nil
}

// AgentConn runs `runsc exec <id> opendsec-agent --dial` with one end of a
// socketpair as its stdio and returns the other end.
func (r *Runtime) AgentConn(ctx context.Context, id string) (net.Conn, error) {
	sb, err := r.get(id)
	if err != nil {
		return nil, err
	}
	if !sb.started || sb.ended() {
		return nil, errdefs.New(errdefs.ErrUnavailable, "sandbox %q is not running", id)
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "agent"), os.NewFile(uintptr(fds[1]), "agent-proxy")
	defer theirs.Close()
	cmd := exec.Command(r.runsc, append(r.globalArgs(sb), "exec", id,
		agentInSandbox, "--dial", fmt.Sprintf("tcp:127.0.0.1:%d", agentPort))...)
	cmd.Stdin, cmd.Stdout = theirs, theirs
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		ours.Close()
		return nil, fmt.Errorf("dial agent: %w: runsc exec: %w", errdefs.ErrUnavailable, err)
	}
	go func() { _ = cmd.Wait() }()
	c, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		return nil, fmt.Errorf("agent conn: %w", err)
	}
	return c, nil
}

// Pause freezes the sandbox (`runsc pause`).
func (r *Runtime) Pause(ctx context.Context, id string) error {
	return r.pauseResume(ctx, id, "pause", runtime.StatePaused)
}

// Resume lets a paused sandbox run again (`runsc resume`).
func (r *Runtime) Resume(ctx context.Context, id string) error {
	return r.pauseResume(ctx, id, "resume", runtime.StateRunning)
}

func (r *Runtime) pauseResume(ctx context.Context, id, verb string, want runtime.State) error {
	if sb, err := r.get(id); err == nil && verb == "resume" {
		if sb.reclaimed.Load() {
			return r.restoreReclaimed(ctx, sb)
		}
	}
	st, err := r.Status(ctx, id)
	if err != nil {
		return err
	}
	if st.State == want {
		return nil
	}
	if st.State != runtime.StateRunning && st.State != runtime.StatePaused {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is %s; only a started sandbox can %s", id, st.State, verb)
	}
	sb, _ := r.get(id)
	_, err = r.runscOut(ctx, sb, verb, id)
	return err
}

// Snapshot checkpoints the running sandbox's memory and processes into dir
// (`runsc checkpoint --leave-running`); the source keeps running.
func (r *Runtime) Snapshot(ctx context.Context, id, dir string) (runtime.SnapshotInfo, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.SnapshotInfo{}, err
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	if !sb.started {
		return runtime.SnapshotInfo{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q never started; the gvisor backend snapshots running sandboxes", id)
	}
	if sb.reclaimed.Load() {
		return runtime.SnapshotInfo{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is paused with its memory reclaimed to disk; resume it before a snapshot or fork", id)
	}
	// runsc pauses the sandbox while it writes the checkpoint: the
	// command's duration is the source's pause (a little more).
	t0 := time.Now()
	if _, err := r.runscOut(ctx, sb, "checkpoint", "--leave-running", "--image-path", dir, id); err != nil {
		return runtime.SnapshotInfo{}, fmt.Errorf("checkpoint: %w", err)
	}
	frozen := time.Since(t0)
	var n int64
	_ = filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return nil
	})
	return runtime.SnapshotInfo{Memory: true, Bytes: n, SourceFrozen: frozen}, nil
}

// Restore prepares a sandbox that Start restores from the checkpoint in dir.
// The spec must have the source's rootfs layers (the checkpoint's root
// overlay sits on them).
func (r *Runtime) Restore(ctx context.Context, spec runtime.Spec, dir string) (runtime.Handle, error) {
	if _, err := os.Stat(filepath.Join(dir, "checkpoint.img")); err != nil {
		return runtime.Handle{}, errdefs.Invalid("snapshot", "%s holds no runsc checkpoint (checkpoint.img): %v", dir, err)
	}
	return r.create(ctx, spec, dir)
}

// Fork checkpoints the source once into its state dir and prepares one
// sandbox per spec restoring from it.
func (r *Runtime) Fork(ctx context.Context, id string, specs []runtime.Spec) ([]runtime.ForkResult, error) {
	sb, err := r.get(id)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(sb.st.Bundle, imageDir+"-")
	if err != nil {
		return nil, fmt.Errorf("make checkpoint dir: %w", err)
	}
	info, err := r.Snapshot(ctx, id, dir)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	frozen := info.SourceFrozen
	out := make([]runtime.ForkResult, 0, len(specs))
	for _, s := range specs {
		h, err := r.create(ctx, s, "")
		if err == nil {
			// Each fork keeps its own copy: the source's may go at any time.
			var fsb *sandbox
			fsb, err = r.get(s.ID)
			if err == nil {
				img := filepath.Join(s.StateDir, imageDir)
				if err = copyDir(dir, img); err == nil {
					fsb.st.RestoreFrom = img
					h, err = r.handle(fsb)
				}
			}
		}
		if err != nil {
			for _, f := range out {
				_ = r.Delete(context.WithoutCancel(ctx), f.Handle.ID)
			}
			_ = r.Delete(context.WithoutCancel(ctx), s.ID)
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("fork %s: %w", s.ID, err)
		}
		out = append(out, runtime.ForkResult{Handle: h, MemoryPreserved: true, SourceFrozen: frozen})
	}
	_ = os.RemoveAll(dir)
	log.G(ctx).Debug("sandbox forked", "sandbox.id", id, "forks", len(out), "checkpoint", frozen)
	return out, nil
}

// copyDir copies the regular files of src into a new dst (hard links
// where the filesystem allows: a checkpoint is only read).
func copyDir(src, dst string) error {
	if err := os.Mkdir(dst, 0o700); err != nil {
		return fmt.Errorf("make %s: %w", dst, err)
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return fmt.Errorf("read checkpoint: %w", err)
	}
	for _, e := range ents {
		from, to := filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())
		if os.Link(from, to) == nil {
			continue
		}
		b, err := os.ReadFile(from)
		if err != nil {
			return fmt.Errorf("read checkpoint file: %w", err)
		}
		if err := os.WriteFile(to, b, 0o600); err != nil {
			return fmt.Errorf("write checkpoint file: %w", err)
		}
	}
	return nil
}
