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
	d, ok := rt.(runtime.Differ)
	if !ok {
		t.Fatal("the container backend does not implement runtime.Differ")
	}
	root := filepath.Join(spec.StateDir, rootfsDir)
	if err := os.WriteFile(filepath.Join(root, "new-file"), []byte("hi"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(root, "bin", "sh")); err != nil {
		t.Fatal(err)
	}
	var seen []string
	err := d.Diff(t.Context(), spec.ID, func(ctx context.Context, upper string) error {
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
	if err := d.Diff(t.Context(), "nosuchsandbox", func(context.Context, string) error { return nil }); !errdefs.IsNotFound(err) {
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
	if err := r.Diff(t.Context(), spec.ID, func(context.Context, string) error {
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
	if err := r.Diff(t.Context(), spec.ID, func(context.Context, string) error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("Diff = %v, want fn's error", err)
	}
	if frozen() {
		t.Fatal("the sandbox is still frozen after a failed Diff")
	}

	if err := r.Pause(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if err := r.Diff(t.Context(), spec.ID, func(context.Context, string) error {
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
