package node

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// PoolConfig configures the warm pool: sandboxes prestarted (made but not
// running, see runtime.Prestarter) for the shapes — backend, image, cpu,
// memory, pids limit, user, workdir and network rules — created on the node
// at least twice recently. A create of such a shape takes one and only lets
// it run.
type PoolConfig struct {
	// Size is how many prestarted sandboxes each shape keeps ready; 0
	// turns the pool off.
	Size int
	// Max bounds the prestarted sandboxes of all shapes together.
	Max int
	// IdleTTL: a shape not created for this long loses its sandboxes.
	IdleTTL time.Duration
}

// Pool defaults (node config "warm_pool").
const (
	DefaultPoolSize    = 2
	DefaultPoolMax     = 8
	DefaultPoolIdleTTL = 10 * time.Minute
	// poolShapes bounds the shapes tracked at once (the least recently
	// created goes first).
	poolShapes = 16
	// poolRetry is how long a shape whose prestart failed waits before the
	// next try.
	poolRetry = 30 * time.Second
	// poolMinCreates is how many creates of a shape within IdleTTL make the
	// pool keep sandboxes of it: a shape created once (unique network
	// rules, a one-off size) never costs a prestart nobody takes.
	poolMinCreates = 2
	// poolQuiet: a refill starts once no create took a sandbox for this
	// long (at most poolQuietMax after the kick), so that it does not
	// compete with the answer to the create that emptied the slot.
	poolQuiet    = 50 * time.Millisecond
	poolQuietMax = 250 * time.Millisecond
	// poolTick is how often the pool looks for shapes to refill or expire
	// besides the nudge after every create.
	poolTick = time.Second
)

// imageIDer names an image's content; the pool needs it to tell a name that
// was re-imported from the one its sandboxes were made from.
// internal/image's Store implements it.
type imageIDer interface {
	ImageID(ctx context.Context, name string) (string, error)
}

// poolKey is a shape: everything a prestarted sandbox fixed when it was made.
type poolKey struct {
	Backend, Image, ImageID string
	CPU                     float64
	MemoryMB, PidsLimit     int64
	DiskMB                  int64
	User, Workdir, Rules    string
	// AllowPrivilegeEscalation is fixed at prestart (no_new_privs is set
	// on init before anything runs).
	AllowPrivilegeEscalation bool
	// CPUClass is fixed at prestart (the scheduling policy is set when
	// the sandbox starts).
	CPUClass string
}

type poolShape struct {
	spec     specRecord // a create's spec with the per-sandbox parts cleared
	ready    []*record  // prestarted, oldest first
	filling  int
	lastUsed time.Time
	creates  int       // creates of this shape since it was first seen
	retryAt  time.Time // after a failed prestart
	// prewarm is how many prestarted sandboxes a prewarm still asks the
	// shape to hold (each create of the shape consumes one) until
	// prewarmUntil; the shape is wanted regardless of poolMinCreates.
	prewarm      int
	prewarmUntil time.Time
}

// prewarming reports whether a prewarm still asks s for sandboxes.
func (s *poolShape) prewarming(now time.Time) bool {
	return s.prewarm > 0 && now.Before(s.prewarmUntil)
}

// want is how many prestarted sandboxes s should hold: an active
// prewarm's target, else Size once the shape was created poolMinCreates
// times, else none.
func (p *pool) want(s *poolShape, now time.Time) int {
	w := 0
	if s.creates >= poolMinCreates {
		w = p.cfg.Size
	}
	if s.prewarming(now) {
		w = max(w, s.prewarm)
	}
	return w
}

// pool is the node's warm pool. Its fills and expiries run in one goroutine,
// one sandbox at a time, so that refilling never takes more than one core's
// share from the sandboxes that run.
type pool struct {
	n    *Node
	cfg  PoolConfig
	ids  imageIDer
	kick chan struct{}

	mu       sync.Mutex
	shapes   map[poolKey]*poolShape // guarded by mu
	lastTake time.Time              // guarded by mu
}

