package node

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// MaxForkCount is the most sandboxes one fork makes.
const MaxForkCount = sandboxspec.MaxForkCount

// maxForkStarts bounds the forks of one call started at once.
const maxForkStarts = 8

// ForkRequest asks for Count new sandboxes from sandbox SourceID's state.
type ForkRequest struct {
	SourceID string
	// Count is 1..MaxForkCount.
	Count int
	// RequestID makes the fork idempotent: a retry returns the same forks.
	RequestID string
	// TimeoutSec is the forks' lifetime; 0 is the source's spec's.
	TimeoutSec int64
}

// Forked is one sandbox a fork made.
type Forked struct {
	Sandbox *sandbox
	// MemoryPreserved: the fork resumed the source's memory and processes;
	// otherwise it has the source's files and its init started again.
	MemoryPreserved bool
}

// ForkOutcome is what a fork made.
type ForkOutcome struct {
	Forks []Forked
	// SourceFrozen is how long the source was frozen while the backend
	// copied its state.
	SourceFrozen time.Duration
}

// Fork makes req.Count new running sandboxes on this node from the running
// or paused sandbox req.SourceID, at this instant: each has the source's
// files (and memory, where the backend can), its image, limits, env,
// network policy as it is now (with SetNetwork's changes), labels, task,
// owner and project, its own ID and hostname, and the source as its parent.
//
// It runs the create pipeline (runSteps): hold the image for every fork,
// admit all of them at once (reserve the room of all or refuse; or find
// the fork it repeats), then the backend step — the network of each fork
// (set up while the backend copies), the backend's Fork, the start of
// each. Any failure undoes every fork: none is left half-made. The source
// is frozen only while the backend copies its state, and keeps its state
// (a paused source stays paused). Idempotent on RequestID.
func (n *Node) Fork(ctx context.Context, req ForkRequest) (_ *ForkOutcome, err error) {
	start := time.Now()
	defer func() { n.metrics.forkDone(start, err) }()
	end, err := n.begin("fork sandbox " + req.SourceID)
	if err != nil {
		return nil, err
	}
	defer end()
	if req.Count < 1 || req.Count > MaxForkCount {
		return nil, errdefs.Invalid("count", "is %d; give 1..%d forks", req.Count, MaxForkCount)
	}
	if err := sandboxspec.CheckRequestID("request_id", req.RequestID, sandboxspec.MaxRequestIDLen); err != nil {
		return nil, err
	}
	if req.TimeoutSec < 0 || req.TimeoutSec > sandboxspec.MaxTimeoutSec {
		return nil, errdefs.Invalid("timeout_seconds", "is %d; give 1..%d seconds, or 0 for the source's lifetime", req.TimeoutSec, sandboxspec.MaxTimeoutSec)
	}
	src, err := n.forkSource(ctx, req.SourceID)
	if err != nil {
		return nil, err
	}
	forker, ok := n.cfg.Backends[src.backend].(runtime.Forker)
	if !ok {
		return nil, errdefs.New(errdefs.ErrUnimplemented, "backend %s cannot fork sandboxes", src.backend)
	}
	n.mu.Lock()
	srcRec := src.rec
	n.mu.Unlock()
	sbs := make([]*sandbox, req.Count)
	for i := range sbs {
		spec := cloneSpec(srcRec.Spec)
		if req.TimeoutSec > 0 {
			spec.TimeoutSec = req.TimeoutSec
		}
		id := sandboxid.New(n.cfg.ID)
		rec := n.newRecord(CreateRequest{RequestID: forkRequestID(req.RequestID, i), Owner: srcRec.Owner, Project: srcRec.Project},
			spec, id, sandboxDir(n.cfg.StateDir, id))
		rec.ParentID = srcRec.ID
		sbs[i] = newSandbox(rec, id)
	}
	imgs := make([]runtime.Image, len(sbs))
	var frozen time.Duration
	err = runSteps(ctx, []step{
		{
			name: "hold image",
			do: func(ctx context.Context) error {
				for i, sb := range sbs {
					img, err := n.cfg.Images.Hold(ctx, srcRec.Spec.Image, sb.id)
					if err == nil && srcRec.ImageID != "" && img.Rootfs.ImageID != srcRec.ImageID {
						// The name was re-imported or retagged since: the
						// copied upper layer belongs on the old layers.
						err = errdefs.New(errdefs.ErrFailedPrecondition, "image %s names other content (%s) than sandbox %s was made from (%s) since it was re-imported or retagged; "+
							"fork sandboxes made after the change, or tag the old content under this name again", srcRec.Spec.Image, img.Rootfs.ImageID, srcRec.ID, srcRec.ImageID)
					}
					if err != nil {
						for _, made := range sbs[:i+1] {
							n.releaseHold(ctx, made.id)
						}
						return fmt.Errorf("hold image %s of sandbox %s: %w", srcRec.Spec.Image, srcRec.ID, err)
					}
					imgs[i] = img
					sb.rec.ImageID = img.Rootfs.ImageID // not admitted (visible) yet
				}
				return nil
			},
			undo: func(ctx context.Context) {
				for _, sb := range sbs {
					n.releaseHold(ctx, sb.id)
				}
			},
		},
		{
			name: "admit",
			do:   func(context.Context) error { return n.admitFork(sbs) },
			undo: func(context.Context) {
				for _, sb := range sbs {
					n.forget(sb)
				}
			},
		},
		{
			// doFork undoes what it made when it fails.
			name: "fork and start",
			do: func(ctx context.Context) error {
				var err error
				frozen, err = n.doFork(ctx, forker, src, sbs, imgs)
				return err
			},
		},
	})
	for _, sb := range sbs {
		sb.err = err
		close(sb.ready)
	}
	var rep *repeatedFork
	if errors.As(err, &rep) {
		return n.repeatFork(ctx, srcRec.ID, rep.prev)
	}
	if err != nil {
		return nil, err
	}
	out := &ForkOutcome{SourceFrozen: frozen}
	if n.traj != nil {
		// Each fork's log starts with the source's up to now.
		for _, sb := range sbs {
			if err := n.traj.Fork(srcRec.ID, sb.id, trajectory.Meta{Owner: sb.rec.Owner, Project: sb.rec.Project}); err != nil {
				log.G(ctx).Warn("copy trajectory log to fork", log.SandboxID(sb.id), log.Err(err))
			}
		}
	}
	n.mu.Lock()
	for _, sb := range sbs {
		out.Forks = append(out.Forks, Forked{Sandbox: sb, MemoryPreserved: sb.rec.MemoryPreserved})
	}
	n.mu.Unlock()
	log.G(ctx).Info("sandbox forked", log.SandboxID(srcRec.ID), "count", len(sbs),
		"source_frozen_ms", ms(frozen), "total_ms", ms(time.Since(start)))
	return out, nil
}

