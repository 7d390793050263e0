package node

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// forkState is what a fork must leave as it found when it fails.
type forkState struct {
	sandboxes, holds, dirs, records int
	cpu                             float64
	mem                             int64
}

func (f *fakeNode) forkState(t *testing.T) forkState {
	t.Helper()
	cpu, mem, c := f.Usage()
	ents, _ := os.ReadDir(filepath.Join(f.cfg.StateDir, "sandboxes"))
	recs, err := f.table.all()
	if err != nil {
		t.Fatal(err)
	}
	return forkState{sandboxes: c, holds: f.cfg.Images.(images).held(), dirs: len(ents), records: len(recs), cpu: cpu, mem: mem}
}

// TestForkCopiesTheSource: every fork is a new running sandbox with its own
// ID, the source's files at the fork, its spec (image, limits, env, labels,
// task), owner and project, and the source as parent; files written after
// the fork stay in their own sandbox.
func TestForkCopiesTheSource(t *testing.T) {
	f := newFakeNode(t)
	ctx := t.Context()
	src := f.create(t, specRecord{CPU: 0.5, MemoryMB: 256, TimeoutSec: 900, Env: map[string]string{"A": "1"},
		Labels: map[string]string{"run": "r1"}, TaskID: "task-7"})
	// The fake records the owner the node passes; set one on the record
	// as a create by alice would.
	f.mu.Lock()
	r := *f.sandboxes[src.ID].rec
	r.Owner, r.Project = "alice", "p1"
	f.sandboxes[src.ID].rec = &r
	f.mu.Unlock()
	if err := runtimetest.WriteFile(ctx, f.rt, src.ID, "/work/a.txt", []byte("before")); err != nil {
		t.Fatal(err)
	}
	out, err := f.Fork(ctx, ForkRequest{SourceID: src.ID, Count: 3})
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	if len(out.Forks) != 3 {
		t.Fatalf("%d forks, want 3", len(out.Forks))
	}
	ids := map[string]bool{src.ID: true}
	for _, fk := range out.Forks {
		f.mu.Lock()
		rec := fk.Sandbox.rec
		f.mu.Unlock()
		if ids[rec.ID] {
			t.Fatalf("fork ID %s repeats", rec.ID)
		}
		ids[rec.ID] = true
		if rec.ID[:4] != "t001" || rec.State != stateRunning || rec.ParentID != src.ID {
			t.Errorf("fork %s: state %s, parent %q; want a t001 ID, running, parent %s", rec.ID, rec.State, rec.ParentID, src.ID)
		}
		if rec.Spec.Image != src.Spec.Image || rec.Spec.CPU != 0.5 || rec.Spec.MemoryMB != 256 || rec.Spec.TimeoutSec != 900 ||
			!maps.Equal(rec.Spec.Env, src.Spec.Env) || !maps.Equal(rec.Spec.Labels, src.Spec.Labels) || rec.Spec.TaskID != "task-7" {
			t.Errorf("fork spec %+v; want the source's %+v", rec.Spec, src.Spec)
		}
		if rec.Owner != "alice" || rec.Project != "p1" {
			t.Errorf("fork owner %q/%q, want alice/p1", rec.Owner, rec.Project)
		}
		if !fk.MemoryPreserved { // the fake forks its "memory" (env)
			t.Errorf("fork %s: memory_preserved false; the fake backend says true", rec.ID)
		}
		if b, err := runtimetest.ReadFile(ctx, f.rt, rec.ID, "/work/a.txt"); err != nil || string(b) != "before" {
			t.Errorf("fork %s reads %q, %v; want the source's file", rec.ID, b, err)
		}
		if st, err := f.rt.Status(ctx, rec.ID); err != nil || st.State != runtime.StateRunning {
			t.Errorf("backend state of fork %s: %v %v", rec.ID, st.State, err)
		}
	}
	// The forks' maps are their own.
	out.Forks[0].Sandbox.rec.Spec.Labels["run"] = "changed"
	if src.Spec.Labels["run"] != "r1" {
		t.Fatal("a fork shares its labels map with its source")
	}
	first := out.Forks[0].Sandbox.id
	if err := runtimetest.WriteFile(ctx, f.rt, first, "/work/a.txt", []byte("fork0")); err != nil {
		t.Fatal(err)
	}
	for id := range ids {
		want := "before"
		if id == first {
			want = "fork0"
		}
		if b, err := runtimetest.ReadFile(ctx, f.rt, id, "/work/a.txt"); err != nil || string(b) != want {
			t.Errorf("%s reads %q, %v; want %q", id, b, err, want)
		}
	}
	if _, mem, c := f.Usage(); c != 4 || mem != 4*256 {
		t.Errorf("usage after fork: %d sandboxes, %d MiB; want 4, 1024", c, mem)
	}
	if v := promtest.ToFloat64(f.metrics.forks.WithLabelValues("ok")); v != 1 {
		t.Errorf("opendsec_node_forks_total{result=ok} = %v, want 1", v)
	}
	if c := promtest.CollectAndCount(f.metrics.forkDuration); c != 1 {
		t.Errorf("fork duration histogram: %d series", c)
	}
	// Forks stop like any sandbox, and leave nothing.
	for id := range ids {
		if err := f.Stop(ctx, id, "test"); err != nil {
			t.Fatal(err)
		}
	}
	if st := f.forkState(t); st != (forkState{}) {
		t.Fatalf("after stopping all: %+v", st)
	}
}

