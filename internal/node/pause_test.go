package node

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/container"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/testutil"
)

func mustBackendState(t *testing.T, rt runtime.Runtime, id string, want runtime.State) {
	t.Helper()
	st, err := rt.Status(t.Context(), id)
	if err != nil || st.State != want {
		t.Fatalf("backend state of %s = %v (%v), want %s", id, st.State, err, want)
	}
}

func stateOf(t *testing.T, n *Node, id string) string {
	t.Helper()
	rec, _, err := n.Get(t.Context(), id)
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	return rec.State
}

func TestPauseSurvivesRestart(t *testing.T) {
	f := newFixture(t)
	n1, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := f.create(t, n1, specRecord{})
	if _, err := n1.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := n1.Pause(t.Context(), rec.ID); err != nil {
		t.Fatalf("second pause (idempotent): %v", err)
	}
	n1.Close()

	rt2, err := container.New(container.Config{AgentPath: testutil.AgentBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	f.rt = rt2
	f.cfg.Backends = map[string]runtime.Runtime{"container": rt2}
	n2 := f.open(t)
	if got := stateOf(t, n2, rec.ID); got != statePaused {
		t.Fatalf("state after restart = %s, want paused", got)
	}
	mustBackendState(t, rt2, rec.ID, runtime.StatePaused)
	// A call through the restarted node's agent path resumes it first.
	srv := httptest.NewServer(n2.AgentProxy())
	resp, err := http.Get(srv.URL + AgentPrefix + rec.ID + "/health")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	srv.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("agent request to a paused sandbox after a restart: %d %s, want it resumed and answered", resp.StatusCode, body)
	}
	mustBackendState(t, rt2, rec.ID, runtime.StateRunning)
	if got := stateOf(t, n2, rec.ID); got != stateRunning {
		t.Fatalf("state after the call = %s, want running", got)
	}
	if _, err := n2.Resume(t.Context(), rec.ID, 0); err != nil {
		t.Fatalf("second resume (idempotent): %v", err)
	}
	if got := echo(t, f, rec.ID); got != "ok\n" {
		t.Fatalf("after resume: %q", got)
	}
}

// A node killed between the freeze and its record: recovery trusts the
// backend.
func TestRecoverReconcilesPause(t *testing.T) {
	f := newFixture(t)
	n1, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := f.create(t, n1, specRecord{})
	if err := f.rt.Pause(t.Context(), rec.ID); err != nil { // behind the node's back
		t.Fatal(err)
	}
	n1.Close()
	n2 := f.open(t)
	if got := stateOf(t, n2, rec.ID); got != statePaused {
		t.Fatalf("state after restart = %s, want paused (the backend is)", got)
	}
}

// testClock is a node clock a test moves forward instead of sleeping. It
// counts its reads: the reaper reads it once at the start of every pass.
type testClock struct {
	off   atomic.Int64 // nanoseconds ahead of the wall clock
	reads atomic.Int64
}

func (c *testClock) now() time.Time {
	c.reads.Add(1)
	return time.Now().Add(time.Duration(c.off.Load()))
}

func (c *testClock) advance(d time.Duration) { c.off.Add(int64(d)) }

// reapPasses waits until the reaper has finished k full passes after this
// call (k+1 reads of the clock; nothing else reads it meanwhile).
func (c *testClock) reapPasses(t *testing.T, k int64) {
	t.Helper()
	want := c.reads.Load() + k + 1
	deadline := time.Now().Add(10 * time.Second)
	for c.reads.Load() < want {
		if time.Now().After(deadline) {
			t.Fatalf("the reaper made no %d passes in 10 s", k)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
}

// waitReaperDone waits until the reaper no longer acts on id (its stop or
// pause of it returned).
func waitReaperDone(t *testing.T, n *Node, id string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n.mu.Lock()
		reaping := n.reaping[id]
		n.mu.Unlock()
		if !reaping {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the reaper still acts on %s after 10 s", id)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
}

// mustStayPaused fails unless id is paused and the reaper is not acting on it.
func mustStayPaused(t *testing.T, n *Node, id, why string) {
	t.Helper()
	n.mu.Lock()
	reaping := n.reaping[id]
	n.mu.Unlock()
	if got := stateOf(t, n, id); got != statePaused || reaping {
		t.Fatalf("%s: state %s, reaper acting on it %v; want paused and left alone", why, got, reaping)
	}
}

func TestPausedNotReapedAndClockStops(t *testing.T) {
	f := newFakeFixture(t)
	clk := &testClock{}
	f.cfg.Clock = clk.now
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 2, IdleSec: 1})
	paused, err := n.Pause(t.Context(), rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	left := paused.ExpiresAt.Sub(paused.PausedAt)
	// Both timeouts pass while paused.
	clk.advance(3 * time.Second)
	clk.reapPasses(t, 2)
	mustStayPaused(t, n, rec.ID, "both timeouts passed while paused")
	resumed, err := n.Resume(t.Context(), rec.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := resumed.ExpiresAt.Sub(clk.now()); got > left || got < left-time.Second {
		t.Fatalf("lifetime after resume = %s, want the %s left at the pause", got, left)
	}
	// And then the lifetime clock runs again.
	waitGone(t, n, rec.ID, 10*time.Second)
}

// An auto-pause on timeout happens after the expiry; resume(0), the SDK's
// and CLI's default, gives a fresh full lifetime, not the second left.
func TestResumeAfterAutoPauseOnTimeout(t *testing.T) {
	f := newFakeFixture(t)
	clk := &testClock{}
	f.cfg.Clock = clk.now
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 60, AutoPause: true})
	clk.advance(61 * time.Second)
	deadline := time.Now().Add(10 * time.Second)
	for stateOf(t, n, rec.ID) != statePaused {
		if time.Now().After(deadline) {
			t.Fatalf("auto_pause sandbox not paused 10 s after its timeout")
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
	resumed, err := n.Resume(t.Context(), rec.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := resumed.ExpiresAt.Sub(clk.now()); got < 59*time.Second || got > 60*time.Second {
		t.Fatalf("lifetime after resume(0) of a timed-out sandbox = %s, want the full 60s", got)
	}
	clk.reapPasses(t, 3)
	if got := stateOf(t, n, rec.ID); got != stateRunning {
		t.Fatalf("state a few reaper passes after resume(0) = %s, want running", got)
	}
	if got := echo(t, f, rec.ID); got != "ok\n" {
		t.Fatalf("after resume: %q", got)
	}
}

func TestResumedExpiry(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	now := t0.Add(time.Hour)
	spec := specRecord{TimeoutSec: 300}
	for _, c := range []struct {
		name     string
		rec      record
		timeout  int64
		wantLeft time.Duration
	}{
		{"explicit timeout", record{Spec: spec, PausedAt: t0, ExpiresAt: t0.Add(time.Minute)}, 30, 30 * time.Second},
		{"paused with time left", record{Spec: spec, PausedAt: t0, ExpiresAt: t0.Add(time.Minute)}, 0, time.Minute},
		{"paused at expiry", record{Spec: spec, PausedAt: t0, ExpiresAt: t0}, 0, 300 * time.Second},
		{"paused after expiry", record{Spec: spec, PausedAt: t0, ExpiresAt: t0.Add(-time.Second)}, 0, 300 * time.Second},
		{"paused just before expiry", record{Spec: spec, PausedAt: t0, ExpiresAt: t0.Add(time.Millisecond)}, 0, time.Second},
	} {
		if got := resumedExpiry(&c.rec, now, c.timeout).Sub(now); got != c.wantLeft {
			t.Errorf("%s: lifetime %s, want %s", c.name, got, c.wantLeft)
		}
	}
}

func TestMaxPausedStopsPaused(t *testing.T) {
	f := newFakeFixture(t)
	clk := &testClock{}
	f.cfg.Clock = clk.now
	f.cfg.MaxPaused = time.Hour
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 60})
	if _, err := n.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	clk.advance(59 * time.Minute)
	clk.reapPasses(t, 2)
	mustStayPaused(t, n, rec.ID, "paused 59 min of at most 1 h")
	clk.advance(2 * time.Minute)
	waitGone(t, n, rec.ID, 10*time.Second)
	if _, err := f.backend().Status(t.Context(), rec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("backend still knows the sandbox paused too long: %v", err)
	}
}

// breakTable makes every table write fail until the returned func reopens it.
func breakTable(t *testing.T, n *Node) (restore func()) {
	t.Helper()
	path := n.table.db.Path()
	if err := n.table.db.Close(); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	restore = func() {
		once.Do(func() {
			db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 5 * time.Second})
			if err != nil {
				t.Fatalf("reopen the sandbox table: %v", err)
			}
			n.table.db = db
		})
	}
	t.Cleanup(restore) // before the fixture's cleanup stops the sandboxes
	return restore
}

// A pause or resume whose table write fails is undone: the caller's error
// leaves the sandbox as it was, in the backend and in memory.
func TestPauseResumeUndoneWhenNotRecorded(t *testing.T) {
	f := newFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{TaskID: "job"})

	restore := breakTable(t, n)
	if _, err := n.Pause(t.Context(), rec.ID); err == nil {
		t.Fatalf("pause with a broken table succeeded")
	}
	mustBackendState(t, f.rt, rec.ID, runtime.StateRunning)
	if got := stateOf(t, n, rec.ID); got != stateRunning {
		t.Fatalf("state after a failed pause = %s, want running", got)
	}
	rs, err := n.PauseMatching(t.Context(), Selector{TaskID: "job"}, false)
	if err != nil || len(rs) != 1 || rs[0].Err == nil {
		t.Fatalf("batch pause with a broken table: %+v %v, want one failed item", rs, err)
	}
	mustBackendState(t, f.rt, rec.ID, runtime.StateRunning)
	if got := stateOf(t, n, rec.ID); got != stateRunning {
		t.Fatalf("state after a failed batch pause = %s, want running", got)
	}
	restore()

	if _, err := n.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	restore = breakTable(t, n)
	if _, err := n.Resume(t.Context(), rec.ID, 0); err == nil {
		t.Fatalf("resume with a broken table succeeded")
	}
	mustBackendState(t, f.rt, rec.ID, runtime.StatePaused)
	if got := stateOf(t, n, rec.ID); got != statePaused {
		t.Fatalf("state after a failed resume = %s, want paused", got)
	}
	restore()
	if _, err := n.Resume(t.Context(), rec.ID, 0); err != nil {
		t.Fatal(err)
	}
	if got := echo(t, f, rec.ID); got != "ok\n" {
		t.Fatalf("after resume: %q", got)
	}
}

