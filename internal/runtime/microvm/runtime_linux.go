package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
	"github.com/kernflux/opendsec/internal/runtime/sched"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// Defaults of the lifecycle.
const (
	// DefaultDiskMB is the writable disk's size when Resources.DiskMB is 0.
	DefaultDiskMB = 2048
	// MemoryOverheadMB is added to the guest's RAM for the VMM's cgroup
	// memory limit (Firecracker's own heap and device state: a few MiB).
	MemoryOverheadMB = 64
	// bootTimeout bounds Start's wait for the guest's agent; apiTimeout
	// the wait for the API socket after the jailer's exec.
	bootTimeout = 60 * time.Second
	apiTimeout  = 10 * time.Second
	// minMemoryMB is the least guest RAM a sandbox may ask for.
	minMemoryMB = 64
)

// runFile is the sandbox's run state in its StateDir (as the vm
// backend's vm.json): what Recover needs after a node restart.
const runFile = "microvm.json"

// ownedFiles are what the backend makes in StateDir.
var ownedFiles = []string{"rw.ext4", "config.img", "firecracker.log", runFile, runFile + ".tmp"}

// runState is the Handle's blob and the run file.
type runState struct {
	ID       string `json:"id"`
	JailID   string `json:"jail_id"`
	StateDir string `json:"state_dir"`
	UID      int    `json:"uid"`
	// Pid and StartTime (field 22 of /proc/<pid>/stat) of the jailed
	// firecracker (the jailer execs it: the same pid), once started.
	Pid       int    `json:"pid,omitempty"`
	StartTime uint64 `json:"start_time,omitempty"`
	// CPU is the cgroup's CPU limit in cores.
	CPU     float64 `json:"cpu"`
	Cgroup  string  `json:"cgroup"`
	CgroupV int     `json:"cgroup_version"`
	NetNS   string  `json:"netns,omitempty"`
	Accel   string  `json:"accel"`
	// Layers are the image's layer digests, topmost first.
	Layers []string `json:"layers,omitempty"`
	// Plan is the VM's plan as the VMM sees it (jail paths).
	Plan Plan `json:"plan"`
	// Restore: the jail holds a snapshot (/snapshot) that Start loads
	// instead of booting; the identity below is then given to the guest.
	Restore  bool   `json:"restore,omitempty"`
	Hostname string `json:"hostname,omitempty"`
	MAC      string `json:"mac,omitempty"`
	Addr     string `json:"addr,omitempty"`
	Gateway  string `json:"gateway,omitempty"`
}

// Runtime is the microvm backend: one jailed firecracker per sandbox.
type Runtime struct {
	cfg    Config
	nodeID string
	accel  kvmprobe.Result
	uids   *uids
	// agentWait: Start waits until the guest's agent answers.
	agentWait time.Duration
	// configureOnly: Start configures the VM and does not start it (the
	// real-binary test on a host where no guest boots).
	configureOnly bool

	sbs vmm.Table[sandbox]
}

type sandbox struct {
	id string
	st runState

	startMu sync.Mutex
	mu      sync.Mutex
	started bool
	cmd     *exec.Cmd // nil for a VMM found by Recover

	exit     *runtime.ExitLatch
	stopping bool
}

var (
	_ runtime.Runtime      = (*Runtime)(nil)
	_ runtime.Pauser       = (*Runtime)(nil)
	_ runtime.Snapshotter  = (*Runtime)(nil)
	_ runtime.Forker       = (*Runtime)(nil)
	_ runtime.NetworkModer = (*Runtime)(nil)
)

