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
	rt, err := New(Config{StateRoot: filepath.Join(b.TempDir(), "runc"), CgroupParent: "/opendsec-test", AgentPath: testutil.AgentBinary(b)})
	if err != nil {
		b.Fatal(err)
	}
	tmpl := runtime.Spec{
		Rootfs:    runtime.Rootfs{Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: testutil.BusyboxRootfs(b)}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 128},
	}
	ctx := context.Background()
	var create, start, ready time.Duration
	b.ResetTimer()
	for b.Loop() {
		spec := tmpl
		spec.ID = runtimetest.NewID("bench")
		spec.StateDir = filepath.Join(b.TempDir(), spec.ID)
		t0 := time.Now()
		if _, err := rt.Create(ctx, spec); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := rt.Start(ctx, spec.ID); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		if err := runtimetest.WaitAgent(ctx, rt, spec.ID, 20*time.Second); err != nil {
			b.Fatal(err)
		}
		create, start, ready = create+t1.Sub(t0), start+t2.Sub(t1), ready+time.Since(t2)
		b.StopTimer()
		if err := rt.Delete(ctx, spec.ID); err != nil {
			b.Fatal(err)
		}
		os.RemoveAll(spec.StateDir)
		b.StartTimer()
	}
	// Means per phase; ready is until the agent answers (polled every 5 ms).
	n := float64(b.N)
	b.ReportMetric(float64(create.Microseconds())/1000/n, "create-ms")
	b.ReportMetric(float64(start.Microseconds())/1000/n, "start-ms")
	b.ReportMetric(float64(ready.Microseconds())/1000/n, "ready-ms")
}

// BenchmarkFilesystemPauseResume measures a filesystem-only pause (kill,
// runc delete, cgroups removed) and the resume after it until the fresh
// agent answers.
func BenchmarkFilesystemPauseResume(b *testing.B) {
	testutil.RequiresRoot(b)
	rt, err := New(Config{StateRoot: filepath.Join(b.TempDir(), "runc"), CgroupParent: "/opendsec-test", AgentPath: testutil.AgentBinary(b)})
	if err != nil {
		b.Fatal(err)
	}
	spec := runtime.Spec{
		ID:        runtimetest.NewID("bench"),
		Rootfs:    runtime.Rootfs{Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: testutil.BusyboxRootfs(b)}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 128},
	}
	spec.StateDir = filepath.Join(b.TempDir(), spec.ID)
	ctx := context.Background()
	if _, err := rt.Create(ctx, spec); err != nil {
		b.Fatal(err)
	}
	defer rt.Delete(ctx, spec.ID) //nolint:errcheck // best effort in a benchmark
	if err := rt.Start(ctx, spec.ID); err != nil {
		b.Fatal(err)
	}
	if err := runtimetest.WaitAgent(ctx, rt, spec.ID, 20*time.Second); err != nil {
		b.Fatal(err)
	}
	var pause, resume time.Duration
	for b.Loop() {
		t0 := time.Now()
		if err := rt.PauseFilesystem(ctx, spec.ID); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := rt.ResumeFilesystem(ctx, spec.ID); err != nil {
			b.Fatal(err)
		}
		if err := runtimetest.WaitAgent(ctx, rt, spec.ID, 20*time.Second); err != nil {
			b.Fatal(err)
		}
		pause, resume = pause+t1.Sub(t0), resume+time.Since(t1)
	}
	n := float64(b.N)
	b.ReportMetric(float64(pause.Microseconds())/1000/n, "pause-ms")
	b.ReportMetric(float64(resume.Microseconds())/1000/n, "resume-ready-ms")
}
