package apiserver_test

import (
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// TestPrewarm: one node holds what it can; bad input is refused naming the
// field before or at the node.
func TestPrewarm(t *testing.T) {
	e := setup(t, nil, "n001")
	resp, err := e.sbx.PrewarmSandboxes(t.Context(), connect.NewRequest(&v1.PrewarmSandboxesRequest{Spec: busybox(), Count: 5, TtlSeconds: 60}))
	if err != nil {
		t.Fatal(err)
	}
	if m := resp.Msg; m.GetHeld() != 5 || m.GetReady() != 5 || m.GetReason() != "" || m.GetTtlSeconds() != 600 || len(m.GetNodes()) != 1 {
		t.Fatalf("prewarm 5: %v", m)
	}
	// More than the node can hold: fewer, with its reason.
	resp, err = e.sbx.PrewarmSandboxes(t.Context(), connect.NewRequest(&v1.PrewarmSandboxesRequest{Spec: busybox(), Count: 12}))
	if err != nil {
		t.Fatal(err)
	}
	if m := resp.Msg; m.GetHeld() != 8 || !strings.HasPrefix(m.GetReason(), "capacity: node n001") {
		t.Fatalf("prewarm 12 on a node with room for 8: %v", m)
	}
	for _, tc := range []struct {
		field string
		req   *v1.PrewarmSandboxesRequest
	}{
		{"count", &v1.PrewarmSandboxesRequest{Spec: busybox()}},
		{"count", &v1.PrewarmSandboxesRequest{Spec: busybox(), Count: -1}},
		{"count", &v1.PrewarmSandboxesRequest{Spec: busybox(), Count: 17}}, // above the node's bound
		{"ttl_seconds", &v1.PrewarmSandboxesRequest{Spec: busybox(), Count: 1, TtlSeconds: -1}},
		{"ttl_seconds", &v1.PrewarmSandboxesRequest{Spec: busybox(), Count: 1, TtlSeconds: 86401}},
		{"spec", &v1.PrewarmSandboxesRequest{Count: 1}},
		{"image", &v1.PrewarmSandboxesRequest{Spec: &v1.SandboxSpec{Image: "no/such:image"}, Count: 1}},
		{"cpu", &v1.PrewarmSandboxesRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", Cpu: 64}, Count: 1}},
		{"memory_mb", &v1.PrewarmSandboxesRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", MemoryMb: proto.Int64(1 << 20)}, Count: 1}},
		{"backend", &v1.PrewarmSandboxesRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", Backend: "vm"}, Count: 1}},
	} {
		_, err := e.sbx.PrewarmSandboxes(t.Context(), connect.NewRequest(tc.req))
		wantField(t, err, tc.field)
	}
	e.nodes[0].mu.Lock()
	defer e.nodes[0].mu.Unlock()
	if got := e.nodes[0].prewarms; !slices.Equal(got, []int32{5, 12}) {
		t.Fatalf("node saw prewarms %v, want [5 12]", got)
	}
}

// TestPrewarmSplitsAcrossNodes: what the first node cannot hold is asked
// of the next, in placement's order.
func TestPrewarmSplitsAcrossNodes(t *testing.T) {
	e := setup(t, nil, "n001", "n002")
	resp, err := e.sbx.PrewarmSandboxes(t.Context(), connect.NewRequest(&v1.PrewarmSandboxesRequest{Spec: busybox(), Count: 12}))
	if err != nil {
		t.Fatal(err)
	}
	m := resp.Msg
	if m.GetHeld() != 12 || m.GetReason() != "" || len(m.GetNodes()) != 2 || m.GetNodes()[0].GetHeld() != 8 || m.GetNodes()[1].GetHeld() != 4 {
		t.Fatalf("prewarm 12 on two nodes with room for 8 each: %v", m)
	}
}
