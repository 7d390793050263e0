package node

import (
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/container"
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
	// Exec through the node's agent path is refused with a clear error.
	srv := httptest.NewServer(n1.AgentProxy())
	resp, err := http.Get(srv.URL + AgentPrefix + rec.ID + "/health")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	srv.Close()
	if resp.StatusCode != errdefs.HTTPStatus(errdefs.ErrFailedPrecondition) || !strings.Contains(string(body), "paused; resume it first") {
		t.Fatalf("agent request to a paused sandbox: %d %s", resp.StatusCode, body)
	}
	n1.Close()

	rt2, err := container.New(container.Config{})
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
	if _, err := n2.Resume(t.Context(), rec.ID, 0); err != nil {
		t.Fatal(err)
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

func TestPausedNotReapedAndClockStops(t *testing.T) {
	f := newFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 2, IdleSec: 1})
	paused, err := n.Pause(t.Context(), rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	left := paused.ExpiresAt.Sub(paused.PausedAt)
	// Both timeouts pass while paused; there is no event to wait for.
	time.Sleep(3 * time.Second)
	if got := stateOf(t, n, rec.ID); got != statePaused {
		t.Fatalf("state after both timeouts passed while paused = %s, want paused", got)
	}
	resumed, err := n.Resume(t.Context(), rec.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := time.Until(resumed.ExpiresAt); got > left || got < left-time.Second {
		t.Fatalf("lifetime after resume = %s, want the %s left at the pause", got, left)
	}
	// And then the lifetime clock runs again.
	waitGone(t, n, rec.ID, 10*time.Second)
}

func TestAutoPause(t *testing.T) {
	f := newFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 1, AutoPause: true})
	deadline := time.Now().Add(10 * time.Second)
	for stateOf(t, n, rec.ID) != statePaused {
		if time.Now().After(deadline) {
			t.Fatalf("auto_pause sandbox not paused 10 s after its 1 s timeout")
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
	mustBackendState(t, f.rt, rec.ID, runtime.StatePaused)
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
	f := newFixture(t)
	n := f.open(t)
	var job []string
	for range 3 {
		job = append(job, f.create(t, n, specRecord{TaskID: "job1", Labels: map[string]string{"k": "v"}}).ID)
	}
	other := f.create(t, n, specRecord{TaskID: "job2"}).ID
	if _, err := n.PauseMatching(t.Context(), Selector{}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("empty selector: %v, want invalid argument", err)
	}
	rs, err := n.PauseMatching(t.Context(), Selector{TaskID: "job1"})
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
		mustBackendState(t, f.rt, id, runtime.StatePaused)
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
	if m.MemoryBytes <= 0 || m.MemoryLimitBytes != 64<<20 || m.Pids < 1 || m.CPUCount != DefaultCPU || m.CPUNanos == 0 {
		t.Fatalf("metrics %+v", m)
	}
	if m.CPUUsedPct <= 0 || m.CPUUsedPct > 100 {
		t.Fatalf("cpu used %.3f%%, want within (0, 100]", m.CPUUsedPct)
	}
	if _, err := n.Metrics(t.Context(), "t001nosuchsandbox"); !errdefs.IsNotFound(err) {
		t.Fatalf("metrics of a missing sandbox: %v", err)
	}
}
