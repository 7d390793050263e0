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
	"path/filepath"
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
	// CPUOvercommit: CPU is a quota (cfs), not a reservation, and most
	// sandboxes of a rollout idle most of the time, so a node offers this
	// many times its cores in quotas. Memory is never overcommitted.
	CPUOvercommit = 16
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
	Images         ImageResolver
	// Capacity; zero values are detected.
	CPU          float64
	MemoryMB     int64
	MaxSandboxes int64
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

	metrics *metrics
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

	// alias is the ID the create asked for when the sandbox came from the
	// warm pool with its own (Node.aliases maps it back for Stop).
	alias string

	// pauseMu serialises Pause and Resume of this sandbox.
	pauseMu sync.Mutex
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

// CreateRequest is what the node needs to create a sandbox.
type CreateRequest struct {
	// ID is the new sandbox's ID when it is made from scratch; one taken
	// from the warm pool keeps its own (Stop still finds it by ID).
	ID        string
	RequestID string
	Spec      specRecord
	// SkipPool makes the sandbox from scratch even when the warm pool
	// holds one of its shape.
	SkipPool bool
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
	if err := sandboxspec.CheckFits(ns, sandboxspec.Limits{
		Where: "node " + n.cfg.ID, MaxCPU: n.cfg.CPU, MaxMemoryMB: n.cfg.MemoryMB, Backends: backendNames(n.cfg.Backends),
	}); err != nil {
		return err
	}
	if err := n.cfg.Backends[ns.Backend].ValidateOptions(ns.BackendOptions); err != nil {
		return err
	}
	if _, ok := n.cfg.Backends[ns.Backend].(runtime.Pauser); ns.AutoPause && !ok {
		return errdefs.Invalid("auto_pause", "the %s backend cannot pause sandboxes; leave auto_pause off (the sandbox is stopped at its timeout) or pick a backend that can pause", ns.Backend)
	}
	if ns.Network != nil && n.cfg.Network == nil {
		return errdefs.Invalid("network", "node %s has network policy turned off (node.network.enabled), so its sandboxes have no network; leave network unset", n.cfg.ID)
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

// Create admits and creates a sandbox (or takes one from the warm pool),
// returning once it runs and its agent's socket listens (requests wait in
// the socket's backlog until the agent serves). It is idempotent on
// RequestID: a retry returns the first sandbox.
func (n *Node) Create(ctx context.Context, req CreateRequest) (_ *record, err error) {
	start, path := time.Now(), createPathCold
	defer func() { n.metrics.createDone(path, start, err) }()
	end, err := n.begin("create sandbox " + req.ID)
	if err != nil {
		return nil, err
	}
	defer end()
	if _, err := sandboxid.Node("sandbox_id", req.ID); err != nil {
		return nil, err
	}
	if req.ID[:sandboxid.NodeIDLen] != n.cfg.ID {
		return nil, errdefs.Invalid("sandbox_id", "%q belongs to node %s, not %s", req.ID, req.ID[:sandboxid.NodeIDLen], n.cfg.ID)
	}
	spec := req.Spec
	if err := n.normalize(&spec); err != nil {
		return nil, err
	}
	if n.pool != nil && !req.SkipPool {
		if k, ok := n.pool.key(ctx, spec); ok {
			if slot := n.pool.take(k, spec); slot != nil {
				path = createPathWarm
				return n.createFromPool(ctx, req, spec, k, slot)
			}
		}
	}
	tHold := time.Now()
	img, err := n.cfg.Images.Hold(ctx, spec.Image, req.ID)
	holdDur := time.Since(tHold)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return nil, errdefs.Invalid("image", "%v", err)
		}
		return nil, fmt.Errorf("resolve image: %w", err)
	}

	now := time.Now().UTC()
	rec := &record{
		ID:        req.ID,
		RequestID: req.RequestID,
		Backend:   spec.Backend,
		Spec:      spec,
		State:     stateCreating,
		CreatedAt: now,
		ExpiresAt: now.Add(time.Duration(spec.TimeoutSec) * time.Second),
		StateDir:  sandboxDir(n.cfg.StateDir, req.ID),
	}
	sb := &sandbox{rec: rec, id: rec.ID, backend: rec.Backend, ready: make(chan struct{}), started: make(chan struct{})}
	sb.touch()

	// Admission and idempotency, atomically.
	n.mu.Lock()
	if req.RequestID != "" {
		if prev, ok := n.requests[req.RequestID]; ok {
			prevID := prev.rec.ID
			n.mu.Unlock()
			if prevID != req.ID {
				n.releaseHold(ctx, req.ID)
			}
			return n.waitReady(ctx, prev)
		}
	}
	if _, ok := n.sandboxes[req.ID]; ok {
		n.mu.Unlock()
		return nil, errdefs.New(errdefs.ErrAlreadyExists, "sandbox %s already exists", req.ID)
	}
	if int64(len(n.sandboxes)) >= n.cfg.MaxSandboxes {
		n.mu.Unlock()
		n.releaseHold(ctx, req.ID)
		return nil, errdefs.New(errdefs.ErrResourceExhausted, "node %s runs its maximum of %d sandboxes; stop some or add nodes", n.cfg.ID, n.cfg.MaxSandboxes)
	}
	if n.reservedMem+spec.MemoryMB > n.cfg.MemoryMB {
		free := n.cfg.MemoryMB - n.reservedMem
		n.mu.Unlock()
		n.releaseHold(ctx, req.ID)
		return nil, errdefs.New(errdefs.ErrResourceExhausted, "node %s has %d MiB of memory free, %d requested; stop sandboxes or ask for less", n.cfg.ID, free, spec.MemoryMB)
	}
	n.sandboxes[req.ID] = sb
	if req.RequestID != "" {
		n.requests[req.RequestID] = sb
	}
	n.reservedCPU += spec.CPU
	n.reservedMem += spec.MemoryMB
	n.mu.Unlock()

	err = n.doCreate(ctx, sb, img, holdDur)
	if err != nil {
		n.forget(sb)
	}
	sb.err = err
	close(sb.ready)
	if err != nil {
		return nil, err
	}
	return sb.rec, nil
}