// forkRequestID is the request ID of fork i of a fork with request ID rid
// (empty without one).
func forkRequestID(rid string, i int) string {
	if rid == "" {
		return ""
	}
	return rid + "/fork-" + strconv.Itoa(i)
}

// forkSource returns sandbox id if it can be forked: it exists, its create
// finished and its agent started, and it is running or paused.
func (n *Node) forkSource(ctx context.Context, id string) (*sandbox, error) {
	sb, err := n.get(id)
	if errdefs.IsNotFound(err) {
		if dead, ok := n.deadSandbox(id); ok {
			reason, _ := dead.reason.Load().(string)
			return nil, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox_id: sandbox %s failed (%s); only a running or paused sandbox can be forked", id, reason)
		}
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox_id: sandbox %s not found (a stopped sandbox is gone); fork a running or paused sandbox", id)
	}
	if err != nil {
		return nil, err
	}
	select {
	case <-sb.ready:
	case <-ctx.Done():
		return nil, fmt.Errorf("wait for sandbox %s: %w", id, ctx.Err())
	}
	if sb.err != nil {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox_id: sandbox %s not found (its create failed)", id)
	}
	// A freeze while init still starts the agent could catch a task that
	// cannot freeze (see waitStarted).
	if err := waitStarted(ctx, sb); err != nil {
		return nil, err
	}
	n.mu.Lock()
	state := sb.rec.State
	n.mu.Unlock()
	if sb.died.Load() {
		state = "failed"
	}
	if state != stateRunning && state != statePaused {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox_id: sandbox %s is %s; only a running or paused sandbox can be forked", id, state)
	}
	return sb, nil
}

