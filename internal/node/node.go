// Package node is opendsec-node: final admission, the durable sandbox table,
// backends, lifetime and idle timeouts, recovery after a restart, and the
// HTTP path to every sandbox's agent. Restarting the node leaves running
// sandboxes alone; at start it re-attaches to them and finishes or undoes any
// create or stop it was in the middle of.
package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	goruntime "runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// Spec defaults and limits are sandboxspec's (DefaultCPU, sandboxspec.MaxTimeoutSec, ...).
const (
	// DefaultCPUOvercommit is Config.CPUOvercommit when unset: CPU is a
	// quota (cfs), not a reservation, and most sandboxes of a rollout idle
	// most of the time, so a node offers this many times its cores in
	// quotas.
	DefaultCPUOvercommit = 16
	// DefaultMemoryOvercommit is Config.MemoryOvercommit when unset:
	// memory limits add up to at most the node's memory.
	DefaultMemoryOvercommit = 1
	// teardownWorkers bounds the background teardowns of stopped
	// sandboxes running at once.
	teardownWorkers = 2
)

// ImageResolver turns an image name into layers and keeps them from being
// garbage-collected while a sandbox uses them. internal/image implements it.
type ImageResolver interface {
	// Hold resolves name and records holder (a sandbox ID) as its user.
	Hold(ctx context.Context, name, holder string) (runtime.Image, error)
	// Release drops every hold of holder.
	Release(ctx context.Context, holder string) error
}

// Network gives each sandbox its own policed network. internal/netpolicy's
// Manager implements it.
type Network interface {
	Validate(rules netpolicy.Rules) error
	Setup(ctx context.Context, id string, rules netpolicy.Rules) (netpolicy.Network, error)
	// Planned names the namespace path and resolver Setup will give id,
	// without making anything.
	Planned(id string) netpolicy.Network
	SetRules(ctx context.Context, id string, rules netpolicy.Rules) error
	Teardown(ctx context.Context, id string) error
	Recover(ctx context.Context, live func(id string) bool) (netpolicy.RecoverReport, error)
}

// Config configures a Node.
type Config struct {
	ID string
	// StateDir holds the sandbox table and per-sandbox directories.
	StateDir string
	// Backends by name (built with runtime.Open from the config's
	// backends section); DefaultBackend must be one of them.
	Backends       map[string]runtime.Runtime
	DefaultBackend string
	// DefaultBackendReason says why DefaultBackend is this one (the
	// daemon's choice for node.default_backend "auto"), for Info.
	DefaultBackendReason string
	// Unavailable says, by backend name, why a backend the node could
	// have (the microvm backend "auto" picks where it runs) did not open at
	// this start; a sandbox table holding that backend's sandboxes makes
	// New refuse to start, saying so.
	Unavailable map[string]string
	// Accelerator is the host's accelerator decision for VM backends,
	// reported in Info; nil if it was not detected.
	Accelerator *Accelerator
	// CoreScheduling is the host's core-scheduling decision for VM
	// backends (internal/runtime/sched, made by the daemon), reported in
	// Info; nil if not made.
	CoreScheduling *CoreScheduling
	Images         ImageResolver
	// Capacity; zero values are detected.
	CPU          float64
	MemoryMB     int64
	MaxSandboxes int64
	// CPUOvercommit and MemoryOvercommit multiply CPU and MemoryMB into
	// what admission lets sandboxes' limits add up to
	// (node.cpu_overcommit, node.memory_overcommit); 0 means
	// DefaultCPUOvercommit, DefaultMemoryOvercommit. One sandbox's limit
	// never exceeds CPU or MemoryMB.
	CPUOvercommit, MemoryOvercommit float64
	// MaxPidsLimit is the largest pids_limit a create may ask for
	// (node.max_pids_limit); 0 means sandboxspec.DefaultMaxPidsLimit.
	MaxPidsLimit int64
	// MaxUploadBytes is the upload limit (node.max_upload_mb) the agent
	// proxy applies to POST /files before any data moves; 0 leaves it to
	// the agent.
	MaxUploadBytes int64
	// Build configures image builds (build.go).
	Build BuildConfig
	// Disk: the writable-layer quota of a sandbox that asks for none
	// (DiskDefaultMB), the largest one may ask for (DiskMaxMB), and the free
	// space the state dir's filesystem keeps: a create is refused when
	// less than DiskReserveMB is free (the table lives there too; 0: no
	// check). Zero default and maximum are DefaultDiskMB, DefaultDiskMaxMB.
	DiskDefaultMB, DiskMaxMB, DiskReserveMB int64
	// AgentReadyTimeout bounds the wait for a new sandbox's agent.
	AgentReadyTimeout time.Duration
	// ReapInterval is how often timeouts are checked (default 1s).
	ReapInterval time.Duration
	// MaxPaused is how long a sandbox may stay paused before the reaper
	// stops it; 0 keeps paused sandboxes until they are resumed or stopped.
	MaxPaused time.Duration
	// Clock is the time lifetimes are measured with (nil: the wall clock).
	// Tests move it forward instead of sleeping.
	Clock func() time.Time
	// Network, when set, puts every sandbox on its own policed network
	// (default deny). Nil leaves sandboxes in an empty network namespace.
	Network Network
	// Pool configures the warm pool (Size 0: off).
	Pool PoolConfig
	// DeferTeardown makes Stop return once the sandbox is dead and leaves
	// the rest of its teardown to a background worker (teardownLater);
	// false tears down before Stop returns.
	DeferTeardown bool
	// Trajectory configures the trajectory log (node.trajectory).
	Trajectory TrajectoryConfig
}