// createFromPool admits the create with the prestarted sandbox slot of
// shape k and lets it run with the caller's env, timeouts and labels; a
// refusal gives slot back to the pool. A failed launch fails the create
// (the sandbox is removed): falling back to a cold create under the asked
// ID would race with a caller that gave up and stopped it by that ID.
func (n *Node) createFromPool(ctx context.Context, req CreateRequest, spec specRecord, k poolKey, slot *record) (*record, error) {
	now := time.Now().UTC()
	rec := &record{
		ID:        slot.ID,
		RequestID: req.RequestID,
		Backend:   spec.Backend,
		Spec:      spec,
		State:     stateCreating,
		CreatedAt: now,
		ExpiresAt: now.Add(time.Duration(spec.TimeoutSec) * time.Second),
		StateDir:  slot.StateDir,
		Handle:    slot.Handle,
		FromPool:  true,
	}
	sb := &sandbox{rec: rec, id: rec.ID, backend: rec.Backend, ready: make(chan struct{}), started: make(chan struct{}), alias: req.ID}
	sb.touch()
	n.mu.Lock()
	if req.RequestID != "" {
		if prev, ok := n.requests[req.RequestID]; ok {
			n.mu.Unlock()
			n.pool.giveBack(k, slot)
			rec, err := n.waitReady(ctx, prev)
			return rec, err
		}
	}
	refuse := func(err error) (*record, error) {
		n.mu.Unlock()
		n.pool.giveBack(k, slot)
		return nil, err
	}
	if _, ok := n.sandboxes[req.ID]; ok {
		return refuse(errdefs.New(errdefs.ErrAlreadyExists, "sandbox %s already exists", req.ID))
	}
	if int64(len(n.sandboxes)) >= n.cfg.MaxSandboxes {
		return refuse(errdefs.New(errdefs.ErrResourceExhausted, "node %s runs its maximum of %d sandboxes; stop some or add nodes", n.cfg.ID, n.cfg.MaxSandboxes))
	}
	if n.reservedMem+spec.MemoryMB > n.cfg.MemoryMB {
		free := n.cfg.MemoryMB - n.reservedMem
		return refuse(errdefs.New(errdefs.ErrResourceExhausted, "node %s has %d MiB of memory free, %d requested; stop sandboxes or ask for less", n.cfg.ID, free, spec.MemoryMB))
	}
	n.sandboxes[rec.ID] = sb
	if req.RequestID != "" {
		n.requests[req.RequestID] = sb
	}
	if req.ID != "" && req.ID != rec.ID {
		n.aliases[req.ID] = rec.ID
	}
	n.reservedCPU += spec.CPU
	n.reservedMem += spec.MemoryMB
	n.mu.Unlock()

	err := n.launch(ctx, sb)
	if err != nil {
		n.forget(sb)
		sb.err = err
		close(sb.ready)
		if derr := n.destroy(context.WithoutCancel(ctx), rec); derr != nil {
			log.G(ctx).Warn("remove warm-pool sandbox that failed to launch", log.SandboxID(rec.ID), log.Err(derr))
		}
		return nil, errdefs.New(errdefs.ErrUnavailable, "%w; retry the create (with skip_warm_pool to make one from scratch)", err)
	}
	close(sb.ready)
	n.mu.Lock()
	out := sb.rec
	n.mu.Unlock()
	return out, nil
}