// New builds the backend over cfg (defaults filled, validated) for a
// host whose detector said res.
func New(cfg Config, env runtime.Env, res kvmprobe.Result) *Runtime {
	// The jailer names the jail after the exec file's real name.
	if p, err := filepath.EvalSymlinks(cfg.FirecrackerPath); err == nil {
		cfg.FirecrackerPath = p
	}
	return &Runtime{cfg: cfg, nodeID: cmpOr(env.NodeID, "default"), accel: res, uids: newUIDs(cfg.UIDStart, cfg.UIDCount),
		agentWait: bootTimeout, sbs: vmm.Table[sandbox]{Backend: Name}}
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// Info implements runtime.Runtime.
func (r *Runtime) Info() runtime.Info {
	out, _ := exec.Command(r.cfg.FirecrackerPath, "--version").Output()
	v, _, _ := strings.Cut(string(out), "\n")
	return runtime.Info{Name: Name, Version: strings.TrimPrefix(strings.TrimSpace(v), "Firecracker "), Capabilities: runtime.CapabilitiesOf(r, true)}
}

// NetworkMode says the node must give this backend's sandboxes a tap.
func (r *Runtime) NetworkMode() runtime.NetworkMode { return runtime.NetworkTap }

// ValidateOptions implements runtime.Runtime: the backend has none.
func (r *Runtime) ValidateOptions(opts map[string]string) error {
	for k := range opts {
		return errdefs.Invalid("backend_options."+k, "is unknown: the microvm backend takes no options")
	}
	return nil
}

func (r *Runtime) get(id string) (*sandbox, error) { return r.sbs.Get(id) }

// jailIDOf is the jailer --id of sandbox id: the ID itself when the
// jailer takes it, else a digest of it.
func jailIDOf(id string) string {
	if jailID.MatchString(id) {
		return id
	}
	sum := sha256.Sum256([]byte(id))
	return "sb-" + hex.EncodeToString(sum[:12])
}

func (r *Runtime) cgroupParent() string { return "opendsec-microvm-" + r.nodeID }

func unified() bool {
	_, err := os.Stat("/sys/fs/cgroup/cgroup.controllers")
	return err == nil
}

// validate checks spec before anything is made.
func (r *Runtime) validate(spec runtime.Spec) error {
	return runtime.ValidateSpec(spec, runtime.SpecRules{
		Backend:     Name,
		MinMemoryMB: minMemoryMB,
		MemoryWhy:   "a microVM's kernel, init and agent need it",
		MinCPU:      0.01,
		Networks:    []runtime.NetworkMode{runtime.NetworkTap},
		NetworkHint: "the microvm backend needs a tap (or no network)",
		LayerDisks:  true,
	})
}

// Create implements runtime.Runtime: it validates, makes the writable and
// configuration disks in StateDir, a uid, the jail with the guest assets,
// the layers and the disks in it, and records all in the run file.
// Nothing runs yet; on error nothing is left.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (runtime.Handle, error) {
	return r.create(ctx, spec, nil)
}

// restoreFrom is a checked snapshot to restore (snapshot_linux.go).
type restoreFrom struct {
	dir  string
	meta SnapshotMeta
	man  manifest
}