// Node runs sandboxes on one machine.
type Node struct {
	cfg   Config
	table *table

	mu        sync.Mutex
	sandboxes map[string]*sandbox // guarded by mu
	requests  map[string]*sandbox // request_id → sandbox; guarded by mu
	// aliases maps the ID a create asked for to the ID of the warm-pool
	// sandbox it got, so that a caller that gave up on the create can
	// still stop it by the ID it knows; guarded by mu.
	aliases map[string]string
	// reservedCPU/MemoryMB are the resources of sandboxes in the table; guarded by mu.
	reservedCPU float64
	reservedMem int64
	// usedSeq grows with every change to the reservations (admit, forget):
	// placement orders readings of Usage by it. It starts at the node's
	// start time in nanoseconds so that it grows across restarts too;
	// guarded by mu.
	usedSeq uint64

	// tearing counts stopped sandboxes whose teardown runs in the
	// background (teardownLater); guarded by mu.
	tearing int
	// teardownSlots bounds the teardowns running at once.
	teardownSlots chan struct{}
	// teardowns counts the background teardowns not yet ended.
	teardowns sync.WaitGroup

	// reaping holds the IDs of sandboxes the reaper is stopping; guarded by mu.
	reaping map[string]bool

	closed chan struct{}
	// life is the node's lifetime: background work (checks, exit
	// watchers) derives from it, and Shutdown cancels it.
	life     context.Context
	stopLife context.CancelFunc
	wg       sync.WaitGroup // the reaper and its stops

	// dead holds sandboxes that died lately, for Get; guarded by mu.
	dead map[string]tombstone

	// gate refuses table writers once shutdown begins; see Shutdown.
	gate gate

	// pool is the warm pool; nil when off.
	pool *pool

	// snaps is the snapshot table (snapshot.go).
	snaps *snapshots

	metrics *metrics

	trajState
}