func newPool(n *Node, cfg PoolConfig) *pool {
	ids, ok := n.cfg.Images.(imageIDer)
	if cfg.Size <= 0 || !ok {
		return nil
	}
	if cfg.Max <= 0 {
		cfg.Max = DefaultPoolMax
	}
	if cfg.IdleTTL <= 0 {
		cfg.IdleTTL = DefaultPoolIdleTTL
	}
	return &pool{n: n, cfg: cfg, ids: ids, kick: make(chan struct{}, 1), shapes: map[poolKey]*poolShape{}}
}

// poolMaxEnv is the most environment (bytes of K=V) a create from the pool
// may pass: it goes through the sandbox's small run-dir tmpfs. A create
// with more is made from scratch.
const poolMaxEnv = 64 << 10

// key returns spec's shape, or false when its backend cannot prestart or
// the create cannot come from the pool.
func (p *pool) key(ctx context.Context, spec specRecord) (poolKey, bool) {
	if _, ok := p.n.cfg.Backends[spec.Backend].(runtime.Prestarter); !ok {
		return poolKey{}, false
	}
	// Backend options are not part of the shape (yet): such a create is
	// made from scratch rather than from a sandbox prestarted without them.
	if len(spec.BackendOptions) > 0 {
		return poolKey{}, false
	}
	size := 0
	for k, v := range spec.Env {
		size += len(k) + len(v) + 2
	}
	if size > poolMaxEnv {
		return poolKey{}, false
	}
	id, err := p.ids.ImageID(ctx, spec.Image)
	if err != nil {
		return poolKey{}, false // the create reports the image error itself
	}
	k := poolKey{Backend: spec.Backend, Image: spec.Image, ImageID: id, CPU: spec.CPU,
		MemoryMB: spec.MemoryMB, PidsLimit: spec.PidsLimit, DiskMB: spec.DiskMB, User: spec.User, Workdir: spec.Workdir,
		AllowPrivilegeEscalation: spec.AllowPrivilegeEscalation, CPUClass: spec.CPUClass}
	if spec.Network != nil {
		b, err := json.Marshal(spec.Network)
		if err != nil {
			return poolKey{}, false
		}
		k.Rules = string(b)
	}
	return k, true
}

// take notes that a create of shape k happened and returns one of its
// prestarted sandboxes, or nil. A new shape is tracked from here on (the
// least recently used one goes when there are too many).
func (p *pool) take(k poolKey, spec specRecord) *record {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.shapes[k]
	if !ok {
		if len(p.shapes) >= poolShapes {
			p.evictLocked()
		}
		s = &poolShape{spec: shapeSpec(spec)}
		p.shapes[k] = s
	}
	s.lastUsed = time.Now()
	p.lastTake = s.lastUsed
	s.creates++
	if s.prewarm > 0 {
		s.prewarm-- // a prewarm is consumed by the creates it was for
	}
	if s.creates >= poolMinCreates || s.prewarming(s.lastUsed) {
		p.nudge()
	}
	if len(s.ready) == 0 {
		return nil
	}
	rec := s.ready[0]
	s.ready = s.ready[1:]
	return rec
}

// giveBack returns a taken sandbox that was not used (the create was
// refused before it ran).
func (p *pool) giveBack(k poolKey, rec *record) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if s, ok := p.shapes[k]; ok {
		s.ready = append([]*record{rec}, s.ready...)
		if time.Now().Before(s.prewarmUntil) {
			s.prewarm++ // the refused create did not consume the prewarm
		}
		return
	}
	p.orphan(rec)
}

