package node

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/container"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/testutil"
)

// images resolves every name to the busybox test rootfs, except "missing".
type images struct {
	layer string
	mu    *sync.Mutex
	holds map[string]bool // holder → held; guarded by mu
	gen   *atomic.Int64   // bumped to "re-import" every image; may be nil
}

func (i images) Release(_ context.Context, holder string) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	delete(i.holds, holder)
	return nil
}

func (i images) held() int {
	i.mu.Lock()
	defer i.mu.Unlock()
	return len(i.holds)
}

func (i images) Hold(_ context.Context, name, holder string) (runtime.Image, error) {
	if name == "missing" {
		return runtime.Image{}, errdefs.New(errdefs.ErrNotFound, "image %q not found", name)
	}
	i.mu.Lock()
	i.holds[holder] = true
	i.mu.Unlock()
	img := runtime.Image{
		Rootfs: runtime.Rootfs{Image: name, Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: i.layer}}},
		Env:    []string{"PATH=/bin:/usr/bin"},
	}
	if i.gen != nil { // content IDs only where a test re-imports
		img.Rootfs.ImageID, _ = i.ImageID(context.Background(), name)
	}
	return img, nil
}

type fixture struct {
	cfg Config
	rt  *container.Runtime
	// fake is the backend when the fixture runs on the fake (no root);
	// rt is nil then.
	fake *runtimefake.Runtime
}

// backend is the fixture's backend, fake or container.
func (f *fixture) backend() runtime.Runtime {
	if f.fake != nil {
		return f.fake
	}
	return f.rt
}

// newFakeFixture is a node over the fake backend: no root, no runc. Tests
// of the node's own logic (admission, idempotency, timeouts, the reaper)
// use it; those of what a real sandbox does use newFixture.
func newFakeFixture(t *testing.T) *fixture {
	rt := runtimefake.New(runtimefake.Config{StateRoot: "node-test-" + sandboxid.New("fake")})
	return &fixture{fake: rt, cfg: Config{
		ID:             "t001",
		StateDir:       t.TempDir(),
		Backends:       map[string]runtime.Runtime{runtimefake.Name: rt},
		DefaultBackend: runtimefake.Name,
		Images:         images{layer: t.TempDir(), mu: new(sync.Mutex), holds: map[string]bool{}},
		CPU:            4,
		MemoryMB:       4096,
		ReapInterval:   50 * time.Millisecond,
	}}
}

func newFixture(t *testing.T) *fixture {
	testutil.RequiresRoot(t)
	rt, err := container.New(container.Config{AgentPath: testutil.AgentBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "odnode")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return &fixture{rt: rt, cfg: Config{
		ID:             "t001",
		StateDir:       dir,
		Backends:       map[string]runtime.Runtime{"container": rt},
		DefaultBackend: "container",
		Images:         images{layer: testutil.BusyboxRootfs(t), mu: new(sync.Mutex), holds: map[string]bool{}},
		MemoryMB:       4096,
		ReapInterval:   50 * time.Millisecond,
	}}
}

func (f *fixture) open(t *testing.T) *Node {
	n, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		n.StopAll(context.Background(), "test cleanup")
		n.Close()
	})
	return n
}

func (f *fixture) create(t *testing.T, n *Node, s specRecord) *record {
	t.Helper()
	if s.Image == "" {
		s.Image = "root/busybox"
	}
	rec, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: s})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	return rec
}

func echo(t *testing.T, f *fixture, id string) string {
	t.Helper()
	if f.fake != nil {
		// No processes in a fake sandbox: its agent answering is the echo.
		if code, err := runtimetest.Health(t.Context(), f.fake, id); err != nil || code != 204 {
			t.Fatalf("health of %s: %d %v", id, code, err)
		}
		return "ok\n"
	}
	r, err := runtimetest.Run(t.Context(), f.rt, id, "", "/bin/sh", "-c", "echo ok")
	if err != nil {
		t.Fatalf("exec in %s: %v", id, err)
	}
	return r.Stdout
}

