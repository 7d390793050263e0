package node

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

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
	// Owner and Project are recorded as the sandbox's owner (owner.go).
	Owner, Project string
	// prebuilt, when set, is the sandbox's image instead of Spec.Image
	// from the store: a build sandbox's layers (build.go). Such a sandbox
	// is torn down before Stop returns.
	prebuilt *runtime.Image
}

// Create admits and creates a sandbox (or takes one from the warm pool),
// returning once it runs and its agent's socket listens (requests wait in
// the socket's backlog until the agent serves). It is idempotent on
// RequestID: a retry returns the first sandbox.
//
// Every create runs the same pipeline (runSteps): acquire what the sandbox
// is made from (an image hold, or a warm-pool slot), admit it (admit:
// reserve, register, or find the create it repeats), then the backend step
// — prepare and start, or launch — each step with its undo. Cold and warm
// creates differ only in the first and the last step; restore and fork
// will differ the same way.
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
	if err := sandboxspec.CheckRequestID("request_id", req.RequestID, sandboxspec.MaxNodeRequestIDLen); err != nil {
		return nil, err
	}
	spec := req.Spec
	var restore *snapshotRecord
	if spec.Snapshot != "" {
		if spec, restore, err = n.resolveSnapshot(ctx, spec); err != nil {
			return nil, err
		}
	}
	if err := n.normalize(&spec); err != nil {
		return nil, err
	}
	if restore != nil && restore.Backend != spec.Backend {
		return nil, errdefs.Invalid("backend", "%q cannot restore snapshot %s of the %s backend; leave backend unset", spec.Backend, restore.ID, restore.Backend)
	}
	// A restore is made from its snapshot, never from a prestarted sandbox.
	if n.pool != nil && !req.SkipPool && restore == nil {
		if k, ok := n.pool.key(ctx, spec); ok {
			if slot := n.pool.take(k, spec); slot != nil {
				path = createPathWarm
				rec, err := n.createFromPool(ctx, req, spec, k, slot)
				n.startLogFromSnapshot(ctx, rec, err, spec)
				return rec, err
			}
		}
	}
	sb := newSandbox(n.newRecord(req, spec, req.ID, sandboxDir(n.cfg.StateDir, req.ID)), req.ID)
	sb.syncTeardown = req.prebuilt != nil
	var (
		img      runtime.Image
		holdDur  time.Duration
		keepHold bool // the create repeats one under the same ID: the hold is its
	)
	err = runSteps(ctx, []step{
		{
			name: "hold image",
			do: func(ctx context.Context) error {
				if req.prebuilt != nil {
					img = *req.prebuilt
					return nil
				}
				t := time.Now()
				name := spec.Image
				if restore != nil {
					// A backend snapshot is restored on its source's image.
					name = restore.Spec.Image
				}
				var err error
				img, err = n.cfg.Images.Hold(ctx, name, req.ID)
				holdDur = time.Since(t)
				if errdefs.IsNotFound(err) && spec.Snapshot != "" {
					return errdefs.New(errdefs.ErrNotFound, "snapshot: the image of snapshot %s is gone (%v); the snapshot was deleted", spec.Snapshot, err)
				}
				sb.rec.ImageID = img.Rootfs.ImageID // sb is not admitted (visible) yet
				if errdefs.IsNotFound(err) {
					return errdefs.Invalid("image", "%v", err)
				} else if err != nil {
					return fmt.Errorf("resolve image: %w", err)
				}
				return nil
			},
			undo: func(ctx context.Context) {
				if !keepHold {
					n.releaseHold(ctx, req.ID)
				}
			},
		},
		n.admitStep(sb, req.ID, &keepHold),
		{
			// doCreate undoes what it made when it fails.
			name: "create and start",
			do: func(ctx context.Context) error {
				dir := ""
				if restore != nil {
					dir = restore.Dir
				}
				return n.doCreate(ctx, sb, img, holdDur, dir)
			},
		},
	})
	rec, err := n.finishCreate(ctx, sb, err)
	n.startLogFromSnapshot(ctx, rec, err, spec)
	return rec, err
}