// evictLocked drops one shape and its sandboxes: the least recently used
// of those created only once (nothing prestarted for them), else the least
// recently used.
func (p *pool) evictLocked() {
	var oldest poolKey
	var at time.Time
	once := false
	for k, s := range p.shapes {
		o := s.creates < poolMinCreates && !s.prewarming(time.Now())
		if at.IsZero() || o && !once || o == once && s.lastUsed.Before(at) {
			oldest, at, once = k, s.lastUsed, o
		}
	}
	if s, ok := p.shapes[oldest]; ok {
		for _, rec := range s.ready {
			p.orphan(rec)
		}
		delete(p.shapes, oldest)
	}
}

// orphan destroys an unused prestarted sandbox in the background. Once the
// node shuts down it is left (recorded pooled) for the next start's
// recovery to remove.
func (p *pool) orphan(rec *record) {
	end, err := p.n.begin("remove warm-pool sandbox " + rec.ID)
	if err != nil {
		return
	}
	go func() {
		defer end()
		if err := p.n.destroy(context.WithoutCancel(p.n.life), rec); err != nil {
			slog.Warn("remove unused warm-pool sandbox; the next node start retries", log.SandboxID(rec.ID), log.Err(err))
		}
	}()
}

func (p *pool) nudge() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// shapeSpec is spec without what belongs to one sandbox (env, labels, task,
// timeouts): what a prestarted sandbox is recorded with until taken.
func shapeSpec(s specRecord) specRecord {
	s.Env, s.Labels, s.TaskID = nil, nil, ""
	s.TimeoutSec, s.IdleSec, s.AutoPause, s.OnTimeout = sandboxspec.DefaultTimeoutSec, 0, false, ""
	return s
}

// loop refills and expires shapes until the node closes.
func (p *pool) loop() {
	defer p.n.wg.Done()
	t := time.NewTicker(poolTick)
	defer t.Stop()
	for {
		select {
		case <-p.n.closed:
			return
		case <-p.kick:
			if !p.waitQuiet() {
				return
			}
		case <-t.C:
		}
		p.expire(time.Now())
		if !p.fillAll() {
			return
		}
	}
}

// poolPrewarmParallel bounds the prestarts that run at once while a
// prewarm is being filled; other fills run one at a time.
const poolPrewarmParallel = 4

// fillAll fills shapes until none needs a sandbox (or the node has no
// room); false when the node closes meanwhile. Fills of a shape being
// prewarmed run up to poolPrewarmParallel at once.
func (p *pool) fillAll() bool {
	var wg sync.WaitGroup
	defer wg.Wait()
	sem := make(chan struct{}, poolPrewarmParallel)
	inflight := new(atomic.Int32)
	for {
		select {
		case <-p.n.closed:
			return false
		case sem <- struct{}{}:
		}
		now := time.Now()
		k, s, ok := p.next(now)
		if !ok {
			<-sem
			if inflight.Load() == 0 {
				return true
			}
			wg.Wait() // what is in flight may leave room or change need
			continue
		}
		p.mu.Lock()
		par := s.prewarming(now)
		p.mu.Unlock()
		if !par {
			p.fill(k, s)
			<-sem
			continue
		}
		inflight.Add(1)
		wg.Go(func() {
			defer func() { inflight.Add(-1); <-sem }()
			p.fill(k, s)
		})
	}
}

// waitQuiet waits until no sandbox was taken for poolQuiet, or
// poolQuietMax has passed; false when the node closes meanwhile.
func (p *pool) waitQuiet() bool {
	deadline := time.Now().Add(poolQuietMax)
	for {
		p.mu.Lock()
		wait := time.Until(p.lastTake.Add(poolQuiet))
		p.mu.Unlock()
		if left := time.Until(deadline); wait > left {
			wait = left
		}
		if wait <= 0 {
			return true
		}
		t := time.NewTimer(wait)
		select {
		case <-p.n.closed:
			t.Stop()
			return false
		case <-t.C:
		}
	}
}

