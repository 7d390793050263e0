package runtimetest

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// testCapabilities: what Info advertises is what the backend implements.
func testCapabilities(t *testing.T, f Factory) {
	rt, _ := f(t)
	got := rt.Info().Capabilities
	want := runtime.CapabilitiesOf(rt, got.MemorySnapshot)
	if got != want {
		t.Fatalf("Info().Capabilities = %+v, but the implemented interfaces say %+v", got, want)
	}
	if rt.Info().Name == "" {
		t.Fatal("Info().Name is empty")
	}
}

// testFiles: a file written through the agent reads back, and a missing
// one is reported missing.
func testFiles(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	ctx := t.Context()
	spec, _ := StartSandbox(t, rt, tmpl)
	data := bytes.Repeat([]byte("opendsec "), 1000)
	if err := WriteFile(ctx, rt, spec.ID, "/file.txt", data); err != nil {
		t.Fatal(err)
	}
	if b, err := ReadFile(ctx, rt, spec.ID, "/file.txt"); err != nil || !bytes.Equal(b, data) {
		t.Fatalf("read back %d bytes, %v; want the %d written", len(b), err, len(data))
	}
	if _, err := ReadFile(ctx, rt, spec.ID, "/never-written"); !errors.Is(err, ErrNoFile) {
		t.Fatalf("read of a missing file: %v; want ErrNoFile", err)
	}
	mustAlive(t, rt, spec.ID, o)
}