func (r *Runtime) create(ctx context.Context, spec runtime.Spec, from *restoreFrom) (h runtime.Handle, err error) {
	if err := r.validate(spec); err != nil {
		return runtime.Handle{}, err
	}
	plan, err := r.cfg.PlanFor(spec, filepath.Join(spec.StateDir, "rw.ext4"))
	if err != nil {
		return runtime.Handle{}, err
	}
	plan.ConfigDisk = filepath.Join(spec.StateDir, "config.img")
	if from != nil {
		if err := from.check(r, spec); err != nil {
			return runtime.Handle{}, err
		}
		plan.VCPUs, plan.MemoryMB = from.meta.VCPUs, from.meta.MemoryMB
	}
	if err := plan.Validate(goruntime.NumCPU()); err != nil {
		return runtime.Handle{}, err
	}
	sb := &sandbox{id: spec.ID, exit: runtime.NewExitLatch()}
	if !r.sbs.Add(spec.ID, sb) {
		return runtime.Handle{}, errdefs.New(errdefs.ErrAlreadyExists, "microvm sandbox %q", spec.ID)
	}
	uid, err := r.uids.get()
	if err != nil {
		r.sbs.Remove(spec.ID)
		return runtime.Handle{}, err
	}
	jid := jailIDOf(spec.ID)
	jailMine := false // an existing jail is another sandbox's: never removed here
	defer func() {
		if err != nil {
			if jailMine {
				_ = r.cfg.RemoveJail(jid)
			}
			for _, f := range ownedFiles {
				_ = os.Remove(filepath.Join(spec.StateDir, f))
			}
			r.uids.put(uid)
			r.sbs.Remove(spec.ID)
		}
	}()
	if _, err := os.Stat(filepath.Dir(r.cfg.Root(jid))); err == nil {
		return runtime.Handle{}, errdefs.New(errdefs.ErrAlreadyExists, "microvm sandbox %q: its jail %s exists (a sandbox of this ID was not deleted)", spec.ID, filepath.Dir(r.cfg.Root(jid)))
	}
	jailMine = true
	if err := os.MkdirAll(spec.StateDir, 0o700); err != nil {
		return runtime.Handle{}, errdefs.New(errdefs.ErrInternal, "microvm state dir: %w", err)
	}
	st := runState{ID: spec.ID, JailID: jid, StateDir: spec.StateDir, UID: uid, CPU: spec.Resources.CPU, Cgroup: r.cgroupParent() + "/" + jid, CgroupV: 1,
		NetNS: spec.Network.NetNS, Accel: string(r.accel.Kind), Hostname: cmpOr(spec.Guest.Hostname, spec.ID), Restore: from != nil}
	if unified() {
		st.CgroupV = 2
	}
	for _, l := range spec.Rootfs.Layers {
		st.Layers = append(st.Layers, l.Digest)
	}
	if spec.Network.Mode == runtime.NetworkTap {
		st.MAC, st.Addr, st.Gateway = spec.Network.MAC.String(), spec.Network.GuestAddr.String(), spec.Network.Gateway.String()
	}
	// The directory is this sandbox's from now on (Recover and Delete check).
	if err := writeRunState(st); err != nil {
		return runtime.Handle{}, err
	}
	if from == nil {
		diskMB := spec.Resources.DiskMB
		if diskMB == 0 {
			diskMB = DefaultDiskMB
		}
		if err := vmm.MakeDisk(ctx, plan.Writable, diskMB); err != nil {
			return runtime.Handle{}, fmt.Errorf("microvm %w", err)
		}
		if err := vmm.WriteConfigDisk(plan.ConfigDisk, spec.Guest); err != nil {
			return runtime.Handle{}, err
		}
	} else if err := from.copyDisks(spec.StateDir); err != nil {
		return runtime.Handle{}, err
	}
	plan.BootArgs = bootArgs(spec, st.Hostname)
	j := r.jail(st, st.CPU, plan.MemoryMB)
	in, err := r.cfg.PrepareJail(ctx, j, plan, goruntime.NumCPU())
	if err != nil {
		return runtime.Handle{}, err
	}
	if err := os.Chown(filepath.Join(r.cfg.Root(jid), "run"), uid, uid); err != nil {
		return runtime.Handle{}, errdefs.New(errdefs.ErrInternal, "microvm jail: %w", err)
	}
	if from != nil {
		if err := from.link(r.cfg.Root(jid), uid); err != nil {
			return runtime.Handle{}, err
		}
	}
	st.Plan = in
	if err := writeRunState(st); err != nil {
		return runtime.Handle{}, err
	}
	sb.st = st
	return handleOf(st), nil
}

func (r *Runtime) jail(st runState, cpu float64, memMB int64) Jail {
	return Jail{ID: st.JailID, UID: st.UID, GID: st.UID, NetNS: st.NetNS, CgroupVersion: st.CgroupV, CPU: cpu,
		MemoryMB: memMB + MemoryOverheadMB, Parent: r.cgroupParent()}
}