// expire drops the shapes nobody created within IdleTTL and those whose
// image name now refers to other content or to nothing (no create can take
// their sandboxes any more, and they hold the old image's layers).
func (p *pool) expire(now time.Time) {
	p.mu.Lock()
	keys := make([]poolKey, 0, len(p.shapes))
	for k := range p.shapes {
		keys = append(keys, k)
	}
	p.mu.Unlock()
	stale := map[poolKey]bool{}
	for _, k := range keys {
		if id, err := p.ids.ImageID(p.n.life, k.Image); err != nil || id != k.ImageID {
			stale[k] = true
		}
	}
	n := p.n
	n.mu.Lock()
	room := n.cfg.MaxSandboxes - int64(len(n.sandboxes)+n.tearing)
	n.mu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	total := 0
	for k, s := range p.shapes {
		if stale[k] || now.Sub(s.lastUsed) > p.cfg.IdleTTL && !s.prewarming(now) {
			for _, rec := range s.ready {
				p.orphan(rec)
			}
			delete(p.shapes, k)
			continue
		}
		if !s.prewarming(now) {
			s.prewarm = 0
		}
		// A prewarm that ended (consumed or past its ttl) leaves the
		// shape its normal size.
		if w := p.want(s, now); len(s.ready) > w {
			for _, rec := range s.ready[w:] {
				p.orphan(rec)
			}
			s.ready = s.ready[:w]
		}
		total += len(s.ready)
	}
	// Creates are admitted without counting prestarted sandboxes; when
	// they and the pool together exceed node.max_sandboxes, the pool
	// gives way (largest shape first) so that it never overcommits.
	for over := int64(total) - max(room, 0); over > 0; over-- {
		var big *poolShape
		for _, s := range p.shapes {
			if len(s.ready) > 0 && (big == nil || len(s.ready) > len(big.ready)) {
				big = s
			}
		}
		if big == nil {
			break
		}
		last := len(big.ready) - 1
		p.orphan(big.ready[last])
		big.ready = big.ready[:last]
		if big.prewarm > last {
			big.prewarm = last
		}
	}
}

// next picks the shape most in need of a prestarted sandbox and counts the
// fill that is about to start; false when none needs one, or when the node
// has no room for another sandbox (what would take it could not be admitted).
func (p *pool) next(now time.Time) (poolKey, *poolShape, bool) {
	n := p.n
	n.mu.Lock()
	count, freeMem := int64(len(n.sandboxes)), n.memQuota()-n.reservedMem
	n.mu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	// owed is what active prewarms still wait for: the room they were
	// promised is not given to other shapes' normal fills.
	total, owed := 0, 0
	for _, s := range p.shapes {
		total += len(s.ready) + s.filling
		if s.prewarming(now) {
			owed += max(s.prewarm-len(s.ready)-s.filling, 0)
		}
	}
	if total >= p.cfg.Max || count+int64(total) >= n.cfg.MaxSandboxes {
		return poolKey{}, nil, false
	}
	keys := make([]poolKey, 0, len(p.shapes))
	for k := range p.shapes {
		keys = append(keys, k)
	}
	// Prewarmed shapes first, then the emptiest shape, then the most
	// recently used.
	sort.Slice(keys, func(i, j int) bool {
		a, b := p.shapes[keys[i]], p.shapes[keys[j]]
		if pa, pb := a.prewarming(now), b.prewarming(now); pa != pb {
			return pa
		}
		if na, nb := len(a.ready)+a.filling, len(b.ready)+b.filling; na != nb {
			return na < nb
		}
		return a.lastUsed.After(b.lastUsed)
	})
	for _, k := range keys {
		s := p.shapes[k]
		if !s.prewarming(now) && (total+owed >= p.cfg.Max || count+int64(total+owed) >= n.cfg.MaxSandboxes) {
			continue
		}
		if len(s.ready)+s.filling < p.want(s, now) && !now.Before(s.retryAt) && s.spec.MemoryMB <= freeMem {
			s.filling++
			return k, s, true
		}
	}
	return poolKey{}, nil, false
}