// startLogFromSnapshot starts the trajectory log of a sandbox a create
// made from a snapshot with the snapshot's copy of its source's log (a
// create that repeated an earlier one finds its log there already).
func (n *Node) startLogFromSnapshot(ctx context.Context, rec *record, err error, spec specRecord) {
	if err != nil || rec == nil || spec.Snapshot == "" || n.traj == nil {
		return
	}
	n.mu.Lock()
	_, ok := n.sandboxes[rec.ID]
	n.mu.Unlock()
	if ok {
		n.restoreSnapshotLog(ctx, rec, spec)
	}
}

// createFromPool runs the create pipeline with the prestarted sandbox slot
// of shape k: a refusal gives slot back to the pool. A failed launch fails
// the create (the sandbox is removed): falling back to a cold create under
// the asked ID would race with a caller that gave up and stopped it by
// that ID.
func (n *Node) createFromPool(ctx context.Context, req CreateRequest, spec specRecord, k poolKey, slot *record) (*record, error) {
	rec := n.newRecord(req, spec, slot.ID, slot.StateDir)
	rec.Handle, rec.FromPool, rec.ImageID = slot.Handle, true, slot.ImageID
	sb := newSandbox(rec, req.ID)
	launching := false
	err := runSteps(ctx, []step{
		{
			name: "take warm-pool slot", // taken by the caller
			do:   func(context.Context) error { return nil },
			undo: func(context.Context) {
				if !launching {
					n.pool.giveBack(k, slot)
				}
			},
		},
		n.admitStep(sb, req.ID, nil),
		{
			name: "launch",
			do: func(ctx context.Context) error {
				launching = true
				err := n.launch(ctx, sb)
				if err == nil {
					return nil
				}
				if derr := n.destroy(context.WithoutCancel(ctx), rec); derr != nil {
					log.G(ctx).Warn("remove warm-pool sandbox that failed to launch", log.SandboxID(rec.ID), log.Err(derr))
				}
				return errdefs.New(errdefs.ErrUnavailable, "%w; retry the create (with skip_warm_pool to make one from scratch)", err)
			},
		},
	})
	return n.finishCreate(ctx, sb, err)
}

// newRecord is the record of a new sandbox id for req, in state creating.
func (n *Node) newRecord(req CreateRequest, spec specRecord, id, stateDir string) *record {
	now := time.Now().UTC()
	return &record{
		ID:        id,
		RequestID: req.RequestID,
		Backend:   spec.Backend,
		Spec:      spec,
		State:     stateCreating,
		CreatedAt: now,
		ExpiresAt: now.Add(time.Duration(spec.TimeoutSec) * time.Second),
		StateDir:  stateDir,
		Owner:     req.Owner,
		Project:   req.Project,
	}
}

// newSandbox is the in-memory view of a record being created; askedID is
// the ID the create asked for (an alias when it differs from rec.ID).
func newSandbox(rec *record, askedID string) *sandbox {
	sb := &sandbox{rec: rec, id: rec.ID, backend: rec.Backend, ready: make(chan struct{}), started: make(chan struct{})}
	if askedID != rec.ID {
		sb.alias = askedID
	}
	sb.touch()
	return sb
}

// admitStep is the pipeline's admission: admit sb, or find the create it
// repeats (then the pipeline stops and finishCreate waits for that one).
// keepHold, when set, says the repeated create has sb's ID (its image hold
// is the same one). Its undo releases the reservation.
func (n *Node) admitStep(sb *sandbox, askedID string, keepHold *bool) step {
	return step{
		name: "admit",
		do: func(context.Context) error {
			prev, err := n.admit(sb, askedID)
			if err != nil {
				return err
			}
			if prev != nil {
				if keepHold != nil {
					*keepHold = prev.id == sb.id
				}
				return &repeatedCreate{prev: prev}
			}
			return nil
		},
		undo: func(context.Context) { n.forget(sb) },
	}
}

