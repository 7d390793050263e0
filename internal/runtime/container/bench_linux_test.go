package container

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// BenchmarkCreateStartReady measures Create + Start + first /health answer,
// then Delete (not timed).
func BenchmarkCreateStartReady(b *testing.B) {
	testutil.RequiresRoot(b)
	rt, err := New(Config{StateRoot: filepath.Join(b.TempDir(), "runc"), CgroupParent: "/opendsec-test"})
	if err != nil {
		b.Fatal(err)
	}
	tmpl := runtime.Spec{
		Image:     runtime.Image{Layers: []string{testutil.BusyboxRootfs(b)}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 128},
		AgentPath: testutil.AgentBinary(b),
	}
	ctx := context.Background()
	b.ResetTimer()
	for b.Loop() {
		spec := tmpl
		spec.ID = runtimetest.NewID("bench")
		spec.StateDir = filepath.Join(b.TempDir(), spec.ID)
		if _, err := rt.Create(ctx, spec); err != nil {
			b.Fatal(err)
		}
		if err := rt.Start(ctx, spec.ID); err != nil {
			b.Fatal(err)
		}
		if err := runtimetest.WaitAgent(ctx, rt, spec.ID, 20*time.Second); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if err := rt.Delete(ctx, spec.ID); err != nil {
			b.Fatal(err)
		}
		os.RemoveAll(spec.StateDir)
		b.StartTimer()
	}
}