// launch lets sb's prestarted sandbox run and records it running.
func (n *Node) launch(ctx context.Context, sb *sandbox) error {
	ctx = context.WithoutCancel(ctx)
	rec := sb.rec
	t0 := time.Now()
	if err := n.startRecorded(sb, *rec, func() error {
		if err := n.cfg.Backends[rec.Backend].(runtime.Prestarter).Launch(ctx, rec.ID, envList(rec.Spec.Env)); err != nil {
			return fmt.Errorf("launch sandbox: %w", err)
		}
		return nil
	}); err != nil {
		return err
	}
	tLaunched := time.Now()
	n.watchExit(sb)
	log.G(ctx).Info("sandbox running", log.SandboxID(rec.ID), slogImage(rec.Spec.Image), "from_warm_pool", true,
		"launch_ms", ms(tLaunched.Sub(t0)), "total_ms", ms(time.Since(t0)))
	go n.checkAgent(sb, tLaunched)
	return nil
}

func (n *Node) waitReady(ctx context.Context, sb *sandbox) (*record, error) {
	select {
	case <-sb.ready:
	case <-ctx.Done():
		return nil, fmt.Errorf("wait for sandbox %s: %w", sb.id, ctx.Err())
	}
	if sb.err != nil {
		return nil, sb.err
	}
	n.mu.Lock()
	rec := sb.rec
	n.mu.Unlock()
	return rec, nil
}

// doCreate makes the sandbox; on error everything it made is undone.
func (n *Node) doCreate(ctx context.Context, sb *sandbox, img runtime.Image, holdDur time.Duration) (err error) {
	rec := sb.rec
	l := log.G(ctx).With(log.SandboxID(rec.ID))
	rt := n.cfg.Backends[rec.Backend]
	// The create must finish or be undone even if the caller goes away.
	ctx = context.WithoutCancel(ctx)
	t0 := time.Now()
	var phases prepPhases
	h, err := n.prepare(ctx, rec, img, &phases)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			l.Warn("create failed, cleaning up", log.Err(err))
			n.destroy(ctx, rec)
		}
	}()
	rec2 := *rec
	rec2.Handle = h
	tCreated := time.Now()
	if err := n.startRecorded(sb, rec2, func() error {
		if err := rt.Start(ctx, rec.ID); err != nil {
			return fmt.Errorf("start sandbox: %w", err)
		}
		return nil
	}); err != nil {
		return err
	}
	tStarted := time.Now()
	// No wait for the agent here: its socket listens since before the
	// start, so the caller's first request waits in the socket's backlog
	// while init starts the server. checkAgent confirms the agent answers
	// and stops the sandbox if it never does.
	n.watchExit(sb)
	l.Info("sandbox running", slogImage(rec.Spec.Image),
		"hold_ms", ms(holdDur), "net_ms", ms(phases.net), "create_ms", ms(tCreated.Sub(t0)), "start_ms", ms(tStarted.Sub(tCreated)),
		"total_ms", ms(time.Since(t0)))
	go n.checkAgent(sb, tStarted)
	return nil
}

// startRecorded runs start while it records rec running, and publishes the
// record on sb once both succeeded. Recording while the backend starts
// hides the table's fsync behind the start: a node that dies before the
// start finished finds the record "running", asks the backend, and removes
// the sandbox unless it runs (recovery trusts the backend's state, not the
// record's).
func (n *Node) startRecorded(sb *sandbox, rec record, start func() error) error {
	rec.State = stateRunning
	putDone := make(chan error, 1)
	go func() { putDone <- n.table.put(&rec) }()
	startErr := start()
	if err := <-putDone; startErr == nil && err != nil {
		return fmt.Errorf("record sandbox: %w", err)
	}
	if startErr != nil {
		return startErr
	}
	n.mu.Lock()
	sb.rec = &rec
	n.mu.Unlock()
	return nil
}

