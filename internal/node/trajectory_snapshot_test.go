package node

import (
	"os"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// TestTrajectorySnapshotCarriesLog: a sandbox started from a snapshot on
// the node that took it starts with the source's log up to the snapshot,
// the source as its parent: the source's call IDs replay there without
// running, a call made after the snapshot is not in it and runs, and the
// source's log goes on apart.
func TestTrajectorySnapshotCarriesLog(t *testing.T) {
	f := newTrajFixture(t)
	ctx := t.Context()
	src := f.create(t)
	a := f.exec(ctx, src, "s0", "", "append")
	if a.rpcErr != nil {
		t.Fatal(a.rpcErr)
	}
	if r := f.exec(ctx, src, "s1", "", "echo", "hi"); r.rpcErr != nil {
		t.Fatal(r.rpcErr)
	}
	snap, err := f.n.CreateSnapshot(ctx, src, "after-two")
	if err != nil {
		t.Fatal(err)
	}
	if r := f.exec(ctx, src, "late", "", "append"); r.rpcErr != nil || r.replayed {
		t.Fatalf("call after the snapshot: %+v", r)
	}
	rec, err := f.n.Create(ctx, CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Snapshot: snap.ID}})
	if err != nil {
		t.Fatal(err)
	}
	meta, calls, err := f.n.Trajectory(ctx, rec.ID)
	if err != nil || meta.ParentID != src || meta.ForkSeq != 2 || len(calls) != 2 || calls[0].Origin != src || calls[1].CallID != "s1" {
		t.Fatalf("log of a sandbox from the snapshot: %+v, %d calls, %v", meta, len(calls), err)
	}
	starts := f.agent.startCount()
	if r := f.exec(ctx, rec.ID, "s0", "", "append"); !r.replayed || r.out != a.out {
		t.Fatalf("source's call ID in the restored sandbox: %+v; want %q replayed", r, a.out)
	}
	if f.agent.startCount() != starts {
		t.Fatal("a replayed call started a process")
	}
	if r := f.exec(ctx, rec.ID, "late", "", "append"); r.replayed || r.seq != "3" {
		t.Fatalf("call after the snapshot in the restored sandbox: %+v; want it run as call 3", r)
	}
	if _, calls, _ := f.n.Trajectory(ctx, src); len(calls) != 3 {
		t.Fatalf("source's log has %d calls; want its own 3", len(calls))
	}
	// The copy goes with the snapshot.
	if _, err := os.Stat(f.n.snaps.logPath(snap.ID)); err != nil {
		t.Fatalf("snapshot's log copy: %v", err)
	}
	if err := f.n.DeleteSnapshot(ctx, snap.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(f.n.snaps.logPath(snap.ID)); !os.IsNotExist(err) {
		t.Fatalf("log copy after the snapshot's delete: %v", err)
	}
}

// TestTrajectorySnapshotOtherNode: a container snapshot (pack_diff) keeps
// its log copy with its image in the shared store, so a sandbox another
// node starts from it (as the apiserver asks: the snapshot's image named)
// starts with the source's log too.
func TestTrajectorySnapshotOtherNode(t *testing.T) {
	imgs := newSnapImages(t)
	asDiff := func(f *trajFixture) {
		f.cfg.Images = imgs
		f.wrap = func(rt runtime.Runtime) runtime.Runtime {
			return diffOnly{Runtime: rt, fake: rt.(agentRuntime).Runtime}
		}
	}
	a := newTrajFixture(t, asDiff)
	b := newTrajFixture(t, asDiff, func(f *trajFixture) { f.cfg.ID = "t002" })
	ctx := t.Context()
	src := a.create(t)
	first := a.exec(ctx, src, "s0", "", "echo", "one")
	snap, err := a.n.CreateSnapshot(ctx, src, "")
	if err != nil {
		t.Fatal(err)
	}
	if snap.Image == "" {
		t.Fatalf("not a pack_diff snapshot: %+v", snap)
	}
	rec, err := b.n.Create(ctx, CreateRequest{ID: sandboxid.New(b.cfg.ID), Spec: specRecord{Snapshot: snap.ID, Image: snap.Image}})
	if err != nil {
		t.Fatal(err)
	}
	meta, calls, err := b.n.Trajectory(ctx, rec.ID)
	if err != nil || meta.ParentID != src || len(calls) != 1 || calls[0].CallID != "s0" {
		t.Fatalf("log on the other node: %+v, %d calls, %v", meta, len(calls), err)
	}
	if r := b.exec(ctx, rec.ID, "s0", "", "echo", "one"); !r.replayed || r.out != first.out {
		t.Fatalf("source's call on the other node: %+v", r)
	}
}