// TestForkOfPausedSourceKeepsItPaused: a paused source can be forked; its
// forks run and it stays paused.
func TestForkOfPausedSourceKeepsItPaused(t *testing.T) {
	f := newFakeNode(t)
	ctx := t.Context()
	src := f.create(t, specRecord{})
	if _, err := f.Pause(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	out, err := f.Fork(ctx, ForkRequest{SourceID: src.ID, Count: 2, TimeoutSec: 120})
	if err != nil {
		t.Fatalf("fork of a paused sandbox: %v", err)
	}
	for _, fk := range out.Forks {
		if st, _ := f.rt.Status(ctx, fk.Sandbox.id); st.State != runtime.StateRunning {
			t.Errorf("fork %s is %s, want running", fk.Sandbox.id, st.State)
		}
		if fk.Sandbox.rec.Spec.TimeoutSec != 120 {
			t.Errorf("fork timeout %d, want the asked 120", fk.Sandbox.rec.Spec.TimeoutSec)
		}
	}
	if st, _ := f.rt.Status(ctx, src.ID); st.State != runtime.StatePaused {
		t.Errorf("source is %s after the fork, want still paused", st.State)
	}
	if rec, _, _ := f.Get(ctx, src.ID); rec.State != statePaused {
		t.Errorf("source record %s, want paused", rec.State)
	}
}

// TestForkBadInputChangesNothing: a count out of 1..64, a bad request_id or
// timeout, an unknown or stopped source each fail naming the field, and
// leave the node as it was.
func TestForkBadInputChangesNothing(t *testing.T) {
	f := newFakeNode(t)
	ctx := t.Context()
	src := f.create(t, specRecord{})
	gone := f.create(t, specRecord{})
	if err := f.Stop(ctx, gone.ID, "test"); err != nil {
		t.Fatal(err)
	}
	before := f.forkState(t)
	for _, c := range []struct {
		name  string
		req   ForkRequest
		field string // an invalid_argument naming it; else check
		check func(error) bool
	}{
		{"count 0", ForkRequest{SourceID: src.ID, Count: 0}, "count", nil},
		{"count 65", ForkRequest{SourceID: src.ID, Count: 65}, "count", nil},
		{"count -1", ForkRequest{SourceID: src.ID, Count: -1}, "count", nil},
		{"timeout", ForkRequest{SourceID: src.ID, Count: 1, TimeoutSec: -5}, "timeout_seconds", nil},
		{"request id", ForkRequest{SourceID: src.ID, Count: 1, RequestID: string(make([]byte, 300))}, "request_id", nil},
		{"unknown", ForkRequest{SourceID: "t001aaaaaaaaaaaaaaaa", Count: 1}, "", errdefs.IsNotFound},
		{"stopped", ForkRequest{SourceID: gone.ID, Count: 1}, "", errdefs.IsNotFound},
	} {
		_, err := f.Fork(ctx, c.req)
		switch {
		case c.field != "":
			wantFieldErr(t, c.name, err, c.field, "")
		case !c.check(err):
			t.Errorf("%s: %v", c.name, err)
		}
		if c.field == "" && err != nil && !containsAll(err.Error(), "sandbox_id", c.req.SourceID) {
			t.Errorf("%s: %q does not name sandbox_id and the ID", c.name, err)
		}
		if st := f.forkState(t); st != before {
			t.Errorf("%s changed the node: %+v, was %+v", c.name, st, before)
		}
	}
	if v := promtest.ToFloat64(f.metrics.forks.WithLabelValues("error")); v != 7 {
		t.Errorf("opendsec_node_forks_total{result=error} = %v, want 7", v)
	}
}

// TestForkIsAllOrNothing: a fork that does not fit, or whose backend fork
// or any start fails, leaves no fork behind (no record, reservation, hold,
// dir or backend sandbox) and the source running.
func TestForkIsAllOrNothing(t *testing.T) {
	f := newFakeNode(t, func(c *Config) { c.MemoryMB = 1024 })
	ctx := t.Context()
	src := f.create(t, specRecord{MemoryMB: 256})
	before := f.forkState(t)
	// 4 × 256 MiB do not fit in the 768 MiB left; 3 would.
	if _, err := f.Fork(ctx, ForkRequest{SourceID: src.ID, Count: 4}); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("fork over capacity: %v, want resource_exhausted", err)
	}
	if st := f.forkState(t); st != before {
		t.Fatalf("refused fork changed the node: %+v, was %+v", st, before)
	}
	f.rt.Hook(runtimefake.OpFork, func(context.Context, string) error { return errors.New("copy failed") })
	if _, err := f.Fork(ctx, ForkRequest{SourceID: src.ID, Count: 3}); err == nil {
		t.Fatal("fork with a failing backend fork succeeded")
	}
	if st := f.forkState(t); st != before {
		t.Fatalf("failed backend fork changed the node: %+v, was %+v", st, before)
	}
	f.rt.Hook(runtimefake.OpFork, nil)
	var (
		mu      sync.Mutex
		started []string
		n       atomic.Int32
	)
	f.rt.Hook(runtimefake.OpStart, func(_ context.Context, id string) error {
		mu.Lock()
		started = append(started, id)
		mu.Unlock()
		if n.Add(1) == 2 {
			return errors.New("start failed")
		}
		return nil
	})
	if _, err := f.Fork(ctx, ForkRequest{SourceID: src.ID, Count: 3, RequestID: "r-fail"}); err == nil {
		t.Fatal("fork with a failing start succeeded")
	}
	if st := f.forkState(t); st != before {
		t.Fatalf("fork with a failed start changed the node: %+v, was %+v", st, before)
	}
	if len(started) != 3 {
		t.Fatalf("%d starts, want 3", len(started))
	}
	for _, id := range started {
		if _, err := f.rt.Status(ctx, id); !errdefs.IsNotFound(err) {
			t.Errorf("fork %s of the failed fork is still in the backend: %v", id, err)
		}
	}
	f.rt.Hook(runtimefake.OpStart, nil)
	if st, _ := f.rt.Status(ctx, src.ID); st.State != runtime.StateRunning {
		t.Fatalf("source %s after failed forks", st.State)
	}
	// The request ID of a failed fork is free again.
	if out, err := f.Fork(ctx, ForkRequest{SourceID: src.ID, Count: 3, RequestID: "r-fail"}); err != nil || len(out.Forks) != 3 {
		t.Fatalf("fork after the failures: %v", err)
	}
}