// waitStarted waits until sb's agent first answered (or the node gave up
// on it): pausing or diffing a sandbox whose init is still starting the
// agent could catch a task that cannot freeze.
func waitStarted(ctx context.Context, sb *sandbox) error {
	if sb.started == nil {
		return nil
	}
	select {
	case <-sb.started:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("wait for the agent of sandbox %s to start: %w", sb.id, ctx.Err())
	}
}

// prepPhases are prepare's timings, for the log.
type prepPhases struct{ net time.Duration }

// sandboxDir is the directory of sandbox id under the node's state dir.
func sandboxDir(stateDir, id string) string { return filepath.Join(stateDir, "sandboxes", id) }

// prepare records rec (in its state: creating, or pooled) and makes
// everything of the sandbox but its start: its network (set up while the
// backend prepares the bundle) and the backend's Create. It returns the
// backend's handle; on error everything it made is undone, the image hold
// included.
func (n *Node) prepare(ctx context.Context, rec *record, img runtime.Image, phases *prepPhases) (_ runtime.Handle, err error) {
	rt := n.cfg.Backends[rec.Backend]
	ctx = context.WithoutCancel(ctx)
	var (
		netAttach   runtime.NetworkAttachment
		nameservers []string
		netDone     chan error
		netErr      error
	)
	waitNet := func() error {
		if netDone != nil {
			netErr = <-netDone
			netDone = nil
		}
		return netErr
	}
	// Installed before the first write: whatever fails, the image hold,
	// network, backend state, dir and record are undone.
	defer func() {
		if err != nil {
			_ = waitNet() // never tear down a network still being set up
			log.G(ctx).Warn("sandbox preparation failed, cleaning up", log.SandboxID(rec.ID), log.Err(err))
			n.destroy(ctx, rec)
		}
	}()
	if err := n.table.put(rec); err != nil {
		return runtime.Handle{}, fmt.Errorf("record sandbox: %w", err)
	}
	if n.cfg.Network != nil {
		var rules netpolicy.Rules
		if rec.Spec.Network != nil {
			rules = *rec.Spec.Network
		}
		plan := n.cfg.Network.Planned(rec.ID)
		netAttach, nameservers = attachment(plan), []string{plan.DNS.String()}
		netDone = make(chan error, 1)
		go func() {
			tNet := time.Now()
			nw, err := n.cfg.Network.Setup(ctx, rec.ID, rules)
			if phases != nil {
				phases.net = time.Since(tNet)
			}
			if err == nil && (nw.NetNSPath != plan.NetNSPath || nw.DNS != plan.DNS) {
				err = errdefs.New(errdefs.ErrInternal, "network of sandbox %s is %s (resolver %s), not the planned %s (%s)",
					rec.ID, nw.NetNSPath, nw.DNS, plan.NetNSPath, plan.DNS)
			}
			netDone <- err
		}()
	}
	if err := os.MkdirAll(rec.StateDir, 0o700); err != nil {
		return runtime.Handle{}, fmt.Errorf("make sandbox dir: %w", err)
	}
	h, err := rt.Create(ctx, n.backendSpec(rec, img, netAttach, nameservers))
	if err != nil {
		return runtime.Handle{}, fmt.Errorf("create sandbox: %w", err)
	}
	// No table write for the handle: a node that dies from here until the
	// sandbox is recorded running (or pooled) finds it "creating" and
	// deletes it by ID (the backend keeps an intent for exactly that).
	if err := waitNet(); err != nil {
		return runtime.Handle{}, fmt.Errorf("set up sandbox network: %w", err)
	}
	return h, nil
}

