package apiserver_test

import (
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
)

// TestSnapshotRouting: a create with spec.snapshot is resolved with the
// snapshot's node before placement (its image, its source's spec as the
// defaults, the create's own fields on top) and may land on any node; a
// memory snapshot's creates all go to its node; get, delete and create
// route by the ID prefix; list merges every node's; bad input names the
// field and creates nothing.
func TestSnapshotRouting(t *testing.T) {
	e := setup(t, nil, "n001", "n002")
	c := opendsecv1connect.NewSnapshotServiceClient(auth.Client(e.hc, e.tok), e.url, connect.WithGRPC())
	fs := &nodev1.Snapshot{Id: "n002ffffffffffffffff", Name: "fs", NodeId: "n002", Image: "snapshot/n002ffffffffffffffff", CreatedAt: timestamppb.Now(),
		Spec: &nodev1.SandboxSpec{Image: "root/busybox", Cpu: 0.5, MemoryMb: proto.Int64(256), Env: map[string]string{"A": "1", "B": "2"}}}
	mem := &nodev1.Snapshot{Id: "n002mmmmmmmmmmmmmmmm", Name: "mem", NodeId: "n002", Memory: true, CreatedAt: timestamppb.Now(),
		Spec: &nodev1.SandboxSpec{Image: "root/busybox", Cpu: 0.25}}
	e.nodes[1].set(func(n *fakeNode) { n.snaps[fs.Id], n.snaps[mem.Id] = fs, mem })
	for _, n := range e.nodes {
		n.set(func(n *fakeNode) { n.images = append(n.images, fs.Image, "snapshot/"+mem.Id) })
	}
	create := func(spec *v1.SandboxSpec) (*v1.Sandbox, error) {
		r, err := e.sbx.CreateSandbox(t.Context(), connect.NewRequest(&v1.CreateSandboxRequest{Spec: spec}))
		if err != nil {
			return nil, err
		}
		return r.Msg.GetSandbox(), nil
	}
	sb, err := create(&v1.SandboxSpec{Snapshot: fs.Id, Env: map[string]string{"B": "mine"}, MemoryMb: proto.Int64(128)})
	if err != nil {
		t.Fatalf("create from the snapshot: %v", err)
	}
	if s := sb.GetSpec(); s.GetImage() != fs.Image || s.GetSnapshot() != fs.Id || s.GetCpu() != 0.5 || s.GetMemoryMb() != 128 || s.GetEnv()["A"] != "1" || s.GetEnv()["B"] != "mine" {
		t.Fatalf("spec the node got: %v", s)
	}
	for range 6 {
		sb, err := create(&v1.SandboxSpec{Snapshot: mem.Id})
		if err != nil {
			t.Fatal(err)
		}
		if sb.GetNodeId() != "n002" {
			t.Fatalf("a create from a memory snapshot of n002 went to %s", sb.GetNodeId())
		}
	}
	before := 0
	for _, n := range e.nodes {
		c, _ := n.count()
		before += c
	}
	for _, bad := range []struct {
		what  string
		spec  *v1.SandboxSpec
		code  connect.Code
		field string
	}{
		{"unknown snapshot", &v1.SandboxSpec{Snapshot: "n001aaaaaaaaaaaaaaaa"}, connect.CodeNotFound, "snapshot"},
		{"snapshot of an unknown node", &v1.SandboxSpec{Snapshot: "n009aaaaaaaaaaaaaaaa"}, connect.CodeNotFound, "snapshot"},
		{"malformed snapshot", &v1.SandboxSpec{Snapshot: "x/y"}, connect.CodeInvalidArgument, "snapshot"},
		{"image and snapshot", &v1.SandboxSpec{Snapshot: fs.Id, Image: "root/busybox"}, connect.CodeInvalidArgument, "snapshot"},
		{"a snapshot's image by name", &v1.SandboxSpec{Image: fs.Image}, connect.CodeInvalidArgument, "image"},
	} {
		_, err := create(bad.spec)
		if connect.CodeOf(err) != bad.code || !strings.Contains(err.Error(), bad.field) {
			t.Errorf("%s: %v, want %s naming %s", bad.what, err, bad.code, bad.field)
		}
	}
	after := 0
	for _, n := range e.nodes {
		c, _ := n.count()
		after += c
	}
	if after != before {
		t.Fatalf("bad creates reached the nodes (%d creates, then %d)", before, after)
	}

	src, err := create(&v1.SandboxSpec{Image: "root/busybox"})
	if err != nil {
		t.Fatal(err)
	}
	made, err := c.CreateSnapshot(t.Context(), connect.NewRequest(&v1.CreateSnapshotRequest{SandboxId: src.GetId(), Name: "new"}))
	if err != nil || made.Msg.GetSnapshot().GetNodeId() != src.GetNodeId() {
		t.Fatalf("snapshot goes to the source's node %s: %v %v", src.GetNodeId(), made, err)
	}
	if _, err := c.CreateSnapshot(t.Context(), connect.NewRequest(&v1.CreateSnapshotRequest{SandboxId: src.GetId(), Name: "a/b"})); connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "name") {
		t.Fatalf("bad name: %v", err)
	}
	l, err := c.ListSnapshots(t.Context(), connect.NewRequest(&v1.ListSnapshotsRequest{}))
	if err != nil || len(l.Msg.GetSnapshots()) != 3 {
		t.Fatalf("list merges both nodes: %v %v", l, err)
	}
	if g, err := c.GetSnapshot(t.Context(), connect.NewRequest(&v1.GetSnapshotRequest{Id: fs.Id})); err != nil || g.Msg.GetSnapshot().GetName() != "fs" {
		t.Fatalf("get: %v %v", g, err)
	}
	if _, err := c.DeleteSnapshot(t.Context(), connect.NewRequest(&v1.DeleteSnapshotRequest{Id: fs.Id})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetSnapshot(t.Context(), connect.NewRequest(&v1.GetSnapshotRequest{Id: fs.Id})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("get after delete: %v", err)
	}
}
