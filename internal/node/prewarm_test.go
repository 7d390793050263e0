package node

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

func newPrewarmNode(t *testing.T, mutate ...func(*Config)) *fakeNode {
	t.Helper()
	return newFakeNode(t, append([]func(*Config){func(c *Config) {
		c.Pool = PoolConfig{Size: 1, Max: 64, IdleTTL: time.Minute}
		c.MemoryMB = 65536
		c.MaxSandboxes = 200
	}}, mutate...)...)
}

var smallShape = specRecord{Image: "root/busybox", CPU: 0.1, MemoryMB: 128}

func shapeOf(t *testing.T, f *fakeNode, s specRecord) *poolShape {
	t.Helper()
	if err := f.normalize(&s); err != nil {
		t.Fatal(err)
	}
	k, ok := f.pool.key(t.Context(), s)
	if !ok {
		t.Fatal("no pool shape")
	}
	f.pool.mu.Lock()
	defer f.pool.mu.Unlock()
	return f.pool.shapes[k]
}

// TestPrewarmServesBatch: prewarm N holds N prestarted sandboxes of the
// shape (which had never been created); a batch of N creates of the shape
// all come from the pool; the prewarm is then consumed and the shape back
// to its normal size.
func TestPrewarmServesBatch(t *testing.T) {
	f := newPrewarmNode(t)
	const n = 24
	res, err := f.Prewarm(t.Context(), PrewarmRequest{Spec: smallShape, Count: n, Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Held != n || res.Ready != n || res.Reason != "" || res.TTL != time.Minute {
		t.Fatalf("prewarm %d: %+v", n, res)
	}
	if got := poolReady(f.Node); got != n {
		t.Fatalf("pool holds %d prestarted sandboxes, want %d", got, n)
	}
	if got := f.rt.Calls(runtimefake.OpPrestart); got != n {
		t.Fatalf("%d prestarts, want %d", got, n)
	}
	// A different shape is not served from them.
	other := smallShape
	other.MemoryMB = 256
	if rec := f.create(t, other); rec.FromPool {
		t.Fatal("a create of another shape came from the prewarmed pool")
	}
	var wg sync.WaitGroup
	recs := make([]*record, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			s := smallShape
			s.Env = map[string]string{"I": "x"}
			recs[i], errs[i] = f.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: s})
		})
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("create %d: %v", i, errs[i])
		}
		if !recs[i].FromPool {
			t.Fatalf("create %d of the prewarmed shape was made from scratch", i)
		}
	}
	s := shapeOf(t, f, smallShape)
	f.pool.mu.Lock()
	left := s.prewarm
	f.pool.mu.Unlock()
	if left != 0 {
		t.Fatalf("prewarm left %d after %d creates, want it consumed", left, n)
	}
	// Back to normal sizing: Size (1) once created poolMinCreates times.
	f.pool.expire(time.Now())
	waitPoolReady(t, f.Node, 1)
	time.Sleep(3 * poolTick)
	if got := poolReady(f.Node); got > f.cfg.Pool.Size+1 { // +1: the other shape's one, if any
		t.Fatalf("pool holds %d after the prewarm was consumed, want the normal size", got)
	}
}

// TestPrewarmCreatesWhileFilling: creates of a shape being prewarmed take
// what is ready and are made from scratch otherwise; all succeed.
func TestPrewarmCreatesWhileFilling(t *testing.T) {
	f := newPrewarmNode(t)
	f.rt.Hook(runtimefake.OpPrestart, func(ctx context.Context, _ string) error {
		time.Sleep(5 * time.Millisecond)
		return nil
	})
	const n = 30
	res, err := f.Prewarm(t.Context(), PrewarmRequest{Spec: smallShape, Count: n})
	if err != nil || res.Held != n {
		t.Fatalf("prewarm: %+v %v", res, err)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			time.Sleep(time.Duration(i) * 2 * time.Millisecond)
			_, errs[i] = f.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: smallShape})
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("create %d while the pool fills: %v", i, err)
		}
	}
	if _, _, c := f.Usage(); c != n {
		t.Fatalf("%d sandboxes run, want %d", c, n)
	}
}

