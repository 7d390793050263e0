package container

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestDiffShowsTheUpper writes and deletes files in a running sandbox's root
// and checks Diff hands out the overlayfs upper holding exactly those
// changes, in overlayfs's format.
func TestDiffShowsTheUpper(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	d, ok := rt.(runtime.RootfsDiffer)
	if !ok {
		t.Fatal("the container backend does not implement runtime.RootfsDiffer")
	}
	// Through the sandbox: the host no longer has its root mounted.
	if res, err := runtimetest.Run(t.Context(), rt, spec.ID, "", "/bin/sh", "-c", "printf hi > /new-file && rm /bin/sh"); err != nil || res.ExitCode != 0 {
		t.Fatalf("write and remove in the sandbox: %+v, %v", res, err)
	}
	var seen []string
	err := d.DiffRootfs(t.Context(), spec.ID, func(ctx context.Context, diff runtime.RootfsDiff) error {
		if diff.Format != runtime.DiffOverlayDir {
			t.Errorf("diff format %q, want %q", diff.Format, runtime.DiffOverlayDir)
		}
		upper := diff.Dir
		if b, err := os.ReadFile(filepath.Join(upper, "new-file")); err != nil || string(b) != "hi" {
			t.Errorf("new-file in upper: %q, %v", b, err)
		}
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(upper, "bin", "sh"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
			t.Errorf("bin/sh in upper is not a whiteout: mode %o rdev %d, %v", st.Mode, st.Rdev, err)
		}
		ents, _ := os.ReadDir(upper)
		for _, e := range ents {
			seen = append(seen, e.Name())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(seen) == 0 {
		t.Fatal("empty upper")
	}
	if err := d.DiffRootfs(t.Context(), "nosuchsandbox", func(context.Context, runtime.RootfsDiff) error { return nil }); !errdefs.IsNotFound(err) {
		t.Fatalf("diff of an unknown sandbox: %v, want not found", err)
	}
}

// TestDiffFreezesARunningSandbox checks Diff freezes a running sandbox for
// the whole of fn (so code in it cannot swap paths in the upper during the
// copy) and thaws it afterwards, also when fn fails; a sandbox paused before
// Diff stays paused.
func TestDiffFreezesARunningSandbox(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	r := rt.(*Runtime)
	sb, err := r.get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	frozen := func() bool {
		t.Helper()
		ok, err := r.cg.frozen(sb.st.CgroupPath)
		if err != nil {
			t.Fatalf("read freezer state: %v", err)
		}
		return ok
	}
	if frozen() {
		t.Fatal("a fresh sandbox is frozen")
	}
	var inside bool
	if err := r.DiffRootfs(t.Context(), spec.ID, func(context.Context, runtime.RootfsDiff) error {
		inside = frozen()
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if !inside {
		t.Fatal("the sandbox ran during Diff's fn: want it frozen")
	}
	if frozen() {
		t.Fatal("the sandbox is still frozen after Diff")
	}

	boom := errors.New("boom")
	if err := r.DiffRootfs(t.Context(), spec.ID, func(context.Context, runtime.RootfsDiff) error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("Diff = %v, want fn's error", err)
	}
	if frozen() {
		t.Fatal("the sandbox is still frozen after a failed Diff")
	}

	if err := r.Pause(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if err := r.DiffRootfs(t.Context(), spec.ID, func(context.Context, runtime.RootfsDiff) error {
		inside = frozen()
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if !inside || !frozen() {
		t.Fatalf("paused sandbox: frozen during fn %v, after %v; want it left paused", inside, frozen())
	}
	if err := r.Resume(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
}

// TestRecoverThawsInterruptedDiff: a node that dies while Diff holds a
// sandbox frozen leaves it frozen; the next Recover must thaw it (it is
// running, not paused by anyone), while a sandbox the user paused stays
// paused. The node "restarts" inside fn: a fresh Runtime recovers the
// handle while the first one's freeze is in place, as after a kill -9.
func TestRecoverThawsInterruptedDiff(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, h := runtimetest.StartSandbox(t, rt, tmpl)
	r := rt.(*Runtime)
	sb, err := r.get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	marker := filepath.Join(sb.st.Bundle, diffFrozenFile)
	err = r.DiffRootfs(t.Context(), spec.ID, func(ctx context.Context, _ runtime.RootfsDiff) error {
		if st, err := rt.Status(ctx, spec.ID); err != nil || st.State != runtime.StatePaused {
			t.Fatalf("status during Diff = %+v, %v; want frozen", st, err)
		}
		if _, err := os.Stat(marker); err != nil {
			t.Errorf("no freeze marker while frozen for Diff: %v", err)
		}
		rt2, _ := f(t)
		if err := rt2.Recover(ctx, h); err != nil {
			t.Fatalf("recover: %v", err)
		}
		if st, err := rt2.Status(ctx, spec.ID); err != nil || st.State != runtime.StateRunning {
			t.Errorf("status after recovering a sandbox frozen by an interrupted Diff = %+v, %v; want running", st, err)
		}
		if _, err := os.Stat(marker); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("freeze marker left after the recovery thawed the sandbox: %v", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := runtimetest.Run(t.Context(), rt, spec.ID, "", "/bin/true"); err != nil {
		t.Fatalf("exec after Diff: %v", err)
	}

	// A user's pause is no Diff: recovery leaves it paused.
	if err := r.Pause(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	rt3, _ := f(t)
	if err := rt3.Recover(t.Context(), h); err != nil {
		t.Fatal(err)
	}
	if st, err := rt3.Status(t.Context(), spec.ID); err != nil || st.State != runtime.StatePaused {
		t.Fatalf("status after recovering a paused sandbox = %+v, %v; want paused", st, err)
	}
	if err := r.Resume(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
}