// bootArgs is the guest kernel's command line (docs/vm-guest.md): the
// disks in the order Boot attaches them (layers, writable, config), the
// agent on vsock, and reboot=k so the guest's power-off ends Firecracker.
func bootArgs(spec runtime.Spec, hostname string) string {
	n := len(spec.Rootfs.Layers)
	a := []string{"console=ttyS0", "reboot=k", "panic=1", "pci=off", "quiet", "cryptomgr.notests", "mitigations=off",
		"tsc=reliable", "no_timer_check", "i8042.noaux", "i8042.nomux", "8250.nr_uarts=1", "nowatchdog", "audit=0",
		"opendsec.layers=" + strconv.Itoa(n), "opendsec.rw=vd" + string(rune('a'+n)), "opendsec.config=vd" + string(rune('a'+n+1)),
		"opendsec.hostname=" + hostname, "opendsec.agent=vsock", "opendsec.poweroff=reboot"}
	if spec.Network.Mode == runtime.NetworkTap {
		a = append(a, "opendsec.ip="+spec.Network.GuestAddr.String(), "opendsec.gw="+spec.Network.Gateway.String(),
			"opendsec.mac="+spec.Network.MAC.String())
	}
	return strings.Join(a, " ")
}

func handleOf(st runState) runtime.Handle {
	b, _ := json.Marshal(st)
	return runtime.Handle{ID: st.ID, Version: 1, State: b}
}

func writeRunState(st runState) error {
	if err := vmm.WriteRunFile(filepath.Join(st.StateDir, runFile), st); err != nil {
		return errdefs.New(errdefs.ErrInternal, "microvm run state: %w", err)
	}
	return nil
}

func readRunState(sd string) (runState, error) {
	var st runState
	err := vmm.ReadRunFile(filepath.Join(sd, runFile), &st)
	return st, err
}

func (r *Runtime) apiSock(st runState) string {
	return filepath.Join(r.cfg.Root(st.JailID), strings.TrimPrefix(APISocket, "/"))
}

func (r *Runtime) client(st runState) *Client { return NewClient(r.apiSock(st)) }