// testWait: Wait returns at once after Stop, promptly after init is killed
// from outside (with a reason), and not before; a sandbox deleted before
// it ran wakes its waiters with not found.
func testWait(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	ctx := t.Context()

	spec, _ := StartSandbox(t, rt, tmpl)
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	if st, err := rt.Wait(short, spec.ID); err == nil {
		cancel()
		t.Fatalf("Wait of a running sandbox returned %+v", st)
	}
	cancel()
	got := make(chan runtime.ExitStatus, 1)
	werr := make(chan error, 1)
	go func() {
		st, err := rt.Wait(ctx, spec.ID)
		werr <- err
		got <- st
	}()
	killed := time.Now()
	o.Kill(t, rt, spec.ID)
	select {
	case err := <-werr:
		st := <-got
		if err != nil {
			t.Fatalf("Wait after a kill: %v", err)
		}
		if d := time.Since(killed); d > time.Second {
			t.Errorf("Wait returned %s after the kill; want within a second", d)
		}
		if st.Reason == "" {
			t.Errorf("Wait after a kill gave no reason: %+v", st)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Wait did not return within 5 s of killing init")
	}
	mustState(t, rt, spec.ID, runtime.StateStopped)
	// A later Wait returns at once.
	if _, err := rt.Wait(ctx, spec.ID); err != nil {
		t.Fatalf("second Wait: %v", err)
	}

	stopped, _ := StartSandbox(t, rt, tmpl)
	if err := rt.Stop(ctx, stopped.ID, StopOptions()); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if st, err := rt.Wait(wctx, stopped.ID); err != nil || st.Reason == "" {
		t.Fatalf("Wait after Stop = %+v, %v; want a status with a reason", st, err)
	}

	never := Prepare(t, rt, tmpl)
	if _, err := rt.Create(ctx, never); err != nil {
		t.Fatal(err)
	}
	werr2 := make(chan error, 1)
	go func() {
		_, err := rt.Wait(ctx, never.ID)
		werr2 <- err
	}()
	if err := rt.Delete(ctx, never.ID); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-werr2:
		if !errdefs.IsNotFound(err) {
			t.Fatalf("Wait of a sandbox deleted before it ran: %v; want not found", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Wait of a sandbox deleted before it ran did not return")
	}
	if _, err := rt.Wait(ctx, NewID("none")); !errdefs.IsNotFound(err) {
		t.Fatalf("Wait of an unknown sandbox: %v; want not found", err)
	}
}

// testOptions: an option the backend does not know is refused, naming it.
func testOptions(t *testing.T, f Factory) {
	rt, _ := f(t)
	if err := rt.ValidateOptions(nil); err != nil {
		t.Fatalf("no options refused: %v", err)
	}
	err := rt.ValidateOptions(map[string]string{"surely-unknown-option": "1"})
	var fe *errdefs.FieldError
	if !errors.As(err, &fe) || fe.Field != "backend_options.surely-unknown-option" {
		t.Fatalf("unknown option: err = %v; want an invalid argument naming backend_options.surely-unknown-option", err)
	}
}

// testSnapshot: a restored sandbox has the files of the snapshotted one,
// which keeps running; a changed source does not change the restore.
func testSnapshot(t *testing.T, f Factory) {
	rt, tmpl := f(t)
	sn, ok := rt.(runtime.Snapshotter)
	if !ok {
		t.Skipf("backend %s has no runtime.Snapshotter", rt.Info().Name)
	}
	ctx := t.Context()
	src, _ := StartSandbox(t, rt, tmpl)
	if err := WriteFile(ctx, rt, src.ID, "/state", []byte("before")); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	info, err := sn.Snapshot(ctx, src.ID, dir)
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	if info.Memory != rt.Info().Capabilities.MemorySnapshot {
		t.Errorf("snapshot memory = %v, capabilities say %v", info.Memory, rt.Info().Capabilities.MemorySnapshot)
	}
	if info.Memory && info.SourceFrozen <= 0 {
		t.Errorf("a memory snapshot of a running sandbox reports it frozen for %s; it must say how long it froze it", info.SourceFrozen)
	}
	mustState(t, rt, src.ID, runtime.StateRunning)
	if err := WriteFile(ctx, rt, src.ID, "/state", []byte("after")); err != nil {
		t.Fatal(err)
	}
	spec := Prepare(t, rt, tmpl)
	if _, err := sn.Restore(ctx, spec, dir); err != nil {
		t.Fatalf("restore: %v", err)
	}
	mustState(t, rt, spec.ID, runtime.StateCreated)
	if err := rt.Start(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if err := WaitAgent(ctx, rt, spec.ID, agentTimeout); err != nil {
		t.Fatal(err)
	}
	if b, err := ReadFile(ctx, rt, spec.ID, "/state"); err != nil || string(b) != "before" {
		t.Fatalf("restored file = %q, %v; want the snapshot's \"before\"", b, err)
	}
	bad := Prepare(t, rt, tmpl)
	if _, err := sn.Restore(ctx, bad, t.TempDir()); err == nil {
		t.Fatal("restore from an empty directory succeeded")
	}
	mustNotFound(t, rt, bad.ID)
}

// testFork: every fork has the source's files at the fork, and each then
// changes on its own.
func testFork(t *testing.T, f Factory) {
	rt, tmpl := f(t)
	fk, ok := rt.(runtime.Forker)
	if !ok {
		t.Skipf("backend %s has no runtime.Forker", rt.Info().Name)
	}
	ctx := t.Context()
	src, _ := StartSandbox(t, rt, tmpl)
	if err := WriteFile(ctx, rt, src.ID, "/tree", []byte("root")); err != nil {
		t.Fatal(err)
	}
	specs := []runtime.Spec{Prepare(t, rt, tmpl), Prepare(t, rt, tmpl), Prepare(t, rt, tmpl)}
	res, err := fk.Fork(ctx, src.ID, specs)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	if len(res) != len(specs) {
		t.Fatalf("fork made %d sandboxes, want %d", len(res), len(specs))
	}
	mustState(t, rt, src.ID, runtime.StateRunning)
	for i, s := range specs {
		if res[i].Handle.ID != s.ID {
			t.Fatalf("fork %d has handle %q, want %q", i, res[i].Handle.ID, s.ID)
		}
		if err := rt.Start(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		if err := WaitAgent(ctx, rt, s.ID, agentTimeout); err != nil {
			t.Fatal(err)
		}
		if b, err := ReadFile(ctx, rt, s.ID, "/tree"); err != nil || string(b) != "root" {
			t.Fatalf("fork %d file = %q, %v; want \"root\"", i, b, err)
		}
		if err := WriteFile(ctx, rt, s.ID, "/tree", []byte(s.ID)); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range specs {
		if b, _ := ReadFile(ctx, rt, s.ID, "/tree"); string(b) != s.ID {
			t.Fatalf("fork %s reads %q: forks share state", s.ID, b)
		}
	}
	if b, _ := ReadFile(ctx, rt, src.ID, "/tree"); string(b) != "root" {
		t.Fatalf("source reads %q after its forks wrote: forks share state with the source", b)
	}
	// A bad spec fails the whole fork and makes nothing.
	good, broken := Prepare(t, rt, tmpl), Prepare(t, rt, tmpl)
	broken.Rootfs.Layers = nil
	if _, err := fk.Fork(ctx, src.ID, []runtime.Spec{good, broken}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("fork with a bad spec: %v; want invalid argument", err)
	}
	mustNotFound(t, rt, good.ID)
}

// testRootfsDiff: a file written in the sandbox is in its diff.
func testRootfsDiff(t *testing.T, f Factory) {
	rt, tmpl := f(t)
	d, ok := rt.(runtime.RootfsDiffer)
	if !ok {
		t.Skipf("backend %s has no runtime.RootfsDiffer", rt.Info().Name)
	}
	ctx := t.Context()
	spec, _ := StartSandbox(t, rt, tmpl)
	if err := WriteFile(ctx, rt, spec.ID, "/diffdir/new.txt", []byte("in the diff")); err != nil {
		t.Fatal(err)
	}
	called := false
	err := d.DiffRootfs(ctx, spec.ID, func(ctx context.Context, diff runtime.RootfsDiff) error {
		called = true
		if diff.Format != runtime.DiffOverlayDir {
			t.Errorf("diff format %q; the node reads %q", diff.Format, runtime.DiffOverlayDir)
			return nil
		}
		b, err := os.ReadFile(filepath.Join(diff.Dir, "diffdir", "new.txt"))
		if err != nil || string(b) != "in the diff" {
			t.Errorf("diff holds %q, %v; want the written file", b, err)
		}
		return nil
	})
	if err != nil || !called {
		t.Fatalf("diff: %v (called %v)", err, called)
	}
	if err := d.DiffRootfs(ctx, NewID("none"), func(context.Context, runtime.RootfsDiff) error { return nil }); !errdefs.IsNotFound(err) {
		t.Fatalf("diff of an unknown sandbox: %v; want not found", err)
	}
}
