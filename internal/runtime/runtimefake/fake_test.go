package runtimefake

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

func factory(root string) runtimetest.Factory {
	return func(t *testing.T) (runtime.Runtime, runtime.Spec) {
		return New(Config{StateRoot: root}), runtime.Spec{
			Rootfs:    runtime.Rootfs{Image: "fake/img", Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: t.TempDir()}}},
			Resources: runtime.Resources{CPU: 0.5, MemoryMB: 64, PidsLimit: 64},
		}
	}
}

// TestConformance: the fake passes the backend conformance suite (the
// parts that need no processes in the sandbox).
func TestConformance(t *testing.T) {
	runtimetest.Suite(t, factory(t.Name()), runtimetest.Options{
		Kill: func(t testing.TB, rt runtime.Runtime, id string) {
			if err := rt.(*Runtime).Kill(id, "killed by the test"); err != nil {
				t.Fatal(err)
			}
		},
	})
}

// TestHookFailsAndChangesNothing: a hook's error fails the operation
// before it changes anything.
func TestHookFailsAndChangesNothing(t *testing.T) {
	rt, tmpl := factory(t.Name())(t)
	f := rt.(*Runtime)
	boom := errdefs.New(errdefs.ErrUnavailable, "injected")
	f.Hook(OpCreate, func(context.Context, string) error { return boom })
	spec := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(t.Context(), spec); !errors.Is(err, boom) {
		t.Fatalf("create with a failing hook: %v", err)
	}
	if _, err := rt.Status(t.Context(), spec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("a failed create left the sandbox: %v", err)
	}
	f.Hook(OpCreate, nil)
	if _, err := rt.Create(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	if f.Calls(OpCreate) != 2 {
		t.Fatalf("calls = %d, want 2", f.Calls(OpCreate))
	}
	f.Hook(OpPause, func(context.Context, string) error { return boom })
	if err := rt.Start(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if err := f.Pause(t.Context(), spec.ID); !errors.Is(err, boom) {
		t.Fatalf("pause with a failing hook: %v", err)
	}
	if st, _ := rt.Status(t.Context(), spec.ID); st.State != runtime.StateRunning {
		t.Fatalf("state after a failed pause: %s", st.State)
	}
}

// TestRegistered: importing the package registers backend "fake", opened
// from a config section with its options.
func TestRegistered(t *testing.T) {
	rts, err := runtime.Open(t.Context(), runtime.Env{NodeID: "n001", StateDir: t.TempDir()},
		map[string]json.RawMessage{Name: json.RawMessage(`{"options": ["tier"]}`)})
	if err != nil {
		t.Fatal(err)
	}
	rt := rts[Name]
	if rt == nil || rt.Info().Name != Name {
		t.Fatalf("opened %v", rts)
	}
	if err := rt.ValidateOptions(map[string]string{"tier": "gold"}); err != nil {
		t.Fatalf("configured option refused: %v", err)
	}
	if _, err := runtime.Open(t.Context(), runtime.Env{}, map[string]json.RawMessage{Name: json.RawMessage(`{"bogus": 1}`)}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("unknown config field: %v; want invalid argument", err)
	}
	if _, err := runtime.Open(t.Context(), runtime.Env{}, map[string]json.RawMessage{"nope": nil}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("unknown backend: %v; want invalid argument", err)
	}
}