func TestAutoPause(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 1, AutoPause: true})
	deadline := time.Now().Add(10 * time.Second)
	for stateOf(t, n, rec.ID) != statePaused {
		if time.Now().After(deadline) {
			t.Fatalf("auto_pause sandbox not paused 10 s after its 1 s timeout")
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
	mustBackendState(t, f.backend(), rec.ID, runtime.StatePaused)
	// Resume with a new lifetime: it runs again.
	if _, err := n.Resume(t.Context(), rec.ID, 60); err != nil {
		t.Fatal(err)
	}
	if got := echo(t, f, rec.ID); got != "ok\n" {
		t.Fatalf("after resume: %q", got)
	}
}

func TestStopPausedLeavesNothing(t *testing.T) {
	f := newFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{})
	if _, err := n.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	cgroups := f.rt.CgroupDirs(rec.ID)
	if len(cgroups) == 0 {
		t.Fatalf("no cgroup dirs for a paused sandbox")
	}
	if err := n.Stop(t.Context(), rec.ID, "test"); err != nil {
		t.Fatalf("stop paused: %v", err)
	}
	if _, err := os.Stat(rec.StateDir); !os.IsNotExist(err) {
		t.Fatalf("sandbox dir still there: %v", err)
	}
	if _, err := f.rt.Status(t.Context(), rec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("backend still knows the sandbox: %v", err)
	}
	if left := f.rt.CgroupDirs(rec.ID); len(left) != 0 {
		t.Fatalf("cgroups left: %v", left)
	}
	if recs, _ := n.table.all(); len(recs) != 0 {
		t.Fatalf("table still has %d records", len(recs))
	}
	if _, err := n.Resume(t.Context(), rec.ID, 0); !errdefs.IsNotFound(err) {
		t.Fatalf("resume of a stopped sandbox: %v, want not found", err)
	}
}