// fill prestarts one sandbox of shape k (s, as next returned it).
func (p *pool) fill(k poolKey, s *poolShape) {
	rec, err := p.n.prestart(p.n.life, k, s.spec)
	p.n.metrics.prestartDone(err)
	p.mu.Lock()
	defer p.mu.Unlock()
	s.filling--
	// The shape may have been evicted (and even made again) meanwhile.
	ok := p.shapes[k] == s
	switch {
	case err != nil:
		s.retryAt = time.Now().Add(poolRetry)
		if !p.n.shuttingDown(err) {
			slog.Warn("prestart a warm-pool sandbox; retrying this shape later", "image", k.Image, "retry_in", poolRetry, log.Err(err))
		}
	case !ok:
		p.orphan(rec) // the shape expired meanwhile
	default:
		s.ready = append(s.ready, rec)
	}
}

// drainTimeout bounds drain: removing a prestarted sandbox takes tens of
// milliseconds, and what is left is removed at the next start.
const drainTimeout = 10 * time.Second

// drain destroys every prestarted sandbox (node shutdown), within its own
// deadline: the shutdown's may have passed already.
func (p *pool) drain() {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(p.n.life), drainTimeout)
	defer cancel()
	p.mu.Lock()
	var recs []*record
	for k, s := range p.shapes {
		recs = append(recs, s.ready...)
		delete(p.shapes, k)
	}
	p.mu.Unlock()
	var wg sync.WaitGroup
	for _, rec := range recs {
		wg.Go(func() {
			if err := p.n.destroy(ctx, rec); err != nil {
				log.G(ctx).Warn("remove warm-pool sandbox at shutdown; the next start removes it", log.SandboxID(rec.ID), log.Err(err))
			}
		})
	}
	wg.Wait()
}

// prestart makes one sandbox of shape k up to the point where only Launch
// is left, recorded in state pooled. On error nothing is left.
func (n *Node) prestart(ctx context.Context, k poolKey, spec specRecord) (_ *record, err error) {
	id := sandboxid.New(n.cfg.ID)
	end, err := n.begin("prestart sandbox " + id)
	if err != nil {
		return nil, err
	}
	defer end()
	img, err := n.cfg.Images.Hold(ctx, spec.Image, id)
	if err != nil {
		return nil, fmt.Errorf("hold image: %w", err)
	}
	now := time.Now().UTC()
	rec := &record{
		ID:        id,
		Backend:   spec.Backend,
		Spec:      spec,
		State:     statePooled,
		CreatedAt: now,
		ExpiresAt: now.Add(time.Duration(spec.TimeoutSec) * time.Second),
		StateDir:  sandboxDir(n.cfg.StateDir, id),
		ImageID:   img.Rootfs.ImageID,
	}
	h, err := n.prepare(ctx, rec, img, nil, "")
	if err != nil {
		return nil, err
	}
	undo := func() {
		if derr := n.destroy(context.WithoutCancel(ctx), rec); derr != nil {
			log.G(ctx).Warn("undo failed prestart", log.SandboxID(id), log.Err(derr))
		}
	}
	rec.Handle = h
	if cur, err := n.cfg.Images.(imageIDer).ImageID(ctx, spec.Image); err != nil || cur != k.ImageID {
		undo()
		return nil, errdefs.New(errdefs.ErrUnavailable, "image %s changed while a sandbox was prestarted from it", spec.Image)
	}
	if err := n.cfg.Backends[spec.Backend].(runtime.Prestarter).Prestart(ctx, id); err != nil {
		undo()
		return nil, fmt.Errorf("prestart sandbox: %w", err)
	}
	if err := n.table.put(rec); err != nil {
		undo()
		return nil, fmt.Errorf("record prestarted sandbox: %w", err)
	}
	return rec, nil
}
