package apiserver_test

import (
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/apiserver"
)

// A task pause with reclaim over two nodes lists what every sandbox freed
// and sums it across the nodes.
func TestPauseSandboxesReclaimSumsAcrossNodes(t *testing.T) {
	e := setup(t, nil, "n001", "n002")
	var job []*v1.Sandbox
	perNode := map[string]int{}
	for len(job) < 6 || len(perNode) < 2 {
		if len(job) == 64 {
			t.Fatalf("placement used %d nodes for %d sandboxes; the test needs both", len(perNode), len(job))
		}
		sb := e.create(&v1.SandboxSpec{Image: "root/busybox", TaskId: "job"})
		job = append(job, sb)
		perNode[sb.GetNodeId()]++
	}
	resp, err := e.sbx.PauseSandboxes(t.Context(), connect.NewRequest(&v1.PauseSandboxesRequest{
		Selector: &v1.SandboxSelector{TaskId: "job"}, Reclaim: true}))
	if err != nil {
		t.Fatal(err)
	}
	m := resp.Msg
	if len(m.GetSandboxes()) != len(job) || len(m.GetReclaimed()) != len(job) {
		t.Fatalf("paused %d, reclaimed %d; want %d each", len(m.GetSandboxes()), len(m.GetReclaimed()), len(job))
	}
	seen := map[string]bool{}
	for _, r := range m.GetReclaimed() {
		if r.GetBytesFreed() != fakeReclaimBytes || seen[r.GetSandboxId()] {
			t.Fatalf("reclaim %+v (twice: %v)", r, seen[r.GetSandboxId()])
		}
		seen[r.GetSandboxId()] = true
	}
	if want := int64(len(job)) * fakeReclaimBytes; m.GetBytesFreed() != want {
		t.Fatalf("bytes_freed %d, want %d (the sum over both nodes)", m.GetBytesFreed(), want)
	}
	// Without reclaim: nothing reported.
	resp, err = e.sbx.PauseSandboxes(t.Context(), connect.NewRequest(&v1.PauseSandboxesRequest{Selector: &v1.SandboxSelector{TaskId: "job"}}))
	if err != nil || len(resp.Msg.GetReclaimed()) != 0 || resp.Msg.GetBytesFreed() != 0 {
		t.Fatalf("pause without reclaim: %v %v", resp, err)
	}
}

// A pause or resume of a task (or labels) no node has is not_found naming
// the task, not an empty success.
func TestBatchPauseUnknownTaskNotFound(t *testing.T) {
	e := setup(t, nil, "n001", "n002")
	e.create(&v1.SandboxSpec{Image: "root/busybox", TaskId: "job"})
	_, err := e.sbx.PauseSandboxes(t.Context(), connect.NewRequest(&v1.PauseSandboxesRequest{
		Selector: &v1.SandboxSelector{TaskId: "nosuch"}, Reclaim: true}))
	if connect.CodeOf(err) != connect.CodeNotFound || !strings.Contains(err.Error(), "task nosuch") || !strings.Contains(err.Error(), "task_id") {
		t.Fatalf("pause of an unknown task: %v, want not_found naming task nosuch and task_id", err)
	}
	_, err = e.sbx.ResumeSandboxes(t.Context(), connect.NewRequest(&v1.ResumeSandboxesRequest{Selector: &v1.SandboxSelector{TaskId: "nosuch"}}))
	if connect.CodeOf(err) != connect.CodeNotFound || !strings.Contains(err.Error(), "task nosuch") {
		t.Fatalf("resume of an unknown task: %v, want not_found", err)
	}
	got, err := e.sbx.ListSandboxes(t.Context(), connect.NewRequest(&v1.ListSandboxesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range got.Msg.GetSandboxes() {
		if sb.GetState() != v1.SandboxState_SANDBOX_STATE_RUNNING {
			t.Fatalf("an unknown task's pause changed %s: %s", sb.GetId(), sb.GetState())
		}
	}
}

// A pause with reclaim gives each node ReclaimNodeTimeout, not the shorter
// BatchNodeTimeout: pushing memory out takes longer than freezing.
func TestPauseWithReclaimGetsTheLongerNodeTimeout(t *testing.T) {
	for _, c := range []struct {
		name    string
		reclaim time.Duration
		ok      bool
	}{{"within ReclaimNodeTimeout", 10 * time.Second, true}, {"past ReclaimNodeTimeout", 150 * time.Millisecond, false}} {
		t.Run(c.name, func(t *testing.T) {
			e := setup(t, func(cfg *apiserver.Config) {
				cfg.BatchNodeTimeout, cfg.ReclaimNodeTimeout = 100*time.Millisecond, c.reclaim
			}, "n001")
			e.nodes[0].reclaimDelay = 400 * time.Millisecond
			e.create(&v1.SandboxSpec{Image: "root/busybox", TaskId: "job"})
			resp, err := e.sbx.PauseSandboxes(t.Context(), connect.NewRequest(&v1.PauseSandboxesRequest{
				Selector: &v1.SandboxSelector{TaskId: "job"}, Reclaim: true}))
			if err != nil {
				t.Fatal(err)
			}
			f := resp.Msg.GetFailures()
			if c.ok && (len(f) != 0 || resp.Msg.GetBytesFreed() != fakeReclaimBytes) {
				t.Fatalf("pause with reclaim within the reclaim timeout: failures %v, freed %d", f, resp.Msg.GetBytesFreed())
			}
			if !c.ok && (len(f) != 1 || !strings.Contains(f[0].GetErrorMessage(), "n001")) {
				t.Fatalf("pause with reclaim past the reclaim timeout: failures %v, want the node's", f)
			}
		})
	}
}