// Start implements runtime.Runtime: the jailer runs with the sandbox's
// uid, netns and cgroup and execs firecracker in the jail; the VM is
// configured and started through the API socket (or a restore loads its
// snapshot), and Start returns once the guest's agent answers GET /health
// over vsock (a restore's guest then gets its own identity).
func (r *Runtime) Start(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.startMu.Lock()
	defer sb.startMu.Unlock()
	select {
	case <-sb.exit.Done():
		return errdefs.New(errdefs.ErrFailedPrecondition, "microvm sandbox %q was stopped; a stopped VM does not start again (create a new sandbox)", id)
	default:
	}
	sb.mu.Lock()
	started, st := sb.started, sb.st
	sb.mu.Unlock()
	if started {
		return nil
	}
	args, err := r.cfg.JailerArgs(r.jail(st, st.CPU, st.Plan.MemoryMB))
	if err != nil {
		return err
	}
	logf, err := os.OpenFile(filepath.Join(st.StateDir, "firecracker.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "microvm log: %w", err)
	}
	defer func() { _ = logf.Close() }()
	cmd := exec.Command(r.cfg.JailerPath, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Not the node's: a node restart leaves the VM running.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	// Its own core-scheduling cookie from exec on (jailer and the
	// firecracker it execs, every thread): its vCPUs never share an SMT
	// core with another VM's.
	if err := sched.Start(cmd, sched.StartOptions{Cookie: sched.Core().Enabled}); err != nil {
		return errdefs.New(errdefs.ErrInternal, "microvm jailer start: %w", err)
	}
	pid := cmd.Process.Pid
	// The pidfd is opened before anything can reap the child.
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return errdefs.New(errdefs.ErrInternal, "microvm pidfd: %w", err)
	}
	sb.mu.Lock()
	sb.st.Pid, sb.st.StartTime = pid, vmm.StartTime(pid)
	sb.started, sb.cmd = true, cmd
	st = sb.st
	sb.mu.Unlock()
	r.watch(sb, pfd)
	fail := func(err error) error {
		_ = unix.Kill(pid, unix.SIGKILL)
		<-sb.exit.Done()
		return err
	}
	if err := writeRunState(st); err != nil {
		return fail(err)
	}
	c, err := r.waitAPI(ctx, sb)
	if err != nil {
		return fail(err)
	}
	switch {
	case st.Restore:
		err = Load(ctx, c, "/snapshot", st.Plan.Tap)
	case r.configureOnly:
		if err = Configure(ctx, c, st.Plan); err == nil {
			return nil
		}
	default:
		err = Boot(ctx, c, st.Plan)
	}
	if err != nil {
		return fail(r.withLog(sb, fmt.Errorf("microvm %s: %w", id, err)))
	}
	if r.agentWait <= 0 {
		return nil
	}
	if err := r.waitAgent(ctx, sb, r.agentWait); err != nil {
		return fail(err)
	}
	if st.Restore {
		if err := r.setIdentity(ctx, sb); err != nil {
			return fail(err)
		}
	}
	return nil
}

// withLog adds the end of firecracker's log to err.
func (r *Runtime) withLog(sb *sandbox, err error) error {
	b, _ := os.ReadFile(filepath.Join(sb.st.StateDir, "firecracker.log"))
	if len(b) == 0 {
		return err
	}
	return fmt.Errorf("%w; firecracker.log: %s", err, vmm.LastLines(b, 5))
}

// waitAPI polls the API socket until firecracker answers GET /, it ends,
// or apiTimeout passes.
func (r *Runtime) waitAPI(ctx context.Context, sb *sandbox) (*Client, error) {
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	c := r.client(sb.st)
	wait := time.Millisecond
	for {
		_, err := c.InstanceInfo(ctx)
		if err == nil {
			return c, nil
		}
		t := time.NewTimer(wait)
		select {
		case <-sb.exit.Done():
			t.Stop()
			return nil, r.withLog(sb, errdefs.New(errdefs.ErrInternal, "microvm %s: the jailer or firecracker exited before its API answered (%s)", sb.id, sb.exitReason()))
		case <-ctx.Done():
			t.Stop()
			return nil, r.withLog(sb, errdefs.New(errdefs.ErrDeadlineExceeded, "microvm %s: firecracker's API socket %s did not answer within %s: %w", sb.id, r.apiSock(sb.st), apiTimeout, err))
		case <-t.C:
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

func (sb *sandbox) exitReason() string {
	es := sb.exit.Status()
	return fmt.Sprintf("%s, exit code %d", es.Reason, es.ExitCode)
}

// agentHTTP is an HTTP client whose connections are AgentConns of id.
func (r *Runtime) agentHTTP(id string) *http.Client {
	return vmm.AgentHTTP(func(ctx context.Context) (net.Conn, error) { return r.AgentConn(ctx, id) })
}

// waitAgent does GET /health over vsock until the agent answers 204,
// firecracker exits, ctx ends or timeout passes.
func (r *Runtime) waitAgent(ctx context.Context, sb *sandbox, timeout time.Duration) error {
	last := vmm.WaitHealth(ctx, r.agentHTTP(sb.id), timeout, sb.exit.Done(), 0, nil)
	if last == nil {
		return nil
	}
	if sb.exit.Ended() {
		return r.withLog(sb, errdefs.New(errdefs.ErrInternal, "microvm %s: firecracker exited before the guest's agent answered (%s)", sb.id, sb.exitReason()))
	}
	return r.withLog(sb, errdefs.New(errdefs.ErrDeadlineExceeded, "microvm %s: the guest agent did not answer over vsock within %s (last: %v)", sb.id, timeout, last))
}

// setIdentity gives a restored guest its own identity (vmchan.Identity):
// hostname, network, fresh entropy, the host's clock.
func (r *Runtime) setIdentity(ctx context.Context, sb *sandbox) error {
	id, err := vmm.NewIdentity(sb.st.Hostname, sb.st.MAC, sb.st.Addr, sb.st.Gateway)
	if err == nil {
		err = vmm.PostGuest(ctx, r.agentHTTP(sb.id), vmchan.IdentityPath, id)
	}
	if err != nil {
		return fmt.Errorf("microvm %s identity: %w", sb.id, err)
	}
	return nil
}

// watch waits for firecracker's end on its pidfd; for the node's own
// child it then reaps it for the exit code.
func (r *Runtime) watch(sb *sandbox, pfd int) {
	go func() {
		defer func() { _ = unix.Close(pfd) }()
		vmm.WaitExit(pfd)
		code := -1
		sb.mu.Lock()
		cmd := sb.cmd
		sb.mu.Unlock()
		if cmd != nil {
			err := cmd.Wait()
			var ee *exec.ExitError
			switch {
			case err == nil:
				code = 0
			case errors.As(err, &ee):
				code = ee.ExitCode()
			}
		}
		r.ended(sb, "", code)
	}()
}

// ended records the VMM's end (the first one recorded stays): why, or
// the reason its state says.
func (r *Runtime) ended(sb *sandbox, why string, code int) {
	if why == "" {
		sb.mu.Lock()
		switch {
		case sb.stopping:
			why = "stopped"
		case code == 0:
			why = "guest powered off"
		default:
			why = "firecracker exited"
		}
		sb.mu.Unlock()
	}
	sb.exit.Finish(runtime.ExitStatus{ExitCode: code, At: time.Now(), Reason: why})
}

// Wait implements runtime.Runtime (runtime.ExitLatch: Delete stops a
// started VM first, so a deleted sandbox without an end never ran).
func (r *Runtime) Wait(ctx context.Context, id string) (runtime.ExitStatus, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.ExitStatus{}, err
	}
	return sb.exit.Wait(ctx, id, nil)
}

// Stop implements runtime.Runtime: SendCtrlAltDel (the guest powers off,
// reboot=k ends Firecracker) for opts.Timeout, then SIGKILL.
func (r *Runtime) Stop(ctx context.Context, id string, opts runtime.StopOptions) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.mu.Lock()
	sb.stopping = true
	started := sb.started
	sb.mu.Unlock()
	if !started {
		if err := r.killStray(ctx, sb.st); err != nil {
			return err
		}
		sb.startMu.Lock() // a Start under way finishes first
		sb.mu.Lock()
		started = sb.started
		sb.mu.Unlock()
		if !started {
			r.ended(sb, "stopped before it started", -1)
			sb.startMu.Unlock()
			return nil
		}
		sb.startMu.Unlock()
	}
	if opts.Timeout > 0 {
		actx, cancel := context.WithTimeout(ctx, time.Second)
		c := r.client(sb.st)
		_ = c.PatchVM(actx, VMResumed) // a paused guest cannot shut down
		err := c.Action(actx, ActionSendCtrlAltDel)
		cancel()
		if err == nil && vmm.Within(ctx, sb.exit.Done(), opts.Timeout) {
			return nil
		}
	}
	select {
	case <-sb.exit.Done():
		return nil
	default:
	}
	sb.mu.Lock()
	pid := sb.st.Pid
	sb.mu.Unlock()
	if err := vmm.Kill(pid); err != nil {
		return errdefs.New(errdefs.ErrInternal, "microvm %s kill: %w", id, err)
	}
	select {
	case <-sb.exit.Done():
		return nil
	case <-ctx.Done():
		return fmt.Errorf("microvm %s stop: %w", id, ctx.Err())
	}
}

// killStray kills a firecracker of st the backend does not hold as
// started (a node restart lost it), found by its run file or /proc.
func (r *Runtime) killStray(ctx context.Context, st runState) error {
	if rs, err := readRunState(st.StateDir); err == nil && rs.ID == st.ID && r.isOurs(rs.Pid, rs.StartTime, rs.JailID) {
		return vmm.KillAndWait(ctx, rs.Pid, killWait)
	}
	for _, pid := range r.findVMM(st.JailID) {
		if err := vmm.KillAndWait(ctx, pid, killWait); err != nil {
			return err
		}
	}
	return nil
}

// Delete implements runtime.Runtime: the VMM, the jail (files, bind
// mounts, the jailer's device nodes), its cgroup, the uid, the disks and
// run file in StateDir. The tap is the node's (it goes with the netns).
func (r *Runtime) Delete(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return r.deleteUnknown(ctx, id)
	}
	sb.mu.Lock()
	started := sb.started
	sb.mu.Unlock()
	if started {
		if err := r.Stop(ctx, id, runtime.StopOptions{}); err != nil {
			return err
		}
	} else if err := r.killStray(ctx, sb.st); err != nil {
		return err
	}
	st := sb.st
	if err := r.cleanup(st); err != nil {
		return err
	}
	r.uids.put(st.UID)
	r.sbs.Remove(id)
	sb.exit.Gone()
	return nil
}

// deleteUnknown is Delete of a sandbox this instance does not hold (the
// node restarted and did not Recover it): its jail ID follows from its
// ID, so its firecracker (found by --id in /proc), jail and cgroup go.
// Its StateDir is the node's to remove.
func (r *Runtime) deleteUnknown(ctx context.Context, id string) error {
	jid := jailIDOf(id)
	for _, pid := range r.findVMM(jid) {
		if err := vmm.KillAndWait(ctx, pid, killWait); err != nil {
			return fmt.Errorf("microvm %s delete: %w", id, err)
		}
	}
	v := 1
	if unified() {
		v = 2
	}
	return errors.Join(r.cfg.RemoveJail(jid), removeCgroup(r.cgroupParent()+"/"+jid, v))
}

// cleanup removes what Create and the jailer made for st.
func (r *Runtime) cleanup(st runState) error {
	var errs []error
	if st.JailID != "" {
		errs = append(errs, r.cfg.RemoveJail(st.JailID))
		errs = append(errs, removeCgroup(st.Cgroup, st.CgroupV))
	}
	for _, f := range ownedFiles {
		if err := os.Remove(filepath.Join(st.StateDir, f)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, errdefs.New(errdefs.ErrInternal, "microvm delete %s: %w", f, err))
		}
	}
	return errors.Join(errs...)
}