// TestForkIdempotent: a retry with the same request_id, sequential or
// concurrent, returns the same forks and makes no more; the same request_id
// for another source is refused.
func TestForkIdempotent(t *testing.T) {
	f := newFakeNode(t)
	ctx := t.Context()
	src := f.create(t, specRecord{})
	other := f.create(t, specRecord{})
	ids := func(o *ForkOutcome) []string {
		var out []string
		for _, fk := range o.Forks {
			out = append(out, fk.Sandbox.id)
		}
		slices.Sort(out)
		return out
	}
	const k = 6
	outs := make([]*ForkOutcome, k)
	errs := make([]error, k)
	var wg sync.WaitGroup
	for i := range k {
		wg.Go(func() { outs[i], errs[i] = f.Fork(ctx, ForkRequest{SourceID: src.ID, Count: 4, RequestID: "req-1"}) })
	}
	wg.Wait()
	for i := range k {
		if errs[i] != nil {
			t.Fatalf("fork %d: %v", i, errs[i])
		}
		if !slices.Equal(ids(outs[i]), ids(outs[0])) || len(outs[i].Forks) != 4 {
			t.Fatalf("fork %d returned %v, fork 0 %v", i, ids(outs[i]), ids(outs[0]))
		}
	}
	again, err := f.Fork(ctx, ForkRequest{SourceID: src.ID, Count: 4, RequestID: "req-1"})
	if err != nil || !slices.Equal(ids(again), ids(outs[0])) {
		t.Fatalf("retry: %v %v", ids(again), err)
	}
	if _, _, c := f.Usage(); c != 2+4 {
		t.Fatalf("%d sandboxes after %d forks with one request_id, want 6", c, k+1)
	}
	if _, err := f.Fork(ctx, ForkRequest{SourceID: other.ID, Count: 1, RequestID: "req-1"}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("request_id reused for another source: %v, want already_exists", err)
	}
}