// cloneSpec is a deep copy of s: a fork's spec must not share maps with
// its source's.
func cloneSpec(s specRecord) specRecord {
	s.Env = maps.Clone(s.Env)
	s.Labels = maps.Clone(s.Labels)
	s.BackendOptions = maps.Clone(s.BackendOptions)
	if s.Network != nil {
		nw := *s.Network
		nw.RuleSets = slices.Clone(nw.RuleSets)
		nw.Allow = slices.Clone(nw.Allow)
		s.Network = &nw
	}
	return s
}

// repeatedFork stops a fork pipeline that repeats an admitted fork (the
// same request ID): the caller gets that one's forks.
type repeatedFork struct{ prev []*sandbox }

func (r *repeatedFork) Error() string {
	return fmt.Sprintf("fork repeats the fork that made sandbox %s", r.prev[0].id)
}

// admitFork admits every sandbox of a fork at once: the room for all of
// them is reserved, or none is (a fork is all or nothing). When a fork with
// the same request ID was admitted before, it returns a repeatedFork with
// its sandboxes still known and reserves nothing.
func (n *Node) admitFork(sbs []*sandbox) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	var prev []*sandbox
	for _, sb := range sbs {
		if rid := sb.rec.RequestID; rid != "" {
			if p, ok := n.requests[rid]; ok {
				prev = append(prev, p)
			}
		}
	}
	if len(prev) > 0 {
		return &repeatedFork{prev: prev}
	}
	var cpu float64
	var mem int64
	for _, sb := range sbs {
		if _, ok := n.sandboxes[sb.id]; ok {
			return errdefs.New(errdefs.ErrAlreadyExists, "sandbox %s already exists", sb.id)
		}
		cpu += sb.rec.Spec.CPU
		mem += sb.rec.Spec.MemoryMB
	}
	if err := n.checkRoom(len(sbs), cpu, mem); err != nil {
		return err
	}
	for _, sb := range sbs {
		n.sandboxes[sb.id] = sb
		if rid := sb.rec.RequestID; rid != "" {
			n.requests[rid] = sb
		}
		n.reservedCPU += sb.rec.Spec.CPU
		n.reservedMem += sb.rec.Spec.MemoryMB
	}
	n.usedSeq++
	return nil
}

// repeatFork waits for the forks of the fork a retry repeats and returns
// those that still exist.
func (n *Node) repeatFork(ctx context.Context, sourceID string, prev []*sandbox) (*ForkOutcome, error) {
	out := &ForkOutcome{}
	for _, p := range prev {
		rec, err := n.waitReady(ctx, p)
		if err != nil {
			return nil, err
		}
		if rec.ParentID != sourceID {
			return nil, errdefs.New(errdefs.ErrAlreadyExists, "request_id was used for another create or fork (of sandbox %q); choose a new one", rec.ParentID)
		}
		out.Forks = append(out.Forks, Forked{Sandbox: p, MemoryPreserved: rec.MemoryPreserved})
		out.SourceFrozen = max(out.SourceFrozen, rec.SourceFrozen)
	}
	return out, nil
}