// backendSpec is what the backend gets for rec: the held image's root
// filesystem, the guest settings (the image's defaults under the
// sandbox's), the network attachment and the limits. A warm-pool sandbox
// is prestarted with the image's env only: its caller's comes at launch.
func (n *Node) backendSpec(rec *record, img runtime.Image, nw runtime.NetworkAttachment, nameservers []string) runtime.Spec {
	g := runtime.Guest{User: img.User, Workdir: img.Workdir, Nameservers: nameservers}
	if rec.Spec.User != "" {
		g.User = rec.Spec.User
	}
	if rec.Spec.Workdir != "" {
		g.Workdir = rec.Spec.Workdir
	}
	if rec.State == statePooled {
		g.Env = runtime.MergeEnv(img.Env, nil)
	} else {
		g.Env = runtime.MergeEnv(img.Env, envList(rec.Spec.Env))
	}
	return runtime.Spec{
		ID:     rec.ID,
		Rootfs: img.Rootfs,
		Resources: runtime.Resources{
			CPU:       rec.Spec.CPU,
			MemoryMB:  rec.Spec.MemoryMB,
			PidsLimit: rec.Spec.PidsLimit,
		},
		Guest:    g,
		Network:  nw,
		StateDir: rec.StateDir,
		Labels:   rec.Spec.Labels,
		Options:  rec.Spec.BackendOptions,
	}
}

// attachment is the backend's view of a sandbox network the node made.
func attachment(nw netpolicy.Network) runtime.NetworkAttachment {
	return runtime.NetworkAttachment{Mode: runtime.NetworkVeth, NetNS: nw.NetNSPath}
}

// envList is env as sorted "K=V" entries.
func envList(m map[string]string) []string {
	env := make([]string, 0, len(m))
	for k, v := range m {
		env = append(env, k+"="+v)
	}
	sort.Strings(env)
	return env
}

// checkAgent waits for a new sandbox's agent to answer /health (the first
// request through its socket's backlog) and stops the sandbox, with the
// reason, if it does not answer within AgentReadyTimeout: a sandbox whose
// init or agent cannot start never stays "running". It gives up quietly
// when the node closes or the sandbox goes away first (its Stop goes
// through the shutdown gate, so it needs no part in Shutdown's wait).
func (n *Node) checkAgent(sb *sandbox, started time.Time) {
	defer close(sb.started)
	ctx, cancel := context.WithCancel(n.life) // ends when the node shuts down
	defer cancel()
	id := sb.id
	l := log.G(ctx).With(log.SandboxID(id))
	err := n.waitAgent(ctx, sb)
	if err == nil {
		l.Debug("agent answered", "agent_ms", ms(time.Since(started)))
		return
	}
	if ctx.Err() != nil || errors.Is(err, errSandboxGone) || !n.stillRunning(sb) {
		return // the node closes, or the sandbox stopped or paused meanwhile
	}
	n.metrics.agentFailures.Inc()
	reason := "agent did not start: " + err.Error()
	l.Error("stopping sandbox whose agent never answered", "reason", reason)
	if err := n.Stop(ctx, id, reason); err != nil && !errdefs.IsNotFound(err) && !n.shuttingDown(err) {
		l.Error("stop sandbox whose agent never answered", log.Err(err))
	}
}

// forget drops sb from memory and releases its reservation.
func (n *Node) forget(sb *sandbox) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if cur, ok := n.sandboxes[sb.rec.ID]; ok && cur == sb {
		delete(n.sandboxes, sb.rec.ID)
		n.reservedCPU -= sb.rec.Spec.CPU
		n.reservedMem -= sb.rec.Spec.MemoryMB
	}
	if sb.rec.RequestID != "" && n.requests[sb.rec.RequestID] == sb {
		delete(n.requests, sb.rec.RequestID)
	}
	if sb.alias != "" && n.aliases[sb.alias] == sb.rec.ID {
		delete(n.aliases, sb.alias)
	}
	if t := sb.transport.Load(); t != nil {
		t.CloseIdleConnections()
	}
}