// TestPrewarmCapacity: a prewarm holds no more than admission could let
// run (node.max_sandboxes less the running ones), saying why; nor more
// than the pool's bound less other shapes' sandboxes.
func TestPrewarmCapacity(t *testing.T) {
	f := newPrewarmNode(t, func(c *Config) { c.MaxSandboxes = 10 })
	for range 4 {
		f.create(t, specRecord{Image: "root/busybox", MemoryMB: 64})
	}
	waitPoolReady(t, f.Node, 1) // the pool keeps one of that shape
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	res, err := f.Prewarm(ctx, PrewarmRequest{Spec: smallShape, Count: 10, Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Held != 5 || res.Ready != 5 || !strings.HasPrefix(res.Reason, "capacity: node t001 has room for 5 more sandboxes") {
		t.Fatalf("prewarm 10 with 4 of 10 running and 1 pooled: %+v", res)
	}
	time.Sleep(3 * poolTick / 2)
	if got := poolReady(f.Node); got > 6 {
		t.Fatalf("pool holds %d, more than the 6 admission could run", got)
	}
	// Every prestarted one can be admitted when taken.
	for range 6 {
		f.create(t, smallShape)
	}
	if _, err := f.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: smallShape}); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("create past node.max_sandboxes: %v", err)
	}

	// Memory: 1024 MiB of 4096 free per sandbox.
	g := newPrewarmNode(t, func(c *Config) { c.MemoryMB = 4096 })
	big := specRecord{Image: "root/busybox", MemoryMB: 1024}
	res, err = g.Prewarm(t.Context(), PrewarmRequest{Spec: big, Count: 8})
	if err != nil || res.Held != 4 || !strings.Contains(res.Reason, "MiB of memory free") {
		t.Fatalf("prewarm 8 × 1024 MiB on 4096 MiB: %+v %v", res, err)
	}

	// The pool's bound, shared with other shapes.
	h := newPrewarmNode(t, func(c *Config) { c.Pool.Max = 8 })
	if res, err := h.Prewarm(t.Context(), PrewarmRequest{Spec: smallShape, Count: 5, Wait: true}); err != nil || res.Held != 5 {
		t.Fatalf("prewarm 5: %+v %v", res, err)
	}
	other := smallShape
	other.MemoryMB = 256
	res, err = h.Prewarm(t.Context(), PrewarmRequest{Spec: other, Count: 8})
	if err != nil || res.Held != 3 || !strings.HasPrefix(res.Reason, "bound: node.warm_pool.max_sandboxes") {
		t.Fatalf("prewarm 8 with 5 of 8 held by another shape: %+v %v", res, err)
	}
}

// TestPrewarmBadInput: count 0 or above the pool's bound, a bad ttl and a
// spec the node cannot run are refused naming the field; nothing is
// prestarted.
func TestPrewarmBadInput(t *testing.T) {
	f := newPrewarmNode(t)
	for _, c := range []struct {
		req   PrewarmRequest
		field string
	}{
		{PrewarmRequest{Spec: smallShape, Count: 0}, "count"},
		{PrewarmRequest{Spec: smallShape, Count: 65}, "count"},
		{PrewarmRequest{Spec: smallShape, Count: 1, TTL: -time.Second}, "ttl_seconds"},
		{PrewarmRequest{Spec: specRecord{Image: "root/busybox", MemoryMB: 1 << 30}, Count: 1}, "memory_mb"},
		{PrewarmRequest{Spec: specRecord{Image: "root/busybox", Backend: "nope"}, Count: 1}, "backend"},
	} {
		_, err := f.Prewarm(t.Context(), c.req)
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), c.field+": ") {
			t.Errorf("prewarm %+v: %v; want invalid %s", c.req, err, c.field)
		}
	}
	time.Sleep(2 * poolTick)
	if got := f.rt.Calls(runtimefake.OpPrestart); got != 0 {
		t.Fatalf("%d prestarts after refused prewarms", got)
	}
}

// TestPrewarmTTL: after its ttl the prewarm's sandboxes go (the shape was
// never created).
func TestPrewarmTTL(t *testing.T) {
	f := newPrewarmNode(t)
	res, err := f.Prewarm(t.Context(), PrewarmRequest{Spec: smallShape, Count: 3, TTL: 300 * time.Millisecond, Wait: true})
	if err != nil || res.Ready != 3 {
		t.Fatalf("prewarm: %+v %v", res, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for poolReady(f.Node) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("pool holds %d after the prewarm's ttl", poolReady(f.Node))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPrewarmGivesWay: prestarted sandboxes never hold back a create of
// another shape (admission does not count them), and when running and
// pooled sandboxes together exceed node.max_sandboxes the pool removes
// the extra ones, so that the node is never overcommitted.
func TestPrewarmGivesWay(t *testing.T) {
	f := newPrewarmNode(t, func(c *Config) { c.MaxSandboxes = 10 })
	if res, err := f.Prewarm(t.Context(), PrewarmRequest{Spec: smallShape, Count: 8, Wait: true}); err != nil || res.Ready != 8 {
		t.Fatalf("prewarm 8: %+v %v", res, err)
	}
	other := specRecord{Image: "root/busybox", MemoryMB: 64}
	for i := range 5 {
		if _, err := f.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: other}); err != nil {
			t.Fatalf("create %d of another shape with 8 prewarmed on a node of 10: %v", i, err)
		}
	}
	f.pool.expire(time.Now())
	if got := poolReady(f.Node); got > 5 {
		t.Fatalf("pool holds %d with 5 of 10 running, want at most 5", got)
	}
	// What is left still serves the prewarmed shape.
	if rec := f.create(t, smallShape); !rec.FromPool {
		t.Fatal("a create of the prewarmed shape was made from scratch")
	}
}
