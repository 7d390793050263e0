package node

import (
	"context"
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// diffOnly is the fake backend without runtime.Snapshotter: what the
// container backend offers (pause and rootfs diffs), so snapshots take the
// pack_diff path.
type diffOnly struct {
	runtime.Runtime
	fake *runtimefake.Runtime
}

func (d diffOnly) DiffRootfs(ctx context.Context, id string, fn func(context.Context, runtime.RootfsDiff) error) error {
	return d.fake.DiffRootfs(ctx, id, fn)
}
func (d diffOnly) Pause(ctx context.Context, id string) error  { return d.fake.Pause(ctx, id) }
func (d diffOnly) Resume(ctx context.Context, id string) error { return d.fake.Resume(ctx, id) }

// snapImages is the test image resolver plus a store of packed images:
// PackDiff keeps the diff's files under the new name, and Hold of a name
// starting with snapshot/ finds only those.
type snapImages struct {
	images
	smu    *sync.Mutex
	packed map[string]map[string][]byte // name → files; guarded by smu
	holds  map[string]string            // holder → name; guarded by smu
	// files keeps the files kept with images (imageFiles), as a store
	// shared by nodes would.
	files string
}

func (s snapImages) PutFile(_ context.Context, name, key, src string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	dir := filepath.Join(s.files, url.PathEscape(name))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, key), b, 0o600)
}

func (s snapImages) File(name, key string) (string, error) {
	p := filepath.Join(s.files, url.PathEscape(name), key)
	if _, err := os.Stat(p); err != nil {
		return "", errdefs.New(errdefs.ErrNotFound, "image %s has no file %s", name, key)
	}
	return p, nil
}

func newSnapImages(t *testing.T) snapImages {
	return snapImages{
		images: images{layer: t.TempDir(), mu: new(sync.Mutex), holds: map[string]bool{}},
		smu:    new(sync.Mutex), packed: map[string]map[string][]byte{}, holds: map[string]string{},
		files: t.TempDir(),
	}
}

func (s snapImages) Hold(ctx context.Context, name, holder string) (runtime.Image, error) {
	s.smu.Lock()
	_, ok := s.packed[name]
	s.smu.Unlock()
	if strings.HasPrefix(name, sandboxspec.SnapshotImagePrefix) && !ok {
		return runtime.Image{}, errdefs.New(errdefs.ErrNotFound, "image %q not found", name)
	}
	s.smu.Lock()
	s.holds[holder] = name
	s.smu.Unlock()
	return s.images.Hold(ctx, name, holder)
}

func (s snapImages) heldName(holder string) string {
	s.smu.Lock()
	defer s.smu.Unlock()
	return s.holds[holder]
}

func (s snapImages) names() []string {
	s.smu.Lock()
	defer s.smu.Unlock()
	var out []string
	for k := range s.packed {
		out = append(out, k)
	}
	return out
}

func (s snapImages) PackDiff(_ context.Context, req image.PackDiffRequest) (image.Image, error) {
	files := map[string][]byte{}
	err := filepath.Walk(req.Upper, func(p string, fi os.FileInfo, err error) error {
		if err != nil || fi.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		files["/"+strings.TrimPrefix(p, req.Upper+"/")] = b
		return err
	})
	if err != nil {
		return image.Image{}, err
	}
	s.smu.Lock()
	defer s.smu.Unlock()
	if _, ok := s.packed[req.Name]; ok {
		return image.Image{}, errdefs.New(errdefs.ErrAlreadyExists, "image %s exists", req.Name)
	}
	s.packed[req.Name] = files
	return image.Image{Name: req.Name, ID: "sha256:" + strings.Repeat("a", 64), Layers: []image.Layer{{Digest: "sha256:base", Size: 1}, {Digest: "sha256:new", Size: 42}}}, nil
}

func (s snapImages) Remove(_ context.Context, name string) error {
	s.smu.Lock()
	defer s.smu.Unlock()
	if _, ok := s.packed[name]; !ok {
		return errdefs.New(errdefs.ErrNotFound, "image %s not found", name)
	}
	delete(s.packed, name)
	return nil
}

// newSnapNode is a fake node whose backend takes pack_diff snapshots
// (diffOnly) unless backendSnapshots.
func newSnapNode(t *testing.T, backendSnapshots bool, stateDir string) (*fakeNode, snapImages) {
	t.Helper()
	imgs := newSnapImages(t)
	f := newFakeNode(t, func(c *Config) {
		c.Images = imgs
		if stateDir != "" {
			c.StateDir = stateDir
		}
		if !backendSnapshots {
			fake := c.Backends[runtimefake.Name].(*runtimefake.Runtime)
			c.Backends[runtimefake.Name] = diffOnly{Runtime: fake, fake: fake}
		}
	})
	return f, imgs
}