func TestCreateStopLeavesNothing(t *testing.T) {
	f := newFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{})
	if got := echo(t, f, rec.ID); got != "ok\n" {
		t.Fatalf("echo: %q", got)
	}
	if rec.Spec.MemoryMB != sandboxspec.DefaultMemoryMB || rec.Spec.TimeoutSec != sandboxspec.DefaultTimeoutSec || rec.Spec.PidsLimit != sandboxspec.DefaultPidsLimit {
		t.Fatalf("defaults not applied: %+v", rec.Spec)
	}
	if err := n.Stop(t.Context(), rec.ID, "test"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(rec.StateDir); !os.IsNotExist(err) {
		t.Fatalf("sandbox dir still there: %v", err)
	}
	if _, err := f.rt.Status(t.Context(), rec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("backend still knows the sandbox: %v", err)
	}
	recs, _ := n.table.all()
	if len(recs) != 0 {
		t.Fatalf("table still has %d records", len(recs))
	}
	if h := f.cfg.Images.(images).held(); h != 0 {
		t.Fatalf("%d image holds after stop, want 0", h)
	}
	if err := n.Stop(t.Context(), rec.ID, "again"); !errdefs.IsNotFound(err) {
		t.Fatalf("second stop: %v, want not found", err)
	}
}

func TestBadInputChangesNothing(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	cases := []struct {
		field string
		spec  specRecord
	}{
		{"image", specRecord{Image: "missing"}},
		{"memory_mb", specRecord{Image: "x", MemoryMB: 1 << 30}},
		{"memory_mb", specRecord{Image: "x", MemoryMB: -1}},
		{"timeout_seconds", specRecord{Image: "x", TimeoutSec: -5}},
		{"idle_timeout_seconds", specRecord{Image: "x", IdleSec: -1}},
		{"cpu", specRecord{Image: "x", CPU: -1}},
		{"backend", specRecord{Image: "x", Backend: "nope"}},
		{"env", specRecord{Image: "x", Env: map[string]string{"A=B": "c"}}},
	}
	for _, c := range cases {
		_, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: c.spec})
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != c.field {
			t.Errorf("spec %+v: got %v, want an invalid-argument error naming %s", c.spec, err, c.field)
		}
	}
	if _, err := n.Create(t.Context(), CreateRequest{ID: "bad", Spec: specRecord{Image: "x"}}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("bad id: %v", err)
	}
	if _, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New("zzzz"), Spec: specRecord{Image: "x"}}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("foreign id: %v", err)
	}
	if _, _, c := n.Usage(); c != 0 {
		t.Fatalf("%d sandboxes after bad input", c)
	}
	ents, _ := os.ReadDir(filepath.Join(f.cfg.StateDir, "sandboxes"))
	if len(ents) != 0 {
		t.Fatalf("sandbox dirs left behind: %v", ents)
	}
}

func TestIdempotentCreate(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	var wg sync.WaitGroup
	ids := make([]string, 4)
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rec, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), RequestID: "req-1", Spec: specRecord{Image: "x"}})
			if err != nil {
				t.Error(err)
				return
			}
			ids[i] = rec.ID
		}()
	}
	wg.Wait()
	for _, id := range ids[1:] {
		if id != ids[0] {
			t.Fatalf("retries with one request_id made different sandboxes: %v", ids)
		}
	}
	if _, _, c := n.Usage(); c != 1 {
		t.Fatalf("%d sandboxes, want 1", c)
	}
	if h := f.cfg.Images.(images).held(); h != 1 {
		t.Fatalf("%d image holds after deduplicated retries, want 1", h)
	}
}

func TestAdmissionRefusesOverCapacity(t *testing.T) {
	f := newFakeFixture(t)
	f.cfg.MemoryMB = 600
	n := f.open(t)
	f.create(t, n, specRecord{MemoryMB: 400})
	_, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "x", MemoryMB: 400}})
	if !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("over capacity: %v, want resource exhausted", err)
	}
	if h := f.cfg.Images.(images).held(); h != 1 {
		t.Fatalf("%d image holds after a refused create, want 1 (the running sandbox's)", h)
	}
}

func waitGone(t *testing.T, n *Node, id string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if _, err := n.get(id); errdefs.IsNotFound(err) {
			return
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
	t.Fatalf("sandbox %s still there after %s", id, within)
}

func TestLifetimeTimeout(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 1})
	keep := f.create(t, n, specRecord{TimeoutSec: 60})
	waitGone(t, n, rec.ID, 10*time.Second)
	if _, err := n.get(keep.ID); err != nil {
		t.Fatalf("sandbox with a long timeout was stopped: %v", err)
	}
	if _, err := os.Stat(rec.StateDir); !os.IsNotExist(err) {
		t.Fatalf("expired sandbox's dir left: %v", err)
	}
}

