//go:build linux

package e2e

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
)

// principal is a user-scope caller of the system: its sandbox and
// snapshot clients.
type principal struct {
	sandboxes opendsecv1connect.SandboxServiceClient
	snapshots opendsecv1connect.SnapshotServiceClient
	processes opendsecv1connect.ProcessServiceClient
}

func (s *system) principal(t *testing.T, name string) principal {
	t.Helper()
	key, err := auth.LoadIssuer(filepath.Join(s.DataDir(), "auth.ed25519"))
	if err != nil {
		t.Fatal(err)
	}
	tok, err := key.Issue(name, auth.ScopeUser, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	hc, o := s.HTTPClient(), s.Opts(tok)
	return principal{
		sandboxes: opendsecv1connect.NewSandboxServiceClient(hc, s.Endpoint(), o...),
		snapshots: opendsecv1connect.NewSnapshotServiceClient(hc, s.Endpoint(), o...),
		processes: opendsecv1connect.NewProcessServiceClient(hc, s.Endpoint(), o...),
	}
}

func (p principal) create(t *testing.T, spec *opendsecv1.SandboxSpec) (*opendsecv1.Sandbox, error) {
	t.Helper()
	r, err := p.sandboxes.CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{Spec: spec}))
	if err != nil {
		return nil, err
	}
	return r.Msg.GetSandbox(), nil
}

func (p principal) snapshot(t *testing.T, id, name string) (*opendsecv1.Snapshot, error) {
	t.Helper()
	r, err := p.snapshots.CreateSnapshot(t.Context(), connect.NewRequest(&opendsecv1.CreateSnapshotRequest{SandboxId: id, Name: name}))
	if err != nil {
		return nil, err
	}
	return r.Msg.GetSnapshot(), nil
}