func TestBatchPauseByTask(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	var job []string
	for range 3 {
		job = append(job, f.create(t, n, specRecord{TaskID: "job1", Labels: map[string]string{"k": "v"}}).ID)
	}
	other := f.create(t, n, specRecord{TaskID: "job2"}).ID
	if _, err := n.PauseMatching(t.Context(), Selector{}, false); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("empty selector: %v, want invalid argument", err)
	}
	rs, err := n.PauseMatching(t.Context(), Selector{TaskID: "job1"}, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 3 {
		t.Fatalf("paused %d sandboxes, want 3", len(rs))
	}
	for _, r := range rs {
		if r.Err != nil {
			t.Fatalf("pause %s: %v", r.ID, r.Err)
		}
	}
	for _, id := range job {
		if got := stateOf(t, n, id); got != statePaused {
			t.Fatalf("%s is %s, want paused", id, got)
		}
		mustBackendState(t, f.backend(), id, runtime.StatePaused)
	}
	if got := stateOf(t, n, other); got != stateRunning {
		t.Fatalf("sandbox of another task is %s, want running", got)
	}
	rs, err = n.ResumeMatching(t.Context(), Selector{Labels: map[string]string{"k": "v"}}, 0)
	if err != nil || len(rs) != 3 {
		t.Fatalf("resume by label: %d results, %v", len(rs), err)
	}
	for _, id := range job {
		if got := echo(t, f, id); got != "ok\n" {
			t.Fatalf("after batch resume: %q", got)
		}
	}
}