// destroy stops and deletes the sandbox's backend state and its directory,
// then removes its record. Errors are logged: the record is kept when the
// backend could not delete, so the next start retries.
func (n *Node) destroy(ctx context.Context, rec *record) error {
	l := log.G(ctx).With(log.SandboxID(rec.ID))
	rt, ok := n.cfg.Backends[rec.Backend]
	if ok {
		if err := rt.Stop(ctx, rec.ID, runtime.StopOptions{}); err != nil && !errdefs.IsNotFound(err) {
			l.Warn("stop sandbox", log.Err(err))
		}
		if err := rt.Delete(ctx, rec.ID); err != nil {
			l.Error("delete sandbox; will retry at next node start", log.Err(err))
			return fmt.Errorf("delete sandbox: %w", err)
		}
	}
	if n.cfg.Network != nil {
		if err := n.cfg.Network.Teardown(ctx, rec.ID); err != nil {
			l.Error("tear down sandbox network; will retry at next node start", log.Err(err))
			return fmt.Errorf("tear down sandbox network: %w", err)
		}
	}
	if err := os.RemoveAll(rec.StateDir); err != nil {
		l.Error("remove sandbox dir", log.Err(err))
		return fmt.Errorf("remove sandbox dir: %w", err)
	}
	if err := n.cfg.Images.Release(ctx, rec.ID); err != nil {
		l.Warn("release image hold", log.Err(err))
	}
	if err := n.table.delete(rec); err != nil {
		return fmt.Errorf("delete sandbox record: %w", err)
	}
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

// Stop stops and deletes a sandbox. reason is logged.
func (n *Node) Stop(ctx context.Context, id, reason string) error {
	end, err := n.begin("stop sandbox " + id)
	if err != nil {
		return err
	}
	defer end()
	sb, err := n.get(id)
	if errdefs.IsNotFound(err) {
		n.mu.Lock()
		real, ok := n.aliases[id]
		n.mu.Unlock()
		if ok {
			sb, err = n.get(real)
			id = real
		}
	}
	if err != nil {
		return err
	}
	select {
	case <-sb.ready:
	case <-ctx.Done():
		return ctx.Err()
	}
	if sb.err != nil {
		return errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", id)
	}
	n.mu.Lock()
	if done := sb.stopDone; done != nil {
		// Another stop is under way: report its outcome, not an early nil.
		n.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
		n.mu.Lock()
		err := sb.stopErr
		n.mu.Unlock()
		return err
	}
	done := make(chan struct{})
	sb.stopDone = done
	rec := *sb.rec
	rec.State = stateStopping
	sb.rec = &rec
	n.mu.Unlock()
	sb.reason.Store(reason)
	ctx = context.WithoutCancel(ctx)
	derr := n.table.put(&rec)
	if derr == nil {
		derr = n.destroy(ctx, &rec)
	}
	n.mu.Lock()
	sb.stopErr = derr
	if derr != nil {
		// Keep the sandbox (and its reservation) so nothing runs unseen;
		// the reaper retries.
		sb.stopDone = nil
	}
	n.mu.Unlock()
	close(done)
	if derr != nil {
		return fmt.Errorf("stop sandbox %s (will retry): %w", id, derr)
	}
	n.forget(sb)
	log.G(ctx).Info("sandbox stopped", log.SandboxID(id), "reason", reason)
	return nil
}

// SetTimeout makes the sandbox's lifetime end seconds from now.
func (n *Node) SetTimeout(ctx context.Context, id string, seconds int64) (*record, error) {
	end, err := n.begin("set timeout of sandbox " + id)
	if err != nil {
		return nil, err
	}
	defer end()
	return n.setTimeout(ctx, id, seconds)
}

// setTimeout is SetTimeout inside an admitted operation.
func (n *Node) setTimeout(ctx context.Context, id string, seconds int64) (*record, error) {
	if seconds <= 0 || seconds > sandboxspec.MaxTimeoutSec {
		return nil, errdefs.Invalid("timeout_seconds", "is %d; give 1..%d seconds", seconds, sandboxspec.MaxTimeoutSec)
	}
	sb, err := n.get(id)
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	if sb.rec.State != stateRunning {
		n.mu.Unlock()
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is %s", id, sb.rec.State)
	}
	rec := *sb.rec
	rec.ExpiresAt = time.Now().UTC().Add(time.Duration(seconds) * time.Second)
	rec.Spec.TimeoutSec = seconds
	sb.rec = &rec
	n.mu.Unlock()
	if err := n.table.put(&rec); err != nil {
		return nil, fmt.Errorf("record sandbox: %w", err)
	}
	return &rec, nil
}

// SetNetwork replaces a running sandbox's network rules. Invalid rules
// change nothing.
func (n *Node) SetNetwork(ctx context.Context, id string, rules netpolicy.Rules) (*record, error) {
	end, err := n.begin("set network of sandbox " + id)
	if err != nil {
		return nil, err
	}
	defer end()
	if n.cfg.Network == nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "node %s has network policy turned off (node.network.enabled); its sandboxes have no network", n.cfg.ID)
	}
	sb, err := n.get(id)
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	if sb.rec.State != stateRunning {
		n.mu.Unlock()
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is %s", id, sb.rec.State)
	}
	n.mu.Unlock()
	if err := n.cfg.Network.Validate(rules); err != nil {
		return nil, prefixField("network.", err)
	}
	if err := n.cfg.Network.SetRules(ctx, id, rules); err != nil {
		return nil, fmt.Errorf("set network rules: %w", err)
	}
	n.mu.Lock()
	rec := *sb.rec
	rec.Spec.Network = &rules
	sb.rec = &rec
	n.mu.Unlock()
	if err := n.table.put(&rec); err != nil {
		return nil, fmt.Errorf("record sandbox: %w", err)
	}
	return &rec, nil
}