// sandbox is the in-memory view of one record.
type sandbox struct {
	rec *record // replaced, never mutated, under Node.mu after creation
	// id and backend never change: read them without Node.mu.
	id, backend string

	// ready is closed when the create finishes (err says how).
	ready chan struct{}
	err   error
	// started is closed when the new sandbox's agent first answered, or
	// checkAgent gave up: until then init may be starting the agent, and a
	// freeze can catch a task that cannot freeze mid-exec. Nil for a
	// sandbox recovered after a restart.
	started chan struct{}

	// died: its init ended without a stop (see watchExit).
	died atomic.Bool

	lastActivity atomic.Int64 // unix nanos
	active       atomic.Int32 // open agent requests
	reason       atomic.Value // string: why it stopped

	transportOnce sync.Once
	transport     atomic.Pointer[http.Transport]

	// stopDone is closed when the stop in progress ends; nil when no stop
	// runs. A stop that failed leaves the sandbox in state stopping with
	// stopDone nil, and the reaper tries again. Guarded by Node.mu.
	stopDone chan struct{}
	stopErr  error

	// syncTeardown: Stop tears the sandbox down before it returns (build
	// sandboxes, whose layers the build removes next). Set before admission.
	syncTeardown bool

	// alias is the ID the create asked for when the sandbox came from the
	// warm pool with its own (Node.aliases maps it back for Stop).
	alias string

	// pauseMu serialises Pause and Resume of this sandbox.
	pauseMu sync.Mutex
	// pausing is set while a pause freezes the sandbox.
	pausing atomic.Bool
	// resuming is the auto-resume in progress, nil when none; guarded by
	// Node.mu.
	resuming *resumeFlight
	// fsPauses counts the filesystem-only pauses begun: watchExit takes an
	// end of init seen after one began for the pause, not a death.
	fsPauses atomic.Int64
	// released: the sandbox's CPU and memory are not reserved (it is
	// paused keeping only its files); guarded by Node.mu.
	released bool
	// lastCPU is the previous CPU sample, for Metrics.
	lastCPU atomic.Pointer[cpuSample]
}

func (s *sandbox) touch() { s.lastActivity.Store(time.Now().UnixNano()) }

// New opens the sandbox table, recovers every sandbox in it and starts the
// timeout reaper. Shutdown (or Close) stops the reaper and leaves sandboxes
// running.
func New(ctx context.Context, cfg Config) (*Node, error) {
	if err := sandboxid.ValidNode(cfg.ID); err != nil {
		return nil, err
	}
	if _, ok := cfg.Backends[cfg.DefaultBackend]; !ok {
		return nil, errdefs.Invalid("node.default_backend", "%q is not a configured backend (have %s)", cfg.DefaultBackend, strings.Join(backendNames(cfg.Backends), ", "))
	}
	if cfg.Images == nil {
		return nil, errdefs.Invalid("node.image_dir", "no image store configured")
	}
	if cfg.CPU <= 0 {
		cfg.CPU = float64(goruntime.NumCPU())
	}
	if cfg.MemoryMB <= 0 {
		cfg.MemoryMB = detectMemoryMB() * 9 / 10
	}
	if cfg.MaxSandboxes <= 0 {
		cfg.MaxSandboxes = 1000
	}
	if cfg.CPUOvercommit <= 0 {
		cfg.CPUOvercommit = DefaultCPUOvercommit
	}
	if cfg.MemoryOvercommit <= 0 {
		cfg.MemoryOvercommit = DefaultMemoryOvercommit
	}
	if cfg.MaxPidsLimit <= 0 {
		cfg.MaxPidsLimit = sandboxspec.DefaultMaxPidsLimit
	}
	if cfg.DiskMaxMB <= 0 {
		cfg.DiskMaxMB = DefaultDiskMaxMB
	}
	if cfg.DiskDefaultMB <= 0 {
		cfg.DiskDefaultMB = min(DefaultDiskMB, cfg.DiskMaxMB)
	}
	if cfg.AgentReadyTimeout <= 0 {
		cfg.AgentReadyTimeout = 30 * time.Second
	}
	if cfg.ReapInterval <= 0 {
		cfg.ReapInterval = time.Second
	}
	t, err := openTable(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	n := &Node{
		cfg:       cfg,
		table:     t,
		sandboxes: map[string]*sandbox{},
		requests:  map[string]*sandbox{},
		aliases:   map[string]string{},
		closed:    make(chan struct{}),
		dead:      map[string]tombstone{},
		usedSeq:   uint64(time.Now().UnixNano()),
		// Teardown is mostly runc, umount and netlink work: two at a
		// time keep it off the creates' cores.
		teardownSlots: make(chan struct{}, teardownWorkers),
	}
	if n.traj, err = openTrajectory(cfg.StateDir, cfg.Trajectory, cfg.Clock); err != nil {
		t.close()
		return nil, err
	}
	if n.snaps, err = openSnapshots(ctx, cfg.StateDir, cfg.Images); err != nil {
		t.close()
		return nil, err
	}
	n.life, n.stopLife = context.WithCancel(context.WithoutCancel(ctx))
	n.metrics = newMetrics(n)
	if err := n.recover(ctx); err != nil {
		t.close()
		return nil, err
	}
	if cfg.Network != nil {
		rep, err := cfg.Network.Recover(ctx, func(id string) bool {
			_, ok := n.sandboxes[id]
			return ok
		})
		if err != nil {
			t.close()
			return nil, fmt.Errorf("recover sandbox networks: %w", err)
		}
		log.G(ctx).Info("sandbox networks recovered", "kept", len(rep.Kept), "removed", len(rep.Removed))
	}
	n.reattachTrajectories()
	n.wg.Add(1)
	go n.reapLoop()
	if n.pool = newPool(n, cfg.Pool); n.pool != nil {
		n.wg.Add(1)
		go n.pool.loop()
	}
	return n, nil
}

// ID returns the node's ID.
func (n *Node) ID() string { return n.cfg.ID }

func backendNames(m map[string]runtime.Runtime) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func detectMemoryMB() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 4096
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) >= 2 && fs[0] == "MemTotal:" {
			kb, _ := strconv.ParseInt(fs[1], 10, 64)
			return kb / 1024
		}
	}
	return 4096
}

