package node

import (
	"context"
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
)

// A task pause with reclaim reports what each sandbox freed (those paused
// already too) and the sum; the memory stays out until the resume, which
// brings every sandbox back.
func TestPauseMatchingReclaimSumsAndResumes(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	var job []string
	for range 3 {
		job = append(job, f.create(t, n, specRecord{TaskID: "job1"}).ID)
	}
	other := f.create(t, n, specRecord{TaskID: "job2"}).ID
	if _, err := n.Pause(t.Context(), job[0]); err != nil { // paused before: reclaimed too
		t.Fatal(err)
	}
	s := &service{n: n}
	resp, err := s.PauseSandboxes(t.Context(), connect.NewRequest(&nodev1.PauseSandboxesRequest{
		Selector: &nodev1.SandboxSelector{TaskId: "job1"}, Reclaim: true}))
	if err != nil {
		t.Fatal(err)
	}
	out := resp.Msg
	perSandbox := int64(1<<20 - runtimefake.FakeResidentBytes)
	if len(out.GetSandboxes()) != 3 || len(out.GetFailures()) != 0 || len(out.GetReclaimed()) != 3 {
		t.Fatalf("pause with reclaim: %d sandboxes, %d failures, %d reclaimed; want 3, 0, 3", len(out.GetSandboxes()), len(out.GetFailures()), len(out.GetReclaimed()))
	}
	seen := map[string]bool{}
	for _, r := range out.GetReclaimed() {
		seen[r.GetSandboxId()] = true
		if r.GetBytesFreed() != perSandbox || r.GetBytesBefore()-r.GetBytesAfter() != perSandbox || r.GetNote() != "" {
			t.Fatalf("reclaim of %s: %+v, want %d freed", r.GetSandboxId(), r, perSandbox)
		}
	}
	for _, id := range job {
		if !seen[id] {
			t.Fatalf("no reclaim result for %s", id)
		}
		if m, err := n.Metrics(t.Context(), id); err != nil || m.MemoryBytes != runtimefake.FakeResidentBytes {
			t.Fatalf("memory of reclaimed %s: %d (%v), want %d", id, m.MemoryBytes, err, runtimefake.FakeResidentBytes)
		}
	}
	if out.GetBytesFreed() != 3*perSandbox {
		t.Fatalf("bytes_freed %d, want %d", out.GetBytesFreed(), 3*perSandbox)
	}
	if got := stateOf(t, n, other); got != stateRunning {
		t.Fatalf("sandbox of another task is %s", got)
	}
	rs, err := n.ResumeMatching(t.Context(), Selector{TaskID: "job1"}, 0)
	if err != nil || len(rs) != 3 {
		t.Fatalf("resume: %d results, %v", len(rs), err)
	}
	for _, id := range job {
		if got := echo(t, f, id); got != "ok\n" {
			t.Fatalf("after resume: %q", got)
		}
		if m, err := n.Metrics(t.Context(), id); err != nil || m.MemoryBytes <= runtimefake.FakeResidentBytes {
			t.Fatalf("memory of resumed %s: %d (%v), want it back", id, m.MemoryBytes, err)
		}
	}
}

// Without reclaim nothing is reclaimed and no result says otherwise.
func TestPauseMatchingWithoutReclaim(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	f.create(t, n, specRecord{TaskID: "job"})
	rs, err := n.PauseMatching(t.Context(), Selector{TaskID: "job"}, false)
	if err != nil || len(rs) != 1 || rs[0].Err != nil || rs[0].Reclaim != nil {
		t.Fatalf("pause: %+v %v; want one paused, no reclaim", rs, err)
	}
	if f.fake.Calls(runtimefake.OpReclaim) != 0 {
		t.Fatalf("the backend was asked to reclaim")
	}
}

// A reclaim that fails leaves the sandbox paused and says why; one pause
// with reclaim reports its bytes.
func TestPauseReclaimFailureKeepsPause(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	a := f.create(t, n, specRecord{TaskID: "job"}).ID
	f.fake.Hook(runtimefake.OpReclaim, func(context.Context, string) error { return errors.New("kernel said no") })
	rs, err := n.PauseMatching(t.Context(), Selector{TaskID: "job"}, true)
	if err != nil || len(rs) != 1 || rs[0].Err != nil || rs[0].Reclaim == nil {
		t.Fatalf("pause: %+v %v; want one paused with a reclaim result", rs, err)
	}
	if r := rs[0].Reclaim; r.Freed() != 0 || !strings.Contains(r.Note, "kernel said no") {
		t.Fatalf("failed reclaim: %+v; want 0 freed and the reason", r)
	}
	if got := stateOf(t, n, a); got != statePaused {
		t.Fatalf("after a failed reclaim the sandbox is %s, want paused", got)
	}
	f.fake.Hook(runtimefake.OpReclaim, nil)
	s := &service{n: n}
	resp, err := s.PauseSandbox(t.Context(), connect.NewRequest(&nodev1.PauseSandboxRequest{SandboxId: a, Reclaim: true}))
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Msg.GetBytesFreed(); got != 1<<20-runtimefake.FakeResidentBytes {
		t.Fatalf("pause one with reclaim freed %d", got)
	}
	mustBackendState(t, f.fake, a, runtime.StatePaused)
}

// A task with no sandboxes on the node is an empty result here (the
// apiserver, which sees every node, turns that into not_found).
func TestPauseMatchingUnknownTask(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	f.create(t, n, specRecord{TaskID: "job"})
	rs, err := n.PauseMatching(t.Context(), Selector{TaskID: "nosuch"}, true)
	if err != nil || len(rs) != 0 {
		t.Fatalf("pause of an unknown task: %+v %v; want nothing", rs, err)
	}
	if f.fake.Calls(runtimefake.OpPause) != 0 || f.fake.Calls(runtimefake.OpReclaim) != 0 {
		t.Fatalf("the backend was asked to pause or reclaim")
	}
}