// TestForkService: the RPC refuses a target node other than this one,
// answers not_found for another principal's sandbox, and maps the result.
func TestForkService(t *testing.T) {
	f := newFakeNode(t)
	s := &service{n: f.Node}
	alice := auth.WithClaims(context.Background(), auth.Claims{Subject: "alice", Scope: auth.ScopeUser})
	bob := auth.WithClaims(context.Background(), auth.Claims{Subject: "bob", Scope: auth.ScopeUser})
	rec, err := f.Create(alice, CreateRequest{ID: sandboxid.New("t001"), Spec: specRecord{Image: "root/busybox"}, Owner: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	fork := func(ctx context.Context, m *nodev1.ForkSandboxRequest) (*nodev1.ForkSandboxResponse, error) {
		resp, err := s.ForkSandbox(ctx, connect.NewRequest(m))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	before := f.forkState(t)
	if _, err := fork(alice, &nodev1.ForkSandboxRequest{SandboxId: rec.ID, Count: 1, TargetNode: "t002"}); !errors.Is(err, errdefs.ErrUnimplemented) || !strings.Contains(err.Error(), "target_node") {
		t.Errorf("fork to another node: %v, want unimplemented naming target_node", err)
	}
	if _, err := fork(bob, &nodev1.ForkSandboxRequest{SandboxId: rec.ID, Count: 1}); !errdefs.IsNotFound(err) {
		t.Errorf("bob forks alice's sandbox: %v, want not_found", err)
	}
	if st := f.forkState(t); st != before {
		t.Fatalf("refused forks changed the node: %+v, was %+v", st, before)
	}
	resp, err := fork(alice, &nodev1.ForkSandboxRequest{SandboxId: rec.ID, Count: 2, TargetNode: "t001"})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetForks()) != 2 {
		t.Fatalf("%d forks", len(resp.GetForks()))
	}
	for _, fk := range resp.GetForks() {
		sb := fk.GetSandbox()
		if sb.GetParentId() != rec.ID || sb.GetOwner() != "alice" || sb.GetState() != nodev1.SandboxState_SANDBOX_STATE_RUNNING || !fk.GetMemoryPreserved() {
			t.Errorf("fork %+v", fk)
		}
		// Alice owns her forks.
		if _, err := s.GetSandbox(alice, connect.NewRequest(&nodev1.GetSandboxRequest{SandboxId: sb.GetId()})); err != nil {
			t.Errorf("alice gets her fork: %v", err)
		}
	}
}

// TestForksSurviveARestart: a restarted node recovers forks with their
// parent and memory_preserved, and a retry of the fork (same request_id)
// returns them instead of making more.
func TestForksSurviveARestart(t *testing.T) {
	root := "fork-restart-" + sandboxid.New("fake")
	f := newFakeFixture(t)
	f.fake = runtimefake.New(runtimefake.Config{StateRoot: root})
	f.cfg.Backends = map[string]runtime.Runtime{runtimefake.Name: f.fake}
	n1, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	src := f.create(t, n1, specRecord{})
	out, err := n1.Fork(t.Context(), ForkRequest{SourceID: src.ID, Count: 2, RequestID: "keep"})
	if err != nil {
		t.Fatal(err)
	}
	n1.Close()
	rt2 := runtimefake.New(runtimefake.Config{StateRoot: root})
	f.fake = rt2
	f.cfg.Backends = map[string]runtime.Runtime{runtimefake.Name: rt2}
	n2 := f.open(t)
	for _, fk := range out.Forks {
		rec, _, err := n2.Get(t.Context(), fk.Sandbox.id)
		if err != nil || rec.ParentID != src.ID || !rec.MemoryPreserved || rec.State != stateRunning {
			t.Fatalf("fork %s after restart: %+v %v", fk.Sandbox.id, rec, err)
		}
	}
	again, err := n2.Fork(t.Context(), ForkRequest{SourceID: src.ID, Count: 2, RequestID: "keep"})
	if err != nil || len(again.Forks) != 2 {
		t.Fatalf("retry after restart: %v", err)
	}
	for i := range again.Forks {
		if again.Forks[i].Sandbox.id != out.Forks[0].Sandbox.id && again.Forks[i].Sandbox.id != out.Forks[1].Sandbox.id {
			t.Fatalf("retry after restart made a new fork %s", again.Forks[i].Sandbox.id)
		}
	}
	if _, _, c := n2.Usage(); c != 3 {
		t.Fatalf("%d sandboxes after restart and retry, want 3", c)
	}
}

// TestForkRefusesAnImageThatChanged: when the source's image name now
// names other content (re-imported, retagged), a fork would put the copied
// upper layer on other lower layers; it is refused and changes nothing.
func TestForkRefusesAnImageThatChanged(t *testing.T) {
	gen := new(atomic.Int64)
	f := newFakeNode(t, func(c *Config) {
		im := c.Images.(images)
		im.gen = gen
		c.Images = im
	})
	src := f.create(t, specRecord{})
	if src.ImageID == "" {
		t.Fatal("the source's record has no image ID")
	}
	gen.Add(1) // "re-import" the image
	before := f.forkState(t)
	_, err := f.Fork(t.Context(), ForkRequest{SourceID: src.ID, Count: 2})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "re-imported or retagged") {
		t.Fatalf("fork after the image changed: %v, want failed_precondition saying why", err)
	}
	if st := f.forkState(t); st != before {
		t.Fatalf("refused fork changed the node: %+v, was %+v", st, before)
	}
	gen.Add(-1)
	out, err := f.Fork(t.Context(), ForkRequest{SourceID: src.ID, Count: 2})
	if err != nil {
		t.Fatalf("fork with the image back: %v", err)
	}
	if out.Forks[0].Sandbox.rec.ImageID != src.ImageID {
		t.Fatalf("fork image ID %q, want the source's %q", out.Forks[0].Sandbox.rec.ImageID, src.ImageID)
	}
}

// TestRestartRefusesUnavailableBackend: a node whose table holds sandboxes
// of a backend that cannot open at this start (microvm without KVM) does
// not start, saying which and why; with the backend back it recovers them.
func TestRestartRefusesUnavailableBackend(t *testing.T) {
	root := "unavail-" + sandboxid.New("fake")
	f := newFakeFixture(t)
	f.fake = runtimefake.New(runtimefake.Config{StateRoot: root})
	f.cfg.Backends = map[string]runtime.Runtime{runtimefake.Name: f.fake}
	n1, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	src := f.create(t, n1, specRecord{})
	n1.Close()
	cfg := f.cfg
	cfg.Backends = map[string]runtime.Runtime{"other": runtimefake.New(runtimefake.Config{StateRoot: root + "-other"})}
	cfg.DefaultBackend = "other"
	cfg.Unavailable = map[string]string{runtimefake.Name: "no hardware KVM"}
	if n, err := New(t.Context(), cfg); err == nil || !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), src.ID) || !strings.Contains(err.Error(), "no hardware KVM") {
		if n != nil {
			n.Close()
		}
		t.Fatalf("start without the backend of sandbox %s: %v; want failed precondition naming it and why", src.ID, err)
	}
	f.fake = runtimefake.New(runtimefake.Config{StateRoot: root})
	f.cfg.Backends = map[string]runtime.Runtime{runtimefake.Name: f.fake}
	n2 := f.open(t)
	if rec, _, err := n2.Get(t.Context(), src.ID); err != nil || rec.State != stateRunning {
		t.Fatalf("sandbox after the backend came back: %+v %v", rec, err)
	}
}
