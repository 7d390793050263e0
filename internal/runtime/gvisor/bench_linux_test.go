package gvisor

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/container"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// TestMeasure prints create-to-agent-ready for gvisor and container side
// by side (round-robin), checkpoint and restore times and fork of 1 and 4.
// Run it with OPENDSEC_GVISOR_BENCH=1 (bench/results/2026-12-02-gvisor.md).
func TestMeasure(t *testing.T) {
	if os.Getenv("OPENDSEC_GVISOR_BENCH") != "1" {
		t.Skip("set OPENDSEC_GVISOR_BENCH=1 to measure")
	}
	gv, tmpl := newFactory(t)(t)
	ct, err := container.New(container.Config{StateRoot: filepath.Join(t.TempDir(), "runc"), CgroupParent: "/opendsec-test", AgentPath: testutil.AgentBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	ready := func(rt runtime.Runtime) time.Duration {
		s := tmpl
		s.ID = runtimetest.NewID("m")
		s.StateDir = filepath.Join(t.TempDir(), "sb")
		t0 := time.Now()
		if _, err := rt.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
		if err := rt.Start(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		if err := runtimetest.WaitAgent(ctx, rt, s.ID, 20*time.Second); err != nil {
			t.Fatal(err)
		}
		d := time.Since(t0)
		_ = rt.Stop(context.Background(), s.ID, runtime.StopOptions{})
		_ = rt.Delete(context.Background(), s.ID)
		return d
	}
	var g, c []time.Duration
	for range 5 {
		g = append(g, ready(gv))
		c = append(c, ready(ct))
	}
	mg, mc := median(g), median(c)
	t.Logf("create->agent ready n=5: gvisor %v container %v ratio %.2f", mg, mc, float64(mg)/float64(mc))

	src, _ := runtimetest.StartSandbox(t, gv, tmpl)
	var ck, rs []time.Duration
	for i := range 5 {
		dir := t.TempDir()
		t0 := time.Now()
		info, err := gv.(runtime.Snapshotter).Snapshot(ctx, src.ID, dir)
		if err != nil {
			t.Fatal(err)
		}
		ck = append(ck, time.Since(t0))
		s := tmpl
		s.ID = runtimetest.NewID("r" + strconv.Itoa(i))
		s.StateDir = filepath.Join(t.TempDir(), "sb")
		t0 = time.Now()
		if _, err := gv.(runtime.Snapshotter).Restore(ctx, s, dir); err != nil {
			t.Fatal(err)
		}
		if err := gv.Start(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		if err := runtimetest.WaitAgent(ctx, gv, s.ID, 20*time.Second); err != nil {
			t.Fatal(err)
		}
		rs = append(rs, time.Since(t0))
		if i == 0 {
			t.Logf("snapshot bytes %d", info.Bytes)
		}
		_ = gv.Stop(context.Background(), s.ID, runtime.StopOptions{})
		_ = gv.Delete(context.Background(), s.ID)
	}
	t.Logf("checkpoint (--leave-running) n=5 median %v; restore->agent ready median %v", median(ck), median(rs))
	for _, n := range []int{1, 4} {
		var specs []runtime.Spec
		for i := range n {
			s := tmpl
			s.ID = runtimetest.NewID("f" + strconv.Itoa(i))
			s.StateDir = filepath.Join(t.TempDir(), "sb")
			specs = append(specs, s)
		}
		t0 := time.Now()
		res, err := gv.(runtime.Forker).Fork(ctx, src.ID, specs)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range specs {
			if err := gv.Start(ctx, s.ID); err != nil {
				t.Fatal(err)
			}
		}
		for _, s := range specs {
			if err := runtimetest.WaitAgent(ctx, gv, s.ID, 20*time.Second); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("fork count %d: source frozen %v, fork+start+all agents ready %v", n, res[0].SourceFrozen, time.Since(t0))
		for _, s := range specs {
			_ = gv.Stop(context.Background(), s.ID, runtime.StopOptions{})
			_ = gv.Delete(context.Background(), s.ID)
		}
	}
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}