// hostState is what a refused call must leave alone: the node's sandboxes
// (every owner's), the image store's images and the host's mounts.
func (s *system) hostState(t *testing.T) string {
	t.Helper()
	s.waitTeardowns(t)
	l, err := s.Sandboxes().ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, sb := range l.Msg.GetSandboxes() {
		ids = append(ids, sb.GetId()+":"+sb.GetState().String())
	}
	imgs, err := s.Client(t).ListImages(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, im := range imgs {
		ids = append(ids, "image:"+im.GetName())
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var mounts []string
	for _, line := range strings.Split(string(mi), "\n") {
		if f := strings.Fields(line); len(f) > 4 {
			mounts = append(mounts, f[4])
		}
	}
	slices.Sort(ids)
	slices.Sort(mounts)
	return strings.Join(ids, "\n") + "\n--mounts--\n" + strings.Join(mounts, "\n")
}

// TestSnapshots: files written in a container, snapshotted, are in two
// new sandboxes started from the snapshot (with the source's env as
// defaults), a write in one is invisible to the other, and the source
// keeps running; bad input (a name with '/', a 300-character name, a
// stopped sandbox, another principal's sandbox or snapshot, an unknown
// snapshot, image and snapshot together) is a clear error naming the
// field and changes no sandbox, image or mount; delete removes the
// snapshot's image while a sandbox started from it keeps working.
func TestSnapshots(t *testing.T) {
	s := newSystem(t)
	s.Start()
	alice, bob := s.principal(t, "alice"), s.principal(t, "bob")
	src, err := alice.create(t, &opendsecv1.SandboxSpec{Image: "root/busybox", Env: map[string]string{"FROM": "src"}, Labels: map[string]string{"kind": "src"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := s.shell(t, src.Id, "mkdir -p /opt/state && echo saved > /opt/state/f && rm /bin/true && echo ok"); r.stdout != "ok\n" {
		t.Fatalf("write files: %+v", r)
	}
	snap, err := alice.snapshot(t, src.Id, "e2e-snap")
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	if snap.GetMemory() || snap.GetImage() != "snapshot/"+snap.GetId() || snap.GetSourceSandboxId() != src.Id || snap.GetOwner() != "alice" ||
		snap.GetSpec().GetImage() != "root/busybox" || snap.GetSizeBytes() <= 0 || snap.GetNodeId() != src.GetNodeId() {
		t.Fatalf("snapshot %v", snap)
	}
	if r := s.shell(t, src.Id, "cat /opt/state/f"); r.stdout != "saved\n" {
		t.Fatalf("source after the snapshot: %+v", r)
	}

	// One create and a batch of two.
	one, err := alice.create(t, &opendsecv1.SandboxSpec{Snapshot: snap.GetId()})
	if err != nil {
		t.Fatalf("create from the snapshot: %v", err)
	}
	froms := []*opendsecv1.Sandbox{one}
	st, err := alice.sandboxes.BatchCreateSandboxes(t.Context(), connect.NewRequest(&opendsecv1.BatchCreateSandboxesRequest{
		Spec: &opendsecv1.SandboxSpec{Snapshot: snap.GetId()}, Count: 2}))
	if err != nil {
		t.Fatal(err)
	}
	for st.Receive() {
		if m := st.Msg(); m.GetErrorCode() != "" {
			t.Fatalf("batch item %d: %s %s", m.GetIndex(), m.GetErrorCode(), m.GetErrorMessage())
		}
		froms = append(froms, st.Msg().GetSandbox())
	}
	if err := st.Err(); err != nil || len(froms) != 3 {
		t.Fatalf("batch create from the snapshot: %d sandboxes, %v", len(froms), err)
	}
	for _, sb := range froms {
		if sb.GetSpec().GetSnapshot() != snap.GetId() || sb.GetSpec().GetEnv()["FROM"] != "src" || sb.GetSpec().GetLabels()["kind"] != "src" {
			t.Fatalf("spec of a sandbox from the snapshot: %v", sb.GetSpec())
		}
	}
	for _, sb := range froms {
		if r := s.shell(t, sb.Id, "cat /opt/state/f; echo $FROM; test -e /bin/true || echo deleted"); r.stdout != "saved\nsrc\ndeleted\n" {
			t.Fatalf("sandbox %s from the snapshot sees %q, want the source's files and env", sb.Id, r.stdout)
		}
	}
	s.shell(t, froms[0].Id, "echo mine > /opt/state/g")
	if r := s.shell(t, froms[1].Id, "cat /opt/state/g 2>/dev/null || echo absent"); r.stdout != "absent\n" {
		t.Fatalf("a write in one sandbox from the snapshot shows in another: %q", r.stdout)
	}
	if r := s.shell(t, src.Id, "cat /opt/state/g 2>/dev/null || echo absent"); r.stdout != "absent\n" {
		t.Fatalf("a write in a sandbox from the snapshot shows in the source: %q", r.stdout)
	}

	stopped, err := alice.create(t, &opendsecv1.SandboxSpec{Image: "root/busybox"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := alice.sandboxes.StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: stopped.Id})); err != nil {
		t.Fatal(err)
	}
	before := s.hostState(t)
	_, err = alice.snapshot(t, src.Id, "a/b")
	wantErr(t, "snapshot name with /", err, connect.CodeInvalidArgument, "name")
	_, err = alice.snapshot(t, src.Id, strings.Repeat("n", 300))
	wantErr(t, "snapshot name of 300 characters", err, connect.CodeInvalidArgument, "name")
	_, err = alice.snapshot(t, src.Id, "e2e-snap")
	wantErr(t, "repeated snapshot name", err, connect.CodeAlreadyExists, "name")
	_, err = alice.snapshot(t, stopped.Id, "")
	wantErr(t, "snapshot of a stopped sandbox", err, connect.CodeNotFound, "sandbox_id")
	_, err = bob.snapshot(t, src.Id, "")
	wantErr(t, "snapshot of another principal's sandbox", err, connect.CodeNotFound, "sandbox_id")
	_, err = bob.create(t, &opendsecv1.SandboxSpec{Snapshot: snap.GetId()})
	wantErr(t, "create from another principal's snapshot", err, connect.CodeNotFound, "snapshot")
	_, err = alice.create(t, &opendsecv1.SandboxSpec{Snapshot: src.GetNodeId() + "aaaaaaaaaaaaaaaa"})
	wantErr(t, "create from an unknown snapshot", err, connect.CodeNotFound, "snapshot")
	_, err = alice.create(t, &opendsecv1.SandboxSpec{Snapshot: "not-a-snapshot"})
	wantErr(t, "create from a malformed snapshot ID", err, connect.CodeInvalidArgument, "snapshot")
	_, err = alice.create(t, &opendsecv1.SandboxSpec{Image: "root/busybox", Snapshot: snap.GetId()})
	wantErr(t, "create with image and snapshot", err, connect.CodeInvalidArgument, "snapshot")
	_, err = alice.create(t, &opendsecv1.SandboxSpec{Image: snap.GetImage()})
	wantErr(t, "create from a snapshot's image by name", err, connect.CodeInvalidArgument, "image")
	imgs := opendsecv1connect.NewImageServiceClient(s.HTTPClient(), s.Endpoint(), s.Opts(s.Token())...)
	_, err = imgs.PackDiff(t.Context(), connect.NewRequest(&opendsecv1.PackDiffRequest{SandboxId: src.Id, Name: "snapshot/" + src.Id}))
	wantErr(t, "pack_diff into the snapshots' names", err, connect.CodeInvalidArgument, "name")
	_, err = bob.snapshots.GetSnapshot(t.Context(), connect.NewRequest(&opendsecv1.GetSnapshotRequest{Id: snap.GetId()}))
	wantErr(t, "get another principal's snapshot", err, connect.CodeNotFound, "snapshot")
	_, err = bob.snapshots.DeleteSnapshot(t.Context(), connect.NewRequest(&opendsecv1.DeleteSnapshotRequest{Id: snap.GetId()}))
	wantErr(t, "delete another principal's snapshot", err, connect.CodeNotFound, "snapshot")
	if l, err := bob.snapshots.ListSnapshots(t.Context(), connect.NewRequest(&opendsecv1.ListSnapshotsRequest{})); err != nil || len(l.Msg.GetSnapshots()) != 0 {
		t.Fatalf("bob lists %v (%v), want none", l, err)
	}
	if after := s.hostState(t); after != before {
		t.Fatalf("bad input changed the node:\nbefore:\n%s\nafter:\n%s", before, after)
	}

	l, err := alice.snapshots.ListSnapshots(t.Context(), connect.NewRequest(&opendsecv1.ListSnapshotsRequest{}))
	if err != nil || len(l.Msg.GetSnapshots()) != 1 || l.Msg.GetSnapshots()[0].GetId() != snap.GetId() {
		t.Fatalf("alice lists %v (%v), want her snapshot", l, err)
	}
	if _, err := alice.snapshots.DeleteSnapshot(t.Context(), connect.NewRequest(&opendsecv1.DeleteSnapshotRequest{Id: snap.GetId()})); err != nil {
		t.Fatalf("delete: %v", err)
	}
	left, err := s.Client(t).ListImages(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, im := range left {
		if strings.HasPrefix(im.GetName(), "snapshot/") {
			t.Fatalf("the deleted snapshot's image is still listed: %s", im.GetName())
		}
	}
	if r := s.shell(t, froms[0].Id, "cat /opt/state/f /opt/state/g"); r.stdout != "saved\nmine\n" {
		t.Fatalf("sandbox from the deleted snapshot: %+v", r)
	}
	_, err = alice.create(t, &opendsecv1.SandboxSpec{Snapshot: snap.GetId()})
	wantErr(t, "create from a deleted snapshot", err, connect.CodeNotFound, "snapshot")
}