// recover re-attaches to every sandbox in the table. Sandboxes caught in the
// middle of a create or stop are cleaned up; dead ones are removed.
func (n *Node) recover(ctx context.Context) error {
	recs, err := n.table.all()
	if err != nil {
		return fmt.Errorf("read sandbox table: %w", err)
	}
	for _, rec := range recs {
		l := log.G(ctx).With(log.SandboxID(rec.ID))
		rt, ok := n.cfg.Backends[rec.Backend]
		if !ok {
			l.Error("sandbox uses a backend this node no longer has; leaving its record", "backend", rec.Backend)
			continue
		}
		if rec.State != stateRunning && rec.State != statePaused {
			l.Info("cleaning up sandbox interrupted while " + rec.State)
			if rec.Handle.ID != "" {
				if err := rt.Recover(ctx, rec.Handle); err != nil && !errdefs.IsNotFound(err) {
					l.Warn("recover interrupted sandbox", log.Err(err))
				}
			}
			if err := n.destroy(ctx, rec); err != nil {
				l.Error("clean up interrupted sandbox", log.Err(err))
			}
			continue
		}
		// Only a backend's definite answer — gone, or stopped — removes a
		// sandbox. Any other error (a runc hiccup, an unknown handle
		// version after an upgrade) keeps it: killing live sandboxes on a
		// transient error at start would be far worse than a stale entry.
		dead := false
		if err := rt.Recover(ctx, rec.Handle); err != nil {
			if errdefs.IsNotFound(err) {
				dead = true
			} else {
				l.Error("recover sandbox; keeping it and its reservation", log.Err(err))
			}
		} else if st, err := rt.Status(ctx, rec.ID); err == nil && (st.State == runtime.StateStopped || st.State == runtime.StateCreated) {
			// Created: the node died between recording the sandbox
			// running and its start; nothing of it ever ran.
			dead = true
		} else if err == nil {
			// A node killed between a freeze (or thaw) and its record
			// finds the backend's state newer than the record's.
			rec = reconcilePaused(ctx, n.table, rec, st.State)
		} else if err != nil {
			if errdefs.IsNotFound(err) {
				dead = true
			} else {
				l.Error("sandbox status after recovery; keeping it", log.Err(err))
			}
		}
		if dead {
			l.Warn("sandbox died while the node was down; removing it")
			if err := n.destroy(ctx, rec); err != nil {
				l.Error("remove dead sandbox", log.Err(err))
			}
			continue
		}
		sb := &sandbox{rec: rec, id: rec.ID, backend: rec.Backend, ready: make(chan struct{})}
		close(sb.ready)
		sb.touch()
		n.sandboxes[rec.ID] = sb
		if rec.RequestID != "" {
			n.requests[rec.RequestID] = sb
		}
		n.reservedCPU += rec.Spec.CPU
		n.reservedMem += rec.Spec.MemoryMB
		n.watchExit(sb)
		l.Info("sandbox recovered")
	}
	return nil
}

// autoPauseTimeout bounds the reaper's pause of an auto_pause sandbox; past
// it the sandbox is stopped instead.
const autoPauseTimeout = time.Minute

// maxReapStops bounds the stops the reaper runs at once, so one stuck
// backend call delays no other expiry (unless that many are stuck).
const maxReapStops = 8

// reapLoop stops sandboxes whose lifetime or idle timeout has passed.
func (n *Node) reapLoop() {
	defer n.wg.Done()
	t := time.NewTicker(n.cfg.ReapInterval)
	defer t.Stop()
	slots := make(chan struct{}, maxReapStops)
	for {
		select {
		case <-n.closed:
			return
		case <-t.C:
			now := n.now()
			n.reap(now, slots)
			n.forgetDead(now)
		}
	}
}