// removeCgroup removes the jailer's cgroup of the VM (its process gone):
// under every v1 controller, or the v2 directory.
func removeCgroup(path string, version int) error {
	dirs := []string{filepath.Join("/sys/fs/cgroup", path)}
	if version == 1 {
		dirs = dirs[:0]
		ents, _ := os.ReadDir("/sys/fs/cgroup")
		for _, e := range ents {
			dirs = append(dirs, filepath.Join("/sys/fs/cgroup", e.Name(), path))
		}
	}
	var errs []error
	for _, d := range dirs {
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, unix.ENOTDIR) {
			errs = append(errs, errdefs.New(errdefs.ErrInternal, "microvm cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// Status implements runtime.Runtime.
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
	sb.mu.Lock()
	started, st := sb.started, sb.st
	sb.mu.Unlock()
	if !started {
		return runtime.Status{State: runtime.StateCreated}, nil
	}
	info, err := r.client(st).InstanceInfo(ctx)
	if err == nil {
		switch info.State {
		case "Paused":
			return runtime.Status{State: runtime.StatePaused, Pid: st.Pid}, nil
		case "Not started":
			return runtime.Status{State: runtime.StateCreated, Pid: st.Pid}, nil
		}
	}
	return runtime.Status{State: runtime.StateRunning, Pid: st.Pid}, nil
}

// Recover implements runtime.Runtime: the run file in the Handle's
// StateDir names the sandbox's firecracker (pid and start time, checked
// against /proc); a running one is watched through a pidfd.
func (r *Runtime) Recover(ctx context.Context, h runtime.Handle) error {
	var hs runState
	if err := json.Unmarshal(h.State, &hs); err != nil || hs.StateDir == "" {
		return errdefs.Invalid("handle", "microvm handle %q has no state dir (%v)", h.ID, err)
	}
	if r.sbs.Lookup(h.ID) != nil {
		return nil
	}
	st, err := readRunState(hs.StateDir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errdefs.New(errdefs.ErrNotFound, "microvm sandbox %q: nothing of it in %s", h.ID, hs.StateDir)
	case err != nil:
		return err
	case st.ID != h.ID:
		return errdefs.New(errdefs.ErrNotFound, "microvm sandbox %q: its state dir %s belongs to %q", h.ID, hs.StateDir, st.ID)
	}
	if err := r.uids.take(st.UID); err != nil {
		return err
	}
	started := st.Pid > 0
	if started && !r.isOurs(st.Pid, st.StartTime, st.JailID) {
		st.Pid = 0
		if pids := r.findVMM(st.JailID); len(pids) > 0 {
			st.Pid, st.StartTime = pids[0], vmm.StartTime(pids[0])
		}
	} else if !started {
		if pids := r.findVMM(st.JailID); len(pids) > 0 {
			started, st.Pid, st.StartTime = true, pids[0], vmm.StartTime(pids[0])
		}
	}
	sb := &sandbox{id: h.ID, st: st, started: started, exit: runtime.NewExitLatch()}
	if !r.sbs.Add(h.ID, sb) {
		return nil
	}
	if !started {
		return nil
	}
	if st.Pid == 0 {
		r.ended(sb, "firecracker was gone when the node looked", -1)
		return nil
	}
	pfd, err := unix.PidfdOpen(st.Pid, 0)
	if err != nil {
		r.ended(sb, "firecracker was gone when the node looked", -1)
		return nil
	}
	r.watch(sb, pfd)
	return nil
}

// isOurs says whether pid is still the firecracker of jail jid (started
// at stime when known).
func (r *Runtime) isOurs(pid int, stime uint64, jid string) bool {
	return vmm.Is(pid, stime, func(args []string) bool { return r.isVMMOf(args, jid) })
}

// isVMMOf: a command line with "--id <jid>" (the jailer and the
// firecracker it execs both have it) whose exec is the configured
// binary's name.
func (r *Runtime) isVMMOf(args []string, jid string) bool {
	if len(args) == 0 {
		return false
	}
	base := filepath.Base(args[0])
	if base != filepath.Base(r.cfg.FirecrackerPath) && base != filepath.Base(r.cfg.JailerPath) {
		return false
	}
	for i, a := range args {
		if a == "--id" && i+1 < len(args) && args[i+1] == jid {
			return true
		}
	}
	return false
}

func (r *Runtime) findVMM(jid string) []int {
	return vmm.Find(func(args []string) bool { return r.isVMMOf(args, jid) })
}

// killWait bounds the wait for a VMM killed by Stop, Delete or Recover.
const killWait = 10 * time.Second

// AgentConn implements runtime.Runtime: a connection to the guest's
// agent on vsock port AgentVsockPort through Firecracker's host socket.
func (r *Runtime) AgentConn(ctx context.Context, id string) (net.Conn, error) {
	sb, err := r.get(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	st := sb.st
	sb.mu.Unlock()
	c, err := DialVsock(ctx, filepath.Join(r.cfg.Root(st.JailID), strings.TrimPrefix(st.Plan.VsockPath, "/")), AgentVsockPort)
	if err != nil {
		return nil, fmt.Errorf("microvm %s agent: %w", id, err)
	}
	return c, nil
}

// Pause implements runtime.Pauser: PATCH /vm Paused (memory kept).
func (r *Runtime) Pause(ctx context.Context, id string) error { return r.patch(ctx, id, VMPaused) }

// Resume implements runtime.Pauser: PATCH /vm Resumed.
func (r *Runtime) Resume(ctx context.Context, id string) error { return r.patch(ctx, id, VMResumed) }

func (r *Runtime) patch(ctx context.Context, id, state string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.mu.Lock()
	started, st := sb.started, sb.st
	sb.mu.Unlock()
	select {
	case <-sb.exit.Done():
		return errdefs.New(errdefs.ErrFailedPrecondition, "microvm sandbox %q has stopped", id)
	default:
	}
	if !started {
		return errdefs.New(errdefs.ErrFailedPrecondition, "microvm sandbox %q has not started", id)
	}
	if err := r.client(st).PatchVM(ctx, state); err != nil {
		return fmt.Errorf("microvm %s: %w", id, err)
	}
	return nil
}