func alice() context.Context { return as("alice", auth.ScopeUser) }
func bob() context.Context   { return as("bob", auth.ScopeUser) }

func (f *fakeNode) createAs(t *testing.T, ctx context.Context, s specRecord) *record {
	t.Helper()
	c, _ := auth.FromContext(ctx)
	rec, err := f.Create(ctx, CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: s, Owner: c.Subject})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	return rec
}

// TestSnapshotPackDiff: a container-like backend's snapshot is its changes
// packed into the image snapshot/<id> (memory false); creates from it get
// that image and the source's spec as defaults (explicit fields win); the
// source keeps running; delete removes record and image, and a sandbox
// started from it keeps running.
func TestSnapshotPackDiff(t *testing.T) {
	f, imgs := newSnapNode(t, false, "")
	ctx := alice()
	src := f.createAs(t, ctx, specRecord{Image: "root/busybox", CPU: 0.5, MemoryMB: 256, Env: map[string]string{"A": "1", "B": "2"},
		Labels: map[string]string{"team": "x"}, Workdir: "/work", TimeoutSec: 600})
	if err := runtimetest.WriteFile(ctx, f.rt, src.ID, "/data/x", []byte("saved")); err != nil {
		t.Fatal(err)
	}
	snap, err := f.CreateSnapshot(ctx, src.ID, "after-setup")
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	if snap.Memory || snap.Image != "snapshot/"+snap.ID || snap.Name != "after-setup" || snap.Owner != "alice" ||
		snap.Source != src.ID || snap.SizeBytes != 42 || !strings.HasPrefix(snap.ID, "t001") || snap.Spec.CPU != 0.5 {
		t.Fatalf("snapshot record %+v", snap)
	}
	if got := imgs.packed[snap.Image]["/data/x"]; string(got) != "saved" {
		t.Fatalf("packed image has /data/x = %q, want the source's file", got)
	}
	if _, sb, err := f.Get(ctx, src.ID); err != nil || sb.rec.State != stateRunning {
		t.Fatalf("source after snapshot: %v", err)
	}
	from := f.createAs(t, ctx, specRecord{Snapshot: snap.ID, MemoryMB: 128, Env: map[string]string{"B": "mine"}})
	s := from.Spec
	if s.Image != snap.Image || s.Snapshot != snap.ID || s.CPU != 0.5 || s.MemoryMB != 128 || s.Workdir != "/work" ||
		s.Env["A"] != "1" || s.Env["B"] != "mine" || s.Labels["team"] != "x" || s.TimeoutSec != sandboxspec.DefaultTimeoutSec {
		t.Fatalf("spec of a create from the snapshot: %+v", s)
	}
	if h := imgs.heldName(from.ID); h != snap.Image {
		t.Fatalf("create from the snapshot holds %q, want %q", h, snap.Image)
	}
	if err := f.DeleteSnapshot(ctx, snap.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if len(imgs.names()) != 0 {
		t.Fatalf("images left after delete: %v", imgs.names())
	}
	if _, sb, err := f.Get(ctx, from.ID); err != nil || sb.rec.State != stateRunning {
		t.Fatalf("sandbox from the deleted snapshot: %v", err)
	}
	_, err = f.Create(ctx, CreateRequest{ID: sandboxid.New("t001"), Spec: specRecord{Snapshot: snap.ID}})
	if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "snapshot") {
		t.Fatalf("create from a deleted snapshot: %v, want not_found naming snapshot", err)
	}
	if _, err := f.GetSnapshot(ctx, snap.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("get after delete: %v", err)
	}
}

