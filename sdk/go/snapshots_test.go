package opendsec_test

import (
	"bytes"
	"strings"
	"testing"

	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

// TestSnapshots: CreateSnapshot, a create from it (spec.Snapshot) with the
// source's files and env, List/Get/Delete, and the error helpers for bad
// names, repeated names and unknown snapshots.
func TestSnapshots(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	ctx := t.Context()
	src, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox", Env: map[string]string{"A": "1"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile(ctx, src.GetId(), "/tmp/x", strings.NewReader("saved"), 5); err != nil {
		t.Fatal(err)
	}
	snap, err := c.CreateSnapshot(ctx, src.GetId(), "s1")
	if err != nil || snap.GetName() != "s1" || snap.GetSourceSandboxId() != src.GetId() {
		t.Fatalf("CreateSnapshot = %v, %v", snap, err)
	}
	sb, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Snapshot: snap.GetId()})
	if err != nil || sb.GetSpec().GetEnv()["A"] != "1" || sb.GetSpec().GetSnapshot() != snap.GetId() {
		t.Fatalf("create from the snapshot = %v, %v", sb, err)
	}
	var buf bytes.Buffer
	if _, err := c.ReadFile(ctx, sb.GetId(), "/tmp/x", &buf); err != nil || buf.String() != "saved" {
		t.Fatalf("file in the sandbox from the snapshot: %q %v", buf.String(), err)
	}
	if _, err := c.CreateSnapshot(ctx, src.GetId(), "a/b"); !opendsec.IsInvalidArgument(err) {
		t.Fatalf("bad name: %v", err)
	}
	if _, err := c.CreateSnapshot(ctx, src.GetId(), "s1"); !opendsec.IsAlreadyExists(err) {
		t.Fatalf("repeated name: %v", err)
	}
	if l, err := c.ListSnapshots(ctx); err != nil || len(l) != 1 {
		t.Fatalf("ListSnapshots = %v, %v", l, err)
	}
	if g, err := c.GetSnapshot(ctx, snap.GetId()); err != nil || g.GetName() != "s1" {
		t.Fatalf("GetSnapshot = %v, %v", g, err)
	}
	if err := c.DeleteSnapshot(ctx, snap.GetId()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetSnapshot(ctx, snap.GetId()); !opendsec.IsNotFound(err) {
		t.Fatalf("get after delete: %v", err)
	}
	if _, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Snapshot: snap.GetId()}); !opendsec.IsNotFound(err) {
		t.Fatalf("create from a deleted snapshot: %v", err)
	}
}