// finishCreate publishes the create's outcome to anyone waiting on sb (a
// retry with its request ID) and returns it; a create that repeated an
// earlier one returns that one's.
func (n *Node) finishCreate(ctx context.Context, sb *sandbox, err error) (*record, error) {
	sb.err = err
	close(sb.ready)
	var rep *repeatedCreate
	if errors.As(err, &rep) {
		return n.waitReady(ctx, rep.prev)
	}
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return sb.rec, nil
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
// restoreDir, when set, is a backend snapshot the sandbox is restored from.
func (n *Node) doCreate(ctx context.Context, sb *sandbox, img runtime.Image, holdDur time.Duration, restoreDir string) (err error) {
	rec := sb.rec
	l := log.G(ctx).With(log.SandboxID(rec.ID))
	rt := n.cfg.Backends[rec.Backend]
	// The create must finish or be undone even if the caller goes away.
	ctx = context.WithoutCancel(ctx)
	t0 := time.Now()
	var phases prepPhases
	h, err := n.prepare(ctx, rec, img, &phases, restoreDir)
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
func (n *Node) startRecorded(sb *sandbox, from record, start func() error) error {
	rec, err := transition(&from, stateRunning)
	if err != nil {
		return err
	}
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
// included. With restoreDir the backend restores the sandbox from the
// snapshot there (runtime.Snapshotter) instead of creating it.
func (n *Node) prepare(ctx context.Context, rec *record, img runtime.Image, phases *prepPhases, restoreDir string) (_ runtime.Handle, err error) {
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
	if err := checkImageUser(ctx, img, rec.ID, rec.Spec.User); err != nil {
		return runtime.Handle{}, err
	}
	if err := n.table.put(rec); err != nil {
		return runtime.Handle{}, fmt.Errorf("record sandbox: %w", err)
	}
	if n.cfg.Network != nil {
		var rules netpolicy.Rules
		if rec.Spec.Network != nil {
			rules = *rec.Spec.Network
		}
		plan := n.netPlanned(rt, rec.ID)
		netAttach, nameservers = attachment(plan), []string{plan.DNS.String()}
		netDone = make(chan error, 1)
		go func() {
			tNet := time.Now()
			nw, err := n.netSetup(ctx, rt, rec.ID, rules)
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
	var h runtime.Handle
	if restoreDir != "" {
		s, ok := rt.(runtime.Snapshotter)
		if !ok {
			return runtime.Handle{}, errdefs.New(errdefs.ErrInternal, "the %s backend cannot restore snapshots", rec.Backend)
		}
		h, err = s.Restore(ctx, n.backendSpec(rec, img, netAttach, nameservers), restoreDir)
	} else {
		h, err = rt.Create(ctx, n.backendSpec(rec, img, netAttach, nameservers))
	}
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
			DiskMB:    rec.Spec.DiskMB,
		},
		Guest:    g,
		Network:  nw,
		StateDir: rec.StateDir,
		Labels:   rec.Spec.Labels,
		Options:  rec.Spec.BackendOptions,

		AllowPrivilegeEscalation: rec.Spec.AllowPrivilegeEscalation,
		CPUClass:                 runtime.CPUClass(rec.Spec.CPUClass),
	}
}

// attachment is the backend's view of a sandbox network the node made:
// the guest side, which is the same in every sandbox and known before
// Setup (Planned).
func attachment(nw netpolicy.Network) runtime.NetworkAttachment {
	mode := runtime.NetworkVeth
	if nw.Mode == netpolicy.ModeTap {
		mode = runtime.NetworkTap
	}
	return runtime.NetworkAttachment{Mode: mode, NetNS: nw.NetNSPath, Device: nw.GuestIf,
		GuestAddr: nw.GuestAddr, Gateway: nw.GuestGateway, MAC: nw.GuestMAC}
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

// releaseHold drops the image hold of a sandbox that was refused before it
// was made. (A sandbox that exists keeps its hold: its holder is its ID.)
func (n *Node) releaseHold(ctx context.Context, id string) {
	if err := n.cfg.Images.Release(context.WithoutCancel(ctx), id); err != nil {
		log.G(ctx).Warn("release image hold of refused sandbox", log.SandboxID(id), log.Err(err))
	}
}
