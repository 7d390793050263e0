package apiserver_test

import (
	"strings"
	"testing"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
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