// reap starts a stop for every sandbox that expired (or stayed paused longer
// than MaxPaused) and has none running from the reaper, at most cap(slots)
// at once. Shutdown waits for them, up to its deadline.
func (n *Node) reap(now time.Time, slots chan struct{}) {
	type victim struct {
		id, reason string
		pause      bool // auto_pause: pause instead of stopping
	}
	var vs []victim
	n.mu.Lock()
	if n.reaping == nil {
		n.reaping = map[string]bool{}
	}
	for id, sb := range n.sandboxes {
		if n.reaping[id] {
			continue
		}
		rec := sb.rec
		if rec.State == stateStopping && sb.stopDone == nil {
			vs = append(vs, victim{id, "retry of a failed stop", false})
			continue
		}
		if rec.State == statePaused && n.cfg.MaxPaused > 0 && now.Sub(rec.PausedAt) > n.cfg.MaxPaused {
			vs = append(vs, victim{id, "paused too long", false})
			continue
		}
		if rec.State != stateRunning {
			continue
		}
		if now.After(rec.ExpiresAt) {
			vs = append(vs, victim{id, "timeout", rec.Spec.AutoPause})
			continue
		}
		if rec.Spec.IdleSec > 0 && sb.active.Load() == 0 &&
			now.Sub(time.Unix(0, sb.lastActivity.Load())) > time.Duration(rec.Spec.IdleSec)*time.Second {
			vs = append(vs, victim{id, "idle", rec.Spec.AutoPause})
		}
	}
	for _, v := range vs {
		n.reaping[v.id] = true
	}
	n.mu.Unlock()
	for _, v := range vs {
		n.wg.Add(1)
		go n.reapOne(v.id, v.reason, v.pause, slots)
	}
}

// reapOne stops one expired sandbox once a slot is free, unless the node
// closes first.
func (n *Node) reapOne(id, reason string, pause bool, slots chan struct{}) {
	defer n.wg.Done()
	defer func() {
		n.mu.Lock()
		delete(n.reaping, id)
		n.mu.Unlock()
	}()
	select {
	case slots <- struct{}{}:
	case <-n.closed:
		return
	}
	defer func() { <-slots }()
	select {
	case <-n.closed:
		return
	default:
	}
	ctx := context.Background()
	if pause {
		pctx, cancel := context.WithTimeoutCause(ctx, autoPauseTimeout,
			fmt.Errorf("auto-pause took longer than %s", autoPauseTimeout))
		_, err := n.Pause(pctx, id)
		cancel()
		if err == nil || errors.Is(err, errdefs.ErrNotFound) || n.shuttingDown(err) {
			return
		}
		// A sandbox that cannot be paused (a freezer stuck, a backend
		// that lost the ability) must not outlive its timeout: stop it.
		log.G(ctx).Warn("auto-pause of expired sandbox failed; stopping it instead", log.SandboxID(id), "reason", reason, log.Err(err))
		reason += " (auto-pause failed)"
	}
	if err := n.Stop(ctx, id, reason); err != nil && !errors.Is(err, errdefs.ErrNotFound) && !n.shuttingDown(err) {
		log.G(ctx).Error("stop expired sandbox", log.SandboxID(id), log.Err(err))
	}
}

// Usage reports reserved resources and the sandbox count.
func (n *Node) Usage() (cpu float64, memMB int64, count int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.reservedCPU, n.reservedMem, len(n.sandboxes)
}

// StopAll stops every sandbox on the node (used at shutdown with
// --stop-sandboxes); failures are logged.
func (n *Node) StopAll(ctx context.Context, reason string) {
	for _, sb := range n.List(ctx) {
		if err := n.Stop(ctx, sb.rec.ID, reason); err != nil && !errdefs.IsNotFound(err) {
			log.G(ctx).Error("stop sandbox", log.SandboxID(sb.rec.ID), log.Err(err))
		}
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// releaseHold drops the image hold of a sandbox that was refused before it
// was made. (A sandbox that exists keeps its hold: its holder is its ID.)
func (n *Node) releaseHold(ctx context.Context, id string) {
	if err := n.cfg.Images.Release(context.WithoutCancel(ctx), id); err != nil {
		log.G(ctx).Warn("release image hold of refused sandbox", log.SandboxID(id), log.Err(err))
	}
}

// prefixField puts prefix before the field an invalid-argument error names
// ("allow[0].cidr" → "network.allow[0].cidr"); other errors pass unchanged.
func prefixField(prefix string, err error) error {
	var fe *errdefs.FieldError
	if !errors.As(err, &fe) {
		return err
	}
	return errdefs.Invalid(prefix+fe.Field, "%s", fe.Msg)
}
