package vm

import (
	"context"
	"fmt"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime"
)

// BenchmarkQEMUStart is Create + Start (exec to QMP "running") + Delete
// of a VM with the halting PVH stand-in kernel: QEMU's own cost, without
// the guest's boot.
func BenchmarkQEMUStart(b *testing.B) {
	if testing.Short() {
		b.Skip("short")
	}
	r, _ := newBenchRuntime(b)
	ctx := context.Background()
	for i := 0; b.Loop(); i++ {
		id := fmt.Sprintf("bench-%d", i)
		if _, err := r.Create(ctx, runtime.Spec{ID: id, StateDir: b.TempDir(), Rootfs: haltRootfs(), Resources: haltRes(16)}); err != nil {
			b.Fatal(err)
		}
		if err := r.Start(ctx, id); err != nil {
			b.Fatal(err)
		}
		if err := r.Delete(ctx, id); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkQEMUPauseResume is one QMP stop + cont.
func BenchmarkQEMUPauseResume(b *testing.B) {
	r, _ := newBenchRuntime(b)
	ctx := context.Background()
	if _, err := r.Create(ctx, runtime.Spec{ID: "bench-pause", StateDir: b.TempDir(), Rootfs: haltRootfs(), Resources: haltRes(16)}); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = r.Delete(ctx, "bench-pause") }()
	if err := r.Start(ctx, "bench-pause"); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if err := r.Pause(ctx, "bench-pause"); err != nil {
			b.Fatal(err)
		}
		if err := r.Resume(ctx, "bench-pause"); err != nil {
			b.Fatal(err)
		}
	}
}