// normalize applies defaults and validates s (sandboxspec.Normalize, the
// same rules as the apiserver's), then checks what depends on this node:
// the backend, its capacity, pausing, network policy. Errors name the field
// and change nothing.
func (n *Node) normalize(s *specRecord) error {
	ns, err := sandboxspec.Normalize(*s)
	if err != nil {
		return err
	}
	if ns.Backend == "" {
		ns.Backend = n.cfg.DefaultBackend
	}
	if ns.DiskMB == 0 {
		ns.DiskMB = n.cfg.DiskDefaultMB
	}
	if err := sandboxspec.CheckFits(ns, sandboxspec.Limits{
		Where: "node " + n.cfg.ID, MaxCPU: n.cfg.CPU, MaxMemoryMB: n.cfg.MemoryMB, MaxDiskMB: n.cfg.DiskMaxMB, Backends: backendNames(n.cfg.Backends),
		MaxPidsLimit: n.cfg.MaxPidsLimit,
	}); err != nil {
		return err
	}
	if err := n.cfg.Backends[ns.Backend].ValidateOptions(ns.BackendOptions); err != nil {
		return err
	}
	if _, ok := n.cfg.Backends[ns.Backend].(runtime.Pauser); ns.PauseOnTimeout() && !ok {
		field := "on_timeout"
		if s.OnTimeout == "" {
			field = "auto_pause"
		}
		return errdefs.Invalid(field, "the %s backend cannot pause sandboxes; leave %s unset (the sandbox is stopped at its timeout) or pick a backend that can pause", ns.Backend, field)
	}
	if _, ok := n.cfg.Backends[ns.Backend].(runtime.FilesystemPauser); ns.FilesystemPauseOnTimeout() && !ok {
		return errdefs.Invalid("on_timeout", "the %s backend cannot pause a sandbox keeping only its files; give \"pause\" (memory kept) or \"stop\", or run it on the container backend (backend: container; microvm, vm and gvisor cannot)", ns.Backend)
	}
	if ns.Network != nil && n.cfg.Network == nil {
		return errdefs.NetworkOff(n.cfg.ID)
	}
	if n.cfg.Network != nil {
		var rules netpolicy.Rules
		if ns.Network != nil {
			rules = *ns.Network
		}
		if err := n.cfg.Network.Validate(rules); err != nil {
			return prefixField("network.", err)
		}
	}
	*s = ns
	return nil
}