func TestSetTimeoutExtends(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 1})
	if _, err := n.SetTimeout(t.Context(), rec.ID, 60); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // the old deadline must pass; nothing to poll for
	if _, err := n.get(rec.ID); err != nil {
		t.Fatalf("sandbox stopped despite the extended timeout: %v", err)
	}
	if _, err := n.SetTimeout(t.Context(), rec.ID, -1); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("negative timeout: %v", err)
	}
}

func TestIdleTimeout(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{IdleSec: 1})
	busy := f.create(t, n, specRecord{IdleSec: 1})
	_, sb, _ := n.Get(t.Context(), busy.ID)
	sb.active.Add(1) // an open stream: never idle
	defer sb.active.Add(-1)
	waitGone(t, n, rec.ID, 10*time.Second)
	if _, err := n.get(busy.ID); err != nil {
		t.Fatalf("sandbox with an open request was reaped as idle: %v", err)
	}
}

func TestRecoverAfterRestart(t *testing.T) {
	f := newFixture(t)
	n1, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := f.create(t, n1, specRecord{})
	// A create interrupted by a crash: its record says creating.
	half := &record{ID: sandboxid.New(f.cfg.ID), Backend: "container", State: stateCreating,
		StateDir: filepath.Join(f.cfg.StateDir, "sandboxes", "half"), Spec: specRecord{MemoryMB: 64}}
	os.MkdirAll(half.StateDir, 0o700)
	if err := n1.table.put(half); err != nil {
		t.Fatal(err)
	}
	n1.Close() // the node goes away; sandboxes keep running

	// A restarted node has a fresh backend that knows nothing in memory.
	rt2, err := container.New(container.Config{AgentPath: testutil.AgentBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	f.rt = rt2
	f.cfg.Backends = map[string]runtime.Runtime{"container": rt2}

	n2 := f.open(t)
	if got := echo(t, f, rec.ID); got != "ok\n" {
		t.Fatalf("after restart: %q", got)
	}
	if _, err := n2.get(rec.ID); err != nil {
		t.Fatalf("recovered node lost the sandbox: %v", err)
	}
	if _, err := n2.get(half.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("interrupted create was kept: %v", err)
	}
	if _, err := os.Stat(half.StateDir); !os.IsNotExist(err) {
		t.Fatalf("interrupted create's dir left: %v", err)
	}
	if _, mem, c := n2.Usage(); c != 1 || mem != rec.Spec.MemoryMB {
		t.Fatalf("usage after recovery: %d sandboxes, %d MiB", c, mem)
	}
}

// blockingRuntime is a fake backend whose Stop blocks for one sandbox until
// release is closed. Only the methods recovery and stop use are implemented.
type blockingRuntime struct {
	runtime.Runtime
	stuck   string
	release chan struct{}

	mu       sync.Mutex
	stopping map[string]int // stops in progress per sandbox
	stops    map[string]int // stops begun per sandbox
	overlap  bool           // two stops of one sandbox ran at once
}

func (r *blockingRuntime) Recover(context.Context, runtime.Handle) error { return nil }

func (r *blockingRuntime) Status(_ context.Context, id string) (runtime.Status, error) {
	return runtime.Status{State: runtime.StateRunning}, nil
}

func (r *blockingRuntime) Stop(_ context.Context, id string, _ runtime.StopOptions) error {
	r.mu.Lock()
	r.stopping[id]++
	r.stops[id]++
	if r.stopping[id] > 1 {
		r.overlap = true
	}
	r.mu.Unlock()
	if id == r.stuck {
		<-r.release
	}
	r.mu.Lock()
	r.stopping[id]--
	r.mu.Unlock()
	return nil
}

func (r *blockingRuntime) Delete(context.Context, string) error { return nil }

// ValidateOptions accepts no options.
func (r *blockingRuntime) ValidateOptions(opts map[string]string) error {
	for k := range opts {
		return errdefs.Invalid("backend_options."+k, "no options here")
	}
	return nil
}

// Wait blocks: init never ends on its own here.
func (r *blockingRuntime) Wait(ctx context.Context, _ string) (runtime.ExitStatus, error) {
	<-ctx.Done()
	return runtime.ExitStatus{}, ctx.Err()
}

func (r *blockingRuntime) stopCount(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stops[id]
}

// One backend stop that hangs must not delay the other expiries, and Close
// waits for the stop in flight.
func TestReaperStuckStopDelaysNoOther(t *testing.T) {
	dir := t.TempDir()
	agentPath := filepath.Join(dir, "agent")
	for _, p := range []string{agentPath, filepath.Join(dir, "opendsec-init")} {
		if err := os.WriteFile(p, nil, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	stateDir := filepath.Join(dir, "state")
	tbl, err := openTable(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	stuck := &record{ID: sandboxid.New("t001"), Backend: "fake", State: stateRunning,
		CreatedAt: now, ExpiresAt: now.Add(-time.Second), StateDir: filepath.Join(dir, "stuck")}
	// The other expires after the stuck one's stop began.
	other := &record{ID: sandboxid.New("t001"), Backend: "fake", State: stateRunning,
		CreatedAt: now, ExpiresAt: now.Add(300 * time.Millisecond), StateDir: filepath.Join(dir, "other")}
	for _, r := range []*record{stuck, other} {
		if err := tbl.put(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := tbl.close(); err != nil {
		t.Fatal(err)
	}
	rt := &blockingRuntime{stuck: stuck.ID, release: make(chan struct{}), stopping: map[string]int{}, stops: map[string]int{}}
	n, err := New(t.Context(), Config{
		ID:             "t001",
		StateDir:       stateDir,
		Backends:       map[string]runtime.Runtime{"fake": rt},
		DefaultBackend: "fake",
		Images:         images{mu: new(sync.Mutex), holds: map[string]bool{}},
		CPU:            4,
		MemoryMB:       4096,
		ReapInterval:   20 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	released := false
	t.Cleanup(func() { // before Close (cleanups run last first)
		if !released {
			close(rt.release)
		}
	})

	waitGone(t, n, other.ID, 2*time.Second)
	if rt.stopCount(stuck.ID) != 1 {
		t.Fatalf("stuck sandbox stopped %d times; want 1 (in progress)", rt.stopCount(stuck.ID))
	}
	if _, err := n.get(stuck.ID); err != nil {
		t.Fatalf("stuck sandbox: %v; want it kept while its stop runs", err)
	}

	// Close waits for the stuck stop, then returns once it ends.
	closed := make(chan error, 1)
	go func() { closed <- n.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a reaper stop was in flight", err)
	case <-time.After(200 * time.Millisecond):
	}
	released = true
	close(rt.release)
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return after the stuck stop ended")
	}
	if _, err := n.get(stuck.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("stuck sandbox after its stop ended: %v; want not found", err)
	}
	rt.mu.Lock()
	overlap, stops := rt.overlap, rt.stops[stuck.ID]
	rt.mu.Unlock()
	if overlap || stops != 1 {
		t.Fatalf("stuck sandbox: %d stops, overlapping %v; want 1, false", stops, overlap)
	}
	// Its record is gone from the table.
	tbl, err = openTable(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	defer tbl.close()
	recs, err := tbl.all()
	if err != nil || len(recs) != 0 {
		t.Fatalf("records after the stops: %d, %v; want none", len(recs), err)
	}
}

// TestAgentThatNeverAnswersIsStopped: a create returns once the sandbox has
// started (its agent socket listens since before the start). Init answers
// the node's /health itself, without starting the agent, unless the agent
// binary cannot run at all: then its 503 makes the node stop the sandbox
// within AgentReadyTimeout, so no sandbox stays "running" without one.
func TestAgentThatNeverAnswersIsStopped(t *testing.T) {
	f := newFixture(t)
	broken := filepath.Join(t.TempDir(), "agent")
	if err := os.WriteFile(broken, []byte("not a program\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	rt, err := container.New(container.Config{AgentPath: broken, InitPath: testutil.InitBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	f.rt, f.cfg.Backends = rt, map[string]runtime.Runtime{"container": rt}
	f.cfg.AgentReadyTimeout = time.Second
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 600})
	if rec.State != stateRunning {
		t.Fatalf("state after create: %s", rec.State)
	}
	waitGone(t, n, rec.ID, 15*time.Second)
	if _, err := os.Stat(rec.StateDir); !os.IsNotExist(err) {
		t.Fatalf("stopped sandbox's dir left: %v", err)
	}
}

// TestAgentThatDiesAtStartIsReported: an agent that starts but dies before
// serving (here a script exiting 3; a crash or a bad flag alike) is started
// only by the first real request, which gets a 503 from init naming the
// agent and how it ended, not a bare EOF or a hang; the request after it
// gets the same.
func TestAgentThatDiesAtStartIsReported(t *testing.T) {
	f := newFixture(t)
	broken := filepath.Join(t.TempDir(), "agent")
	if err := os.WriteFile(broken, []byte("#!/bin/sh\necho 'broken agent' >&2\nexit 3\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	rt, err := container.New(container.Config{AgentPath: broken, InitPath: testutil.InitBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	f.rt, f.cfg.Backends = rt, map[string]runtime.Runtime{"container": rt}
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 600})
	t.Cleanup(func() { n.Stop(context.WithoutCancel(t.Context()), rec.ID, "test end") })
	for i := range 2 {
		req := httptest.NewRequest(http.MethodGet, AgentPrefix+rec.ID+"/envs", nil)
		w := httptest.NewRecorder()
		n.AgentProxy().ServeHTTP(w, req)
		if w.Code != http.StatusServiceUnavailable || !strings.Contains(w.Body.String(), "exited with status 3") ||
			!strings.Contains(w.Body.String(), "before serving") || !strings.Contains(w.Body.String(), "/.opendsec/agent") {
			t.Fatalf("request %d to a sandbox whose agent dies at start: %d %q, want 503 naming the agent and its exit", i+1, w.Code, w.Body)
		}
	}
}

// ImageID makes the fake usable by the warm pool.
func (i images) ImageID(_ context.Context, name string) (string, error) {
	if name == "missing" {
		return "", errdefs.New(errdefs.ErrNotFound, "image %q not found", name)
	}
	g := int64(0)
	if i.gen != nil {
		g = i.gen.Load()
	}
	return fmt.Sprintf("sha256:fake-%s-%d", name, g), nil
}

// poolReady returns how many prestarted sandboxes the pool holds.
func poolReady(n *Node) int {
	n.pool.mu.Lock()
	defer n.pool.mu.Unlock()
	c := 0
	for _, s := range n.pool.shapes {
		c += len(s.ready)
	}
	return c
}

func waitPoolReady(t *testing.T, n *Node, want int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for poolReady(n) < want {
		if time.Now().After(deadline) {
			t.Fatalf("warm pool has %d ready sandboxes after 30s, want %d", poolReady(n), want)
		}
		time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
	}
}

// TestWarmPool: the first create of a shape is cold and teaches the pool
// the shape; the pool prestarts one; the next create of that shape takes it
// (its own ID, the caller's env and not the previous caller's, hostname =
// ID), a create of another shape or with SkipPool does not; the ID asked
// for still stops it; shutdown removes the prestarted sandboxes.
func TestWarmPool(t *testing.T) {
	f := newFixture(t)
	gen := new(atomic.Int64)
	im := f.cfg.Images.(images)
	im.gen = gen
	f.cfg.Images = im
	f.cfg.Pool = PoolConfig{Size: 1, Max: 2, IdleTTL: time.Minute}
	f.cfg.MemoryMB = 16384 // room for every sandbox below (the pool fills only for what could be admitted)
	n, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			n.StopAll(context.Background(), "test cleanup")
			n.Close()
		}
	})
	a := f.create(t, n, specRecord{Env: map[string]string{"FIRST": "1"}})
	if a.FromPool {
		t.Fatal("first create of a shape came from the pool")
	}
	// One create of a shape prestarts nothing; the second makes it a
	// shape worth keeping.
	n.pool.mu.Lock()
	shapes := len(n.pool.shapes)
	n.pool.mu.Unlock()
	if shapes != 1 {
		t.Fatalf("pool tracks %d shapes, want 1", shapes)
	}
	if k, _, ok := n.pool.next(time.Now()); ok {
		t.Fatalf("pool wants to prestart %+v after one create of its shape", k)
	}
	a2 := f.create(t, n, specRecord{Env: map[string]string{"FIRST": "2"}})
	if a2.FromPool {
		t.Fatal("second create of a shape came from the pool")
	}
	waitPoolReady(t, n, 1)

	asked := sandboxid.New(f.cfg.ID)
	b, err := n.Create(t.Context(), CreateRequest{ID: asked, Spec: specRecord{Image: "root/busybox", Env: map[string]string{"SECOND": "2"}, Labels: map[string]string{"k": "v"}}})
	if err != nil {
		t.Fatal(err)
	}
	if !b.FromPool || b.ID == asked || b.State != stateRunning || b.Spec.Labels["k"] != "v" {
		t.Fatalf("second create: from pool %v, id %s (asked %s), state %s, labels %v", b.FromPool, b.ID, asked, b.State, b.Spec.Labels)
	}
	r, err := runtimetest.Run(t.Context(), f.rt, b.ID, "", "/bin/sh", "-c", `echo "$SECOND,$FIRST,$(hostname)"`)
	if err != nil {
		t.Fatal(err)
	}
	if want := "2,," + b.ID + "\n"; r.Stdout != want {
		t.Fatalf("pool sandbox sees %q, want %q", r.Stdout, want)
	}
	// The caller knows only the ID it asked for: Stop finds the sandbox.
	if err := n.Stop(t.Context(), asked, "test"); err != nil {
		t.Fatalf("stop by the asked ID: %v", err)
	}
	waitGone(t, n, b.ID, 10*time.Second)

	waitPoolReady(t, n, 1)
	c, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "root/busybox"}, SkipPool: true})
	if err != nil {
		t.Fatal(err)
	}
	if c.FromPool {
		t.Fatal("SkipPool create came from the pool")
	}
	d := f.create(t, n, specRecord{MemoryMB: 300})
	if d.FromPool {
		t.Fatal("create of another shape came from the pool")
	}
	if d2 := f.create(t, n, specRecord{MemoryMB: 300}); d2.FromPool {
		t.Fatal("second create of another shape came from the pool")
	}
	if got := echo(t, f, d.ID); got != "ok\n" {
		t.Fatalf("echo: %q", got)
	}

	// A re-imported image: the old content's prestarted sandboxes go (no
	// create can take them), and its shape starts anew.
	waitPoolReady(t, n, 2)
	var stale []string
	n.pool.mu.Lock()
	for _, s := range n.pool.shapes {
		for _, rec := range s.ready {
			stale = append(stale, rec.ID)
		}
	}
	n.pool.mu.Unlock()
	gen.Add(1)
	n.pool.expire(time.Now())
	if got := poolReady(n); got != 0 {
		t.Fatalf("%d prestarted sandboxes of a re-imported image kept", got)
	}
	for _, id := range stale {
		deadline := time.Now().Add(20 * time.Second)
		for _, err := f.rt.Status(t.Context(), id); !errdefs.IsNotFound(err); _, err = f.rt.Status(t.Context(), id) {
			if time.Now().After(deadline) {
				t.Fatalf("stale prestarted sandbox %s still there: %v", id, err)
			}
			time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
		}
	}
	f.create(t, n, specRecord{})
	f.create(t, n, specRecord{MemoryMB: 300})
	if e := f.create(t, n, specRecord{}); e.FromPool {
		t.Fatal("create after re-import came from the pool at once")
	}
	f.create(t, n, specRecord{MemoryMB: 300})

	// Shutdown removes every prestarted sandbox (the running ones stay).
	waitPoolReady(t, n, 2)
	var pooled []string
	n.pool.mu.Lock()
	for _, s := range n.pool.shapes {
		for _, rec := range s.ready {
			pooled = append(pooled, rec.ID)
		}
	}
	n.pool.mu.Unlock()
	n.StopAll(context.Background(), "test")
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	closed = true
	for _, id := range pooled {
		if _, err := f.rt.Status(context.Background(), id); !errdefs.IsNotFound(err) {
			t.Errorf("prestarted sandbox %s still known to the backend after shutdown: %v", id, err)
		}
	}
	ents, _ := os.ReadDir(filepath.Join(f.cfg.StateDir, "sandboxes"))
	if len(ents) != 0 {
		t.Errorf("sandbox dirs left after shutdown: %d", len(ents))
	}
}

// TestRecoverRunningRecordOfUnstartedSandbox: the node records a sandbox
// running while its start (or launch) runs; one that dies in between
// leaves a "running" record of a container that never ran. The next start
// removes it rather than list a sandbox that runs nothing.
func TestRecoverRunningRecordOfUnstartedSandbox(t *testing.T) {
	f := newFixture(t)
	id := sandboxid.New(f.cfg.ID)
	dir := sandboxDir(f.cfg.StateDir, id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	h, err := f.rt.Create(t.Context(), runtime.Spec{
		ID:        id,
		Rootfs:    runtime.Rootfs{Image: "root/busybox", Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: testutil.BusyboxRootfs(t)}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 128, PidsLimit: 64},
		StateDir:  dir,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.rt.Prestart(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	st, err := f.rt.Status(t.Context(), id)
	if err != nil || st.State != runtime.StateCreated {
		t.Fatalf("status before the node starts: %+v, %v", st, err)
	}
	tbl, err := openTable(f.cfg.StateDir)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	if err := tbl.put(&record{ID: id, Backend: "container", State: stateRunning, Spec: specRecord{Image: "root/busybox", CPU: 1, MemoryMB: 128},
		CreatedAt: now, ExpiresAt: now.Add(time.Hour), StateDir: dir, Handle: h}); err != nil {
		t.Fatal(err)
	}
	tbl.close()
	n := f.open(t)
	if _, err := n.get(id); !errdefs.IsNotFound(err) {
		t.Fatalf("sandbox that never ran is listed after recovery: %v", err)
	}
	if _, err := f.rt.Status(t.Context(), id); !errdefs.IsNotFound(err) {
		t.Fatalf("backend still has it: %v", err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("its dir is left: %v", err)
	}
	if st.Pid > 0 && pidAliveTest(st.Pid) {
		t.Fatalf("its waiting init %d still lives", st.Pid)
	}
}

func pidAliveTest(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	return err == nil && !strings.Contains(string(b), ") Z ")
}

// A create without disk_mb gets the node's default; one above the node's
// maximum is refused naming disk_mb; below the node's disk reserve every
// create is refused (resource_exhausted) and nothing is made.
func TestDiskQuotaDefaultMaxAndReserve(t *testing.T) {
	f := newFakeFixture(t)
	f.cfg.DiskDefaultMB, f.cfg.DiskMaxMB = 100, 200
	n := f.open(t)
	rec, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "x"}})
	if err != nil {
		t.Fatal(err)
	}
	if s, err := f.fake.Spec(rec.ID); err != nil || s.Resources.DiskMB != 100 || rec.Spec.DiskMB != 100 {
		t.Fatalf("backend spec disk_mb %d (record %d), err %v; want the node default 100", s.Resources.DiskMB, rec.Spec.DiskMB, err)
	}
	rec2, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "x", DiskMB: 200}})
	if err != nil {
		t.Fatal(err)
	}
	if s, _ := f.fake.Spec(rec2.ID); s.Resources.DiskMB != 200 {
		t.Fatalf("backend spec disk_mb %d, want 200", s.Resources.DiskMB)
	}
	_, err = n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "x", DiskMB: 201}})
	var fe *errdefs.FieldError
	if !errors.As(err, &fe) || fe.Field != "disk_mb" || !strings.Contains(err.Error(), "at most 200") {
		t.Fatalf("disk_mb above the maximum: %v, want invalid disk_mb naming the maximum", err)
	}

	free, err := freeMB(f.cfg.StateDir)
	if err != nil {
		t.Fatal(err)
	}
	g := newFakeFixture(t)
	g.cfg.DiskReserveMB = free + 1<<20
	m := g.open(t)
	_, err = m.Create(t.Context(), CreateRequest{ID: sandboxid.New(g.cfg.ID), Spec: specRecord{Image: "x"}})
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "node.disk.reserve_mb") {
		t.Fatalf("create below the disk reserve: %v, want resource_exhausted naming node.disk.reserve_mb", err)
	}
	if _, _, c := m.Usage(); c != 0 {
		t.Fatalf("%d sandboxes after a refused create", c)
	}
}
