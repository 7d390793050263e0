package apiserver_test

import (
	"testing"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// TestForkRoutesToTheSourcesNode: a fork goes to the node of the source's
// ID and its forks live there; bad counts and another node as target are
// refused before any node makes anything; another principal's sandbox is
// not found.
func TestForkRoutesToTheSourcesNode(t *testing.T) {
	c := newRealCluster(t, "n001", "n002")
	ctx := t.Context()
	var srcs []*v1.Sandbox
	for range 4 { // placement spreads them over both nodes
		r, err := c.sbx.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", TaskId: "t"}}))
		if err != nil {
			t.Fatal(err)
		}
		srcs = append(srcs, r.Msg.GetSandbox())
	}
	count := func() int {
		n := 0
		for _, nd := range c.nodes {
			_, _, k := nd.Usage()
			n += k
		}
		return n
	}
	for _, src := range srcs {
		r, err := c.sbx.ForkSandbox(ctx, connect.NewRequest(&v1.ForkSandboxRequest{SandboxId: src.GetId(), Count: 2, RequestId: "f-" + src.GetId()}))
		if err != nil {
			t.Fatalf("fork %s: %v", src.GetId(), err)
		}
		if len(r.Msg.GetForks()) != 2 {
			t.Fatalf("%d forks", len(r.Msg.GetForks()))
		}
		for _, f := range r.Msg.GetForks() {
			sb := f.GetSandbox()
			if sb.GetNodeId() != src.GetNodeId() || sb.GetId()[:4] != src.GetId()[:4] || sb.GetParentId() != src.GetId() ||
				sb.GetOwner() != "alice" || sb.GetSpec().GetTaskId() != "t" {
				t.Errorf("fork of %s on %s: %v", src.GetId(), src.GetNodeId(), sb)
			}
			g, err := c.sbx.GetSandbox(ctx, connect.NewRequest(&v1.GetSandboxRequest{Id: sb.GetId()}))
			if err != nil || g.Msg.GetSandbox().GetParentId() != src.GetId() {
				t.Errorf("get fork %s: parent %q, %v", sb.GetId(), g.Msg.GetSandbox().GetParentId(), err)
			}
		}
	}
	if n := count(); n != 4*3 {
		t.Fatalf("%d sandboxes, want 12", n)
	}
	src := srcs[0]
	other := "n002"
	if src.GetNodeId() == "n002" {
		other = "n001"
	}
	bob := c.client("bob")
	for _, tc := range []struct {
		name string
		bob  bool
		req  *v1.ForkSandboxRequest
		code connect.Code
	}{
		{"count 0", false, &v1.ForkSandboxRequest{SandboxId: src.GetId()}, connect.CodeInvalidArgument},
		{"count 65", false, &v1.ForkSandboxRequest{SandboxId: src.GetId(), Count: 65}, connect.CodeInvalidArgument},
		{"another node", false, &v1.ForkSandboxRequest{SandboxId: src.GetId(), Count: 1, TargetNode: other}, connect.CodeUnimplemented},
		{"malformed id", false, &v1.ForkSandboxRequest{SandboxId: "x", Count: 1}, connect.CodeInvalidArgument},
		{"unknown", false, &v1.ForkSandboxRequest{SandboxId: src.GetId()[:4] + "aaaaaaaaaaaaaaaa", Count: 1}, connect.CodeNotFound},
		{"bob forks alice's", true, &v1.ForkSandboxRequest{SandboxId: src.GetId(), Count: 1}, connect.CodeNotFound},
	} {
		cl := c.sbx
		if tc.bob {
			cl = bob
		}
		_, err := cl.ForkSandbox(ctx, connect.NewRequest(tc.req))
		if connect.CodeOf(err) != tc.code {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.code)
		}
		if n := count(); n != 12 {
			t.Fatalf("%s changed the sandbox count to %d", tc.name, n)
		}
	}
	// A retry returns the same forks.
	r1, err := c.sbx.ForkSandbox(ctx, connect.NewRequest(&v1.ForkSandboxRequest{SandboxId: src.GetId(), Count: 2, RequestId: "f-" + src.GetId()}))
	if err != nil || len(r1.Msg.GetForks()) != 2 || count() != 12 {
		t.Fatalf("retry: %v, %d sandboxes", err, count())
	}
}