// doFork makes and starts the admitted forks sbs of src; on error every
// one of them is removed again.
func (n *Node) doFork(ctx context.Context, forker runtime.Forker, src *sandbox, sbs []*sandbox, imgs []runtime.Image) (frozen time.Duration, err error) {
	ctx = context.WithoutCancel(ctx) // finish or undo, even if the caller goes away
	rt := n.cfg.Backends[src.backend]
	recs := make([]*record, len(sbs))
	for i, sb := range sbs {
		recs[i] = sb.rec
	}
	netDone := make(chan error, len(sbs))
	netPending := 0
	waitNet := func() error {
		var errs []error
		for ; netPending > 0; netPending-- {
			if err := <-netDone; err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	}
	defer func() {
		if err != nil {
			_ = waitNet() // never tear down a network still being set up
			log.G(ctx).Warn("fork failed, cleaning up its sandboxes", log.SandboxID(src.id), log.Err(err))
			for _, rec := range recs {
				if derr := n.destroy(ctx, rec); derr != nil {
					log.G(ctx).Error("remove sandbox of a failed fork", log.SandboxID(rec.ID), log.Err(derr))
				}
			}
		}
	}()
	for i, rec := range recs {
		if err := checkImageUser(ctx, imgs[i], rec.ID, rec.Spec.User); err != nil {
			return 0, err
		}
	}
	// One table write for all of them: a node killed from here on finds
	// them "creating" and deletes them at its next start.
	if err := n.table.putAll(recs); err != nil {
		return 0, fmt.Errorf("record forks: %w", err)
	}
	specs := make([]runtime.Spec, len(recs))
	for i, rec := range recs {
		var (
			nw          runtime.NetworkAttachment
			nameservers []string
		)
		if n.cfg.Network != nil {
			var rules netpolicy.Rules
			if rec.Spec.Network != nil {
				rules = *rec.Spec.Network
			}
			plan := n.netPlanned(rt, rec.ID)
			nw, nameservers = attachment(plan), []string{plan.DNS.String()}
			netPending++
			go func(id string) {
				got, err := n.netSetup(ctx, rt, id, rules)
				if err == nil && (got.NetNSPath != plan.NetNSPath || got.DNS != plan.DNS) {
					err = errdefs.New(errdefs.ErrInternal, "network of sandbox %s is %s (resolver %s), not the planned %s (%s)",
						id, got.NetNSPath, got.DNS, plan.NetNSPath, plan.DNS)
				}
				if err != nil {
					err = fmt.Errorf("set up network of fork %s: %w", id, err)
				}
				netDone <- err
			}(rec.ID)
		}
		if err := os.MkdirAll(rec.StateDir, 0o700); err != nil {
			return 0, fmt.Errorf("make sandbox dir: %w", err)
		}
		specs[i] = n.backendSpec(rec, imgs[i], nw, nameservers)
	}
	// Pause and resume of the source wait while the backend copies it: the
	// backend freezes it, and leaves it as it found it.
	src.pauseMu.Lock()
	results, err := forker.Fork(ctx, src.id, specs)
	src.pauseMu.Unlock()
	if err != nil {
		return 0, fmt.Errorf("fork sandbox %s: %w", src.id, err)
	}
	if len(results) != len(recs) {
		return 0, errdefs.New(errdefs.ErrInternal, "backend %s made %d forks of sandbox %s, not %d", src.backend, len(results), src.id, len(recs))
	}
	if err := waitNet(); err != nil {
		return 0, err
	}
	for i, r := range results {
		frozen = max(frozen, r.SourceFrozen)
		if r.Handle.ID != recs[i].ID {
			return 0, errdefs.New(errdefs.ErrInternal, "backend %s returned fork %s for %s", src.backend, r.Handle.ID, recs[i].ID)
		}
	}
	// Start every fork (a few at a time); they are watched only once all
	// run, so a failed start removes the others quietly.
	var (
		wg      sync.WaitGroup
		sem     = make(chan struct{}, maxForkStarts)
		startMu sync.Mutex
		errs    []error
	)
	tStart := time.Now()
	for i, sb := range sbs {
		from := *recs[i]
		from.Handle = results[i].Handle
		from.MemoryPreserved = results[i].MemoryPreserved
		from.SourceFrozen = frozen
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			err := n.startRecorded(sb, from, func() error {
				if err := rt.Start(ctx, sb.id); err != nil {
					return fmt.Errorf("start fork %s: %w", sb.id, err)
				}
				return nil
			})
			if err != nil {
				startMu.Lock()
				errs = append(errs, err)
				startMu.Unlock()
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	n.mu.Lock()
	for i, sb := range sbs {
		recs[i] = sb.rec
	}
	n.mu.Unlock()
	tStarted := time.Now()
	for _, sb := range sbs {
		n.watchExit(sb)
		go n.checkAgent(sb, tStarted)
	}
	log.G(ctx).Debug("forks started", log.SandboxID(src.id), "start_ms", ms(tStarted.Sub(tStart)))
	return frozen, nil
}