// TestSnapshotBackend: a backend with runtime.Snapshotter saves its own
// snapshot (memory as it says) and creates from it are restored from it.
func TestSnapshotBackend(t *testing.T) {
	f, imgs := newSnapNode(t, true, "")
	ctx := alice()
	src := f.createAs(t, ctx, specRecord{Image: "root/busybox", Env: map[string]string{"K": "v"}})
	if err := runtimetest.WriteFile(ctx, f.rt, src.ID, "/x", []byte("y")); err != nil {
		t.Fatal(err)
	}
	snap, err := f.CreateSnapshot(ctx, src.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	if !snap.Memory || snap.Image != "" || snap.Dir == "" || !strings.HasPrefix(snap.Name, src.ID+"-") {
		t.Fatalf("backend snapshot record %+v", snap)
	}
	if len(imgs.names()) != 0 {
		t.Fatalf("a backend snapshot packed images %v", imgs.names())
	}
	from := f.createAs(t, ctx, specRecord{Snapshot: snap.ID})
	if f.rt.Calls(runtimefake.OpRestore) != 1 {
		t.Fatalf("restores: %d, want 1", f.rt.Calls(runtimefake.OpRestore))
	}
	if b, err := runtimetest.ReadFile(ctx, f.rt, from.ID, "/x"); err != nil || string(b) != "y" {
		t.Fatalf("restored sandbox's /x: %q %v", b, err)
	}
	if h := imgs.heldName(from.ID); h != "root/busybox" {
		t.Fatalf("restore holds %q, want the source's image", h)
	}
	if err := f.DeleteSnapshot(ctx, snap.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(snap.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("snapshot dir after delete: %v", err)
	}
}

// TestSnapshotBadInput: bad names, a repeated name, another principal's
// sandbox, a stopped one, image and snapshot together: each a clear error
// naming the field, leaving no snapshot, image or file behind.
func TestSnapshotBadInput(t *testing.T) {
	f, imgs := newSnapNode(t, false, "")
	ctx := alice()
	src := f.createAs(t, ctx, specRecord{Image: "root/busybox"})
	stopped := f.createAs(t, ctx, specRecord{Image: "root/busybox"})
	if err := f.Stop(ctx, stopped.ID, "test"); err != nil {
		t.Fatal(err)
	}
	first, err := f.CreateSnapshot(ctx, src.ID, "taken")
	if err != nil {
		t.Fatal(err)
	}
	files := func() []string {
		ents, _ := os.ReadDir(filepath.Join(f.cfg.StateDir, "snapshots"))
		var out []string
		for _, e := range ents {
			out = append(out, e.Name())
		}
		return out
	}
	before, beforeImgs, beforeSandboxes := files(), len(imgs.names()), len(f.List(ctx))
	for _, c := range []struct {
		what, id, name, field string
		ctx                   context.Context
		is                    func(error) bool
	}{
		{"name with /", src.ID, "a/b", "name", ctx, errdefs.IsInvalidArgument},
		{"name of 300 characters", src.ID, strings.Repeat("n", 300), "name", ctx, errdefs.IsInvalidArgument},
		{"name with a space", src.ID, "a b", "name", ctx, errdefs.IsInvalidArgument},
		{"repeated name", src.ID, "taken", "name", ctx, func(err error) bool { return errors.Is(err, errdefs.ErrAlreadyExists) }},
		{"another principal's sandbox", src.ID, "x", "sandbox_id", bob(), errdefs.IsNotFound},
		{"stopped sandbox", stopped.ID, "x", "sandbox_id", ctx, errdefs.IsNotFound},
		{"empty sandbox id", "", "x", "sandbox_id", ctx, errdefs.IsInvalidArgument},
	} {
		_, err := f.CreateSnapshot(c.ctx, c.id, c.name)
		if err == nil || !c.is(err) || !strings.Contains(err.Error(), c.field) {
			t.Errorf("%s: %v, want an error naming %s", c.what, err, c.field)
		}
	}
	if got := files(); strings.Join(got, ",") != strings.Join(before, ",") {
		t.Fatalf("snapshot files changed: %v → %v", before, got)
	}
	if len(imgs.names()) != beforeImgs || len(f.List(ctx)) != beforeSandboxes {
		t.Fatalf("images %d → %d, sandboxes %d → %d", beforeImgs, len(imgs.names()), beforeSandboxes, len(f.List(ctx)))
	}
	// The same name is free for another owner.
	bsrc := f.createAs(t, bob(), specRecord{Image: "root/busybox"})
	if _, err := f.CreateSnapshot(bob(), bsrc.ID, "taken"); err != nil {
		t.Fatalf("bob's snapshot named like alice's: %v", err)
	}
	// Owners see their own; admins all.
	if l := f.ListSnapshots(ctx); len(l) != 1 || l[0].ID != first.ID {
		t.Fatalf("alice lists %v", l)
	}
	if l := f.ListSnapshots(as("root", auth.ScopeAdmin)); len(l) != 2 {
		t.Fatalf("admin lists %d snapshots, want 2", len(l))
	}
	if _, err := f.GetSnapshot(bob(), first.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("bob gets alice's snapshot: %v", err)
	}
	if err := f.DeleteSnapshot(bob(), first.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("bob deletes alice's snapshot: %v", err)
	}
	// Creates: someone else's snapshot, an unknown one, image and snapshot.
	for _, c := range []struct {
		what  string
		ctx   context.Context
		spec  specRecord
		field string
		is    func(error) bool
	}{
		{"another principal's snapshot", bob(), specRecord{Snapshot: first.ID}, "snapshot", errdefs.IsNotFound},
		{"unknown snapshot", ctx, specRecord{Snapshot: sandboxid.New("t001")}, "snapshot", errdefs.IsNotFound},
		{"malformed snapshot", ctx, specRecord{Snapshot: "nope"}, "snapshot", errdefs.IsInvalidArgument},
		{"image and snapshot", ctx, specRecord{Snapshot: first.ID, Image: "root/busybox"}, "snapshot", errdefs.IsInvalidArgument},
		{"a snapshot's image by name", ctx, specRecord{Image: first.Image}, "image", errdefs.IsInvalidArgument},
	} {
		n0 := len(f.List(ctx))
		_, err := f.Create(c.ctx, CreateRequest{ID: sandboxid.New("t001"), Spec: c.spec})
		if err == nil || !c.is(err) || !strings.Contains(err.Error(), c.field) {
			t.Errorf("create from %s: %v, want an error naming %s", c.what, err, c.field)
		}
		if len(f.List(ctx)) != n0 {
			t.Errorf("create from %s left a sandbox", c.what)
		}
	}
}

// TestSnapshotPausedSource: a paused sandbox can be snapshotted and stays
// paused.
func TestSnapshotPausedSource(t *testing.T) {
	f, _ := newSnapNode(t, false, "")
	ctx := alice()
	src := f.createAs(t, ctx, specRecord{Image: "root/busybox"})
	if _, err := f.Pause(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := f.CreateSnapshot(ctx, src.ID, "p"); err != nil {
		t.Fatalf("snapshot of a paused sandbox: %v", err)
	}
	if _, sb, _ := f.Get(ctx, src.ID); sb.rec.State != statePaused {
		t.Fatalf("source is %s after the snapshot, want paused", sb.rec.State)
	}
}

// TestSnapshotsSurviveRestart: the records are on disk: a node started
// again on the same state dir lists them and starts sandboxes from them;
// a snapshot the node died in the middle of is removed with its image.
func TestSnapshotsSurviveRestart(t *testing.T) {
	dir := t.TempDir()
	f, imgs := newSnapNode(t, false, dir)
	ctx := alice()
	src := f.createAs(t, ctx, specRecord{Image: "root/busybox", CPU: 0.25})
	snap, err := f.CreateSnapshot(ctx, src.ID, "keep")
	if err != nil {
		t.Fatal(err)
	}
	// A half-made one, as a node killed during pack_diff leaves it.
	half := &snapshotRecord{ID: sandboxid.New("t001"), Name: "half", Owner: "alice", Image: "snapshot/half", Pending: true}
	imgs.packed["snapshot/half"] = map[string][]byte{}
	if err := f.snaps.write(half); err != nil {
		t.Fatal(err)
	}
	f.StopAll(ctx, "restart test")
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	n2, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n2.StopAll(context.Background(), "cleanup"); n2.Close() })
	l := n2.ListSnapshots(ctx)
	if len(l) != 1 || l[0].ID != snap.ID || l[0].Name != "keep" || l[0].Spec.CPU != 0.25 || l[0].Image != snap.Image {
		t.Fatalf("after restart alice lists %+v, want the one snapshot", l)
	}
	if _, ok := imgs.packed["snapshot/half"]; ok {
		t.Fatal("the half-made snapshot's image survived the restart")
	}
	if _, err := os.Stat(n2.snaps.recordPath(half.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("half-made record: %v", err)
	}
	rec, err := n2.Create(ctx, CreateRequest{ID: sandboxid.New("t001"), Spec: specRecord{Snapshot: snap.ID}, Owner: "alice"})
	if err != nil || rec.Spec.CPU != 0.25 {
		t.Fatalf("create from the snapshot after restart: %+v %v", rec, err)
	}
	if _, err := n2.CreateSnapshot(ctx, rec.ID, "keep"); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("repeated name after restart: %v", err)
	}
}

// TestSnapshotOfFailedSandbox: a sandbox whose init died (reported
// FAILED, then removed) is refused with failed_precondition naming
// sandbox_id and the reason, and nothing is written.
func TestSnapshotOfFailedSandbox(t *testing.T) {
	f, imgs := newSnapNode(t, false, "")
	ctx := alice()
	src := f.createAs(t, ctx, specRecord{Image: "root/busybox"})
	if err := f.rt.Kill(src.ID, "killed by signal 9"); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; {
		_, err := f.get(src.ID)
		if _, dead := f.deadSandbox(src.ID); dead && errdefs.IsNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the killed sandbox was not reported dead and removed within 5 s")
		}
		time.Sleep(5 * time.Millisecond) // polling the node's view
	}
	_, err := f.CreateSnapshot(ctx, src.ID, "x")
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "sandbox_id") || !strings.Contains(err.Error(), "signal 9") {
		t.Fatalf("snapshot of a dead sandbox: %v, want failed_precondition naming sandbox_id and the reason", err)
	}
	if len(f.ListSnapshots(ctx)) != 0 || len(imgs.names()) != 0 {
		t.Fatalf("left snapshots %v, images %v", f.ListSnapshots(ctx), imgs.names())
	}
}