func TestMetrics(t *testing.T) {
	f := newFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{MemoryMB: 64})
	echo(t, f, rec.ID)
	m, err := n.Metrics(t.Context(), rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if m.MemoryBytes <= 0 || m.MemoryLimitBytes != 64<<20 || m.Pids < 1 || m.CPUCount != sandboxspec.DefaultCPU || m.CPUNanos == 0 {
		t.Fatalf("metrics %+v", m)
	}
	if m.CPUUsedPct <= 0 || m.CPUUsedPct > 100 {
		t.Fatalf("cpu used %.3f%%, want within (0, 100]", m.CPUUsedPct)
	}
	if _, err := n.Metrics(t.Context(), "t001nosuchsandbox"); !errdefs.IsNotFound(err) {
		t.Fatalf("metrics of a missing sandbox: %v", err)
	}
}

// ctxPauser is a fake backend whose Pause waits for release and keeps what
// its context looked like on entry and at the release.
type ctxPauser struct {
	blockingRuntime
	entered  chan struct{}
	release  chan struct{}
	left     time.Duration // until the context's deadline, on entry; 0: none
	endedErr error         // the context's error at the release
}

func (r *ctxPauser) Pause(ctx context.Context, _ string) error {
	if dl, ok := ctx.Deadline(); ok {
		r.left = time.Until(dl)
	}
	r.entered <- struct{}{}
	<-r.release
	r.endedErr = ctx.Err()
	return r.endedErr
}

func (r *ctxPauser) Resume(context.Context, string) error { return nil }

// The backend's freeze gets a deadline of its own, long enough for its
// retries, and does not end when the caller gives up: the pause completes
// and is recorded.
func TestPauseGivesBackendItsOwnDeadline(t *testing.T) {
	now := time.Now().UTC()
	rec := &record{ID: sandboxid.New("t001"), Backend: "fake", State: stateRunning,
		Spec:      specRecord{Backend: "fake", TimeoutSec: 3600},
		CreatedAt: now, ExpiresAt: now.Add(time.Hour), StateDir: filepath.Join(t.TempDir(), "sb")}
	rt := &ctxPauser{blockingRuntime: blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}},
		entered: make(chan struct{}, 1), release: make(chan struct{})}
	n := openRecorded(t, rt, rec)
	ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
	type result struct {
		rec *record
		err error
	}
	done := make(chan result, 1)
	go func() {
		r, err := n.Pause(ctx, rec.ID)
		done <- result{r, err}
	}()
	select {
	case <-rt.entered:
	case <-time.After(10 * time.Second):
		close(rt.release)
		t.Fatal("the pause never reached the backend")
	}
	cancel() // the caller gives up while the freeze runs
	close(rt.release)
	res := <-done
	if rt.left < 10*time.Second || rt.left > freezeDeadline {
		t.Errorf("backend's freeze deadline %s away, want within %s and at least 10 s (the container backend's retry budget)", rt.left, freezeDeadline)
	}
	if rt.endedErr != nil {
		t.Errorf("the backend's context ended with its caller's: %v", rt.endedErr)
	}
	if res.err != nil || res.rec == nil || res.rec.State != statePaused {
		t.Fatalf("pause whose caller gave up during the freeze: %+v, %v; want it paused and recorded", res.rec, res.err)
	}
	if got := stateOf(t, n, rec.ID); got != statePaused {
		t.Fatalf("state after the pause = %s, want paused", got)
	}
}
