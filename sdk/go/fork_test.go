package opendsec_test

import (
	"testing"

	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestForkSandbox(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	ctx := t.Context()
	src, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox", TaskId: "job", Labels: map[string]string{"k": "v"}})
	if err != nil {
		t.Fatal(err)
	}
	srv.PutFile(src.GetId(), "/tmp/a", []byte("x"))
	out, err := c.ForkSandbox(ctx, src.GetId(), 3, opendsec.ForkOptions{RequestID: "r1"})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Forks) != 3 || out.SourceFrozen <= 0 {
		t.Fatalf("fork: %+v", out)
	}
	seen := map[string]bool{}
	for _, f := range out.Forks {
		sb := f.Sandbox
		if seen[sb.GetId()] || sb.GetId() == src.GetId() || sb.GetParentId() != src.GetId() || sb.GetSpec().GetTaskId() != "job" || f.MemoryPreserved {
			t.Errorf("fork %v memory_preserved %v", sb, f.MemoryPreserved)
		}
		seen[sb.GetId()] = true
		if b, ok := srv.File(sb.GetId(), "/tmp/a"); !ok || string(b) != "x" {
			t.Errorf("fork %s lacks the source's file", sb.GetId())
		}
	}
	again, err := c.ForkSandbox(ctx, src.GetId(), 3, opendsec.ForkOptions{RequestID: "r1"})
	if err != nil || len(again.Forks) != 3 || !seen[again.Forks[0].Sandbox.GetId()] {
		t.Fatalf("retry with the same request ID: %+v %v", again, err)
	}
	if n := len(srv.Sandboxes()); n != 4 {
		t.Fatalf("%d sandboxes after a fork and its retry, want 4", n)
	}
	for _, n := range []int{0, 65} {
		if _, err := c.ForkSandbox(ctx, src.GetId(), n, opendsec.ForkOptions{}); !opendsec.IsInvalidArgument(err) {
			t.Errorf("count %d: %v, want invalid argument", n, err)
		}
	}
	if _, err := c.ForkSandbox(ctx, "", 1, opendsec.ForkOptions{}); !opendsec.IsInvalidArgument(err) {
		t.Errorf("empty id: %v", err)
	}
	if _, err := c.ForkSandbox(ctx, "nosuch", 1, opendsec.ForkOptions{}); !opendsec.IsNotFound(err) {
		t.Errorf("unknown sandbox: %v", err)
	}
}
