package node

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// MaxPrewarmTTL bounds how long a prewarm may hold its sandboxes.
const MaxPrewarmTTL = 24 * time.Hour

// PrewarmRequest asks the warm pool to hold Count prestarted sandboxes of
// Spec's shape for TTL (0: the pool's IdleTTL).
type PrewarmRequest struct {
	Spec  specRecord
	Count int
	TTL   time.Duration
	// Wait returns only once the pool holds what it will hold (or ctx
	// ends: the answer then says how many are ready so far).
	Wait bool
}

// PrewarmResult is what a prewarm will hold.
type PrewarmResult struct {
	// Held is how many prestarted sandboxes the pool holds for the
	// shape (its earlier ones count); fewer than asked when Reason says
	// why.
	Held int
	// Ready is how many of them are prestarted already.
	Ready int
	// Reason says why Held is below the count asked for: the node's
	// capacity or the pool's bound (node.warm_pool.max_sandboxes).
	Reason string
	// TTL is how long the pool holds them unless creates take them.
	TTL time.Duration
}

// Prewarm asks the warm pool to hold req.Count prestarted sandboxes of
// req.Spec's shape for a while: the creates of that shape that follow
// (a batch) each take one instead of starting from scratch. The count is
// bounded by node.warm_pool.max_sandboxes (less what other shapes hold)
// and by what admission could still let run: the node's free sandboxes
// (node.max_sandboxes, counting the pool's), CPU quota and memory. Each
// create of the shape consumes one of the count, whether it found a
// prestarted sandbox or not; once consumed, or after the TTL, the shape
// goes back to the pool's normal size and the extra sandboxes are
// removed. Filling runs in the background, poolPrewarmParallel at a time.
func (n *Node) Prewarm(ctx context.Context, req PrewarmRequest) (PrewarmResult, error) {
	end, err := n.begin("prewarm sandboxes")
	if err != nil {
		return PrewarmResult{}, err
	}
	defer end()
	p := n.pool
	if p == nil {
		return PrewarmResult{}, errdefs.New(errdefs.ErrFailedPrecondition, "node %s has no warm pool (node.warm_pool.size is 0, or its image store cannot name image content); turn it on to prewarm", n.cfg.ID)
	}
	if req.Count < 1 || req.Count > p.cfg.Max {
		return PrewarmResult{}, errdefs.Invalid("count", "%d must be between 1 and %d (node.warm_pool.max_sandboxes of node %s)", req.Count, p.cfg.Max, n.cfg.ID)
	}
	if req.TTL < 0 || req.TTL > MaxPrewarmTTL {
		return PrewarmResult{}, errdefs.Invalid("ttl_seconds", "%d must be between 0 (the pool's idle TTL, %s) and %d", int64(req.TTL/time.Second), p.cfg.IdleTTL, int64(MaxPrewarmTTL/time.Second))
	}
	ttl := req.TTL
	if ttl == 0 {
		ttl = p.cfg.IdleTTL
	}
	spec := req.Spec
	if spec.Snapshot != "" {
		return PrewarmResult{}, errdefs.Invalid("snapshot", "a restore is made from its snapshot, never from the warm pool; leave snapshot unset to prewarm")
	}
	if err := n.normalize(&spec); err != nil {
		return PrewarmResult{}, err
	}
	if _, ok := n.cfg.Backends[spec.Backend].(runtime.Prestarter); !ok {
		return PrewarmResult{}, errdefs.Invalid("backend", "the %s backend cannot prestart sandboxes, so nothing can be prewarmed for it", spec.Backend)
	}
	if len(spec.BackendOptions) > 0 {
		return PrewarmResult{}, errdefs.Invalid("backend_options", "a create with backend options is always made from scratch; leave them unset to prewarm")
	}
	if _, err := p.ids.ImageID(ctx, spec.Image); err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return PrewarmResult{}, errdefs.Invalid("image", "%v", err)
		}
		return PrewarmResult{}, fmt.Errorf("prewarm: image %s: %w", spec.Image, err)
	}
	k, ok := p.key(ctx, spec)
	if !ok {
		return PrewarmResult{}, errdefs.Invalid("env", "more than %d bytes of environment: such a create is made from scratch", poolMaxEnv)
	}

	// What admission could still let run, beside what the pool holds.
	n.mu.Lock()
	freeCount := n.cfg.MaxSandboxes - int64(len(n.sandboxes)+n.tearing)
	freeCPU := n.cpuQuota() - n.reservedCPU
	freeMem := n.memQuota() - n.reservedMem
	n.mu.Unlock()

	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	others := 0
	for sk, s := range p.shapes {
		if sk != k {
			others += len(s.ready) + s.filling
		}
	}
	capacity := freeCount - int64(others)
	what := fmt.Sprintf("node.max_sandboxes %d: %d run, %d prestarted for other shapes", n.cfg.MaxSandboxes, freeCount, others)
	if spec.CPU > 0 {
		if c := int64(math.Floor((freeCPU + 1e-9) / spec.CPU)); c < capacity {
			capacity, what = c, fmt.Sprintf("%g CPU of quota free (node.cpu_overcommit), %g each", max(freeCPU, 0), spec.CPU)
		}
	}
	if spec.MemoryMB > 0 {
		if c := freeMem / spec.MemoryMB; c < capacity {
			capacity, what = c, fmt.Sprintf("%d MiB of memory free (node.memory_overcommit), %d each", max(freeMem, 0), spec.MemoryMB)
		}
	}
	capacity = max(capacity, 0)
	held, reason := req.Count, ""
	if bound := p.cfg.Max - others; held > bound {
		held = max(bound, 0)
		reason = fmt.Sprintf("bound: node.warm_pool.max_sandboxes of node %s is %d and other shapes hold %d", n.cfg.ID, p.cfg.Max, others)
	}
	if int64(held) > capacity {
		held = int(capacity)
		reason = fmt.Sprintf("capacity: node %s has room for %d more sandboxes (%s)", n.cfg.ID, capacity, what)
	}
	s, tracked := p.shapes[k]
	if !tracked {
		if held == 0 {
			return PrewarmResult{Reason: reason, TTL: ttl}, nil
		}
		if len(p.shapes) >= poolShapes {
			p.evictLocked()
		}
		s = &poolShape{spec: shapeSpec(spec)}
		p.shapes[k] = s
	}
	s.lastUsed = now
	s.prewarm, s.prewarmUntil = held, now.Add(ttl)
	s.retryAt = time.Time{}
	ready := min(len(s.ready), held)
	p.nudge()
	res := PrewarmResult{Held: held, Ready: ready, Reason: reason, TTL: ttl}
	if !req.Wait || ready >= held {
		return res, nil
	}
	p.mu.Unlock()
	res.Ready = p.waitReady(ctx, k, s, held)
	p.mu.Lock() // for the deferred unlock
	return res, nil
}

// waitReady waits until shape k (s) holds want prestarted sandboxes, its
// prewarm ended, a prestart of it failed, or ctx ends; it returns how many it holds.
func (p *pool) waitReady(ctx context.Context, k poolKey, s *poolShape, want int) int {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		p.mu.Lock()
		now := time.Now()
		ready, gone, ended, failed := len(s.ready), p.shapes[k] != s, !s.prewarming(now), s.retryAt.After(now)
		p.mu.Unlock()
		if ready >= want || gone || ended || failed {
			return min(ready, want)
		}
		select {
		case <-ctx.Done():
			return min(ready, want)
		case <-p.n.closed:
			return min(ready, want)
		case <-t.C:
		}
	}
}