// get returns the sandbox or a not-found error naming the id.
func (n *Node) get(id string) (*sandbox, error) {
	n.mu.Lock()
	sb, ok := n.sandboxes[id]
	n.mu.Unlock()
	if !ok {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", id)
	}
	return sb, nil
}

// Get returns a sandbox's record.
func (n *Node) Get(ctx context.Context, id string) (*record, *sandbox, error) {
	sb, err := n.get(id)
	if errdefs.IsNotFound(err) {
		if dead, ok := n.deadSandbox(id); ok {
			sb, err = dead, nil
		}
	}
	if err != nil {
		return nil, nil, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return sb.rec, sb, nil
}

// List returns every sandbox on the node.
func (n *Node) List(ctx context.Context) []*sandbox {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]*sandbox, 0, len(n.sandboxes))
	for _, sb := range n.sandboxes {
		out = append(out, sb)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].rec.CreatedAt.Before(out[j].rec.CreatedAt) })
	return out
}

// Usage reports reserved resources and the sandbox count.
func (n *Node) Usage() (cpu float64, memMB int64, count int) {
	u := n.usage()
	return u.cpu, u.memMB, u.count
}

// usageReading is one reading of the reservations and its usedSeq.
type usageReading struct {
	cpu   float64
	memMB int64
	count int
	seq   uint64
}

func (n *Node) usage() usageReading {
	n.mu.Lock()
	defer n.mu.Unlock()
	return usageReading{n.reservedCPU, n.reservedMem, len(n.sandboxes), n.usedSeq}
}

// cpuQuota is the CPU the node offers its sandboxes in quotas.
func (n *Node) cpuQuota() float64 { return n.cfg.CPU * n.cfg.CPUOvercommit }

// memQuota is the memory (MiB) the node's sandboxes' limits may add up to.
func (n *Node) memQuota() int64 { return int64(float64(n.cfg.MemoryMB) * n.cfg.MemoryOvercommit) }

// StopAll stops every sandbox on the node (used at shutdown with
// --stop-sandboxes), teardownWorkers at a time, and waits for their
// teardowns; failures are logged.
func (n *Node) StopAll(ctx context.Context, reason string) {
	sem := make(chan struct{}, teardownWorkers)
	var wg sync.WaitGroup
	for _, sb := range n.List(ctx) {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := n.Stop(ctx, sb.id, reason); err != nil && !errdefs.IsNotFound(err) {
				log.G(ctx).Error("stop sandbox", log.SandboxID(sb.id), log.Err(err))
			}
		})
	}
	wg.Wait()
	n.teardowns.Wait()
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// prefixField puts prefix before the field an invalid-argument error names
// ("allow[0].cidr" → "network.allow[0].cidr"); other errors pass unchanged.
func prefixField(prefix string, err error) error {
	var fe *errdefs.FieldError
	if !errors.As(err, &fe) {
		return err
	}
	return errdefs.Invalid(prefix+fe.Field, "%s", fe.Msg)
}

// CoreScheduling says whether VMs get core-scheduling cookies, and why.
type CoreScheduling struct {
	Enabled bool
	Reason  string
}

// Accelerator is the host's VM accelerator decision, made by the daemon
// with internal/runtime/kvmprobe (the node sees backends only through
// internal/runtime's interfaces, so it gets the result, not the package).
type Accelerator struct {
	Accel             string // "kvm" or "tcg"
	Kind              string // "hardware", "pvm" or "none"
	Module            string // kvm_intel, kvm_amd, kvm_pvm or ""
	Reason            string
	ProbeInstructions int64
	ProbeDuration     time.Duration
	DetectedAt        time.Time
}
