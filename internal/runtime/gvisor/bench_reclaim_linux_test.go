package gvisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// BenchmarkReclaim measures task pause with reclaim on gvisor: a sandbox
// holding 96 MiB in its tmpfs and a counter; every iteration a pause and
// resume in place, then a pause, Reclaim (`runsc checkpoint` to disk:
// time, memory before and after) and Resume (`runsc restore`); the
// counter must count on. bench/reclaim.sh runs it.
func BenchmarkReclaim(b *testing.B) {
	if os.Getenv("OPENDSEC_ROOT_TESTS") != "1" {
		b.Skip("OPENDSEC_ROOT_TESTS=1 runs the gvisor benchmarks")
	}
	rt, tmpl := benchFactory(b)
	ctx := context.Background()
	s := tmpl
	s.ID = runtimetest.NewID("brcl")
	s.StateDir = filepath.Join(b.TempDir(), "sb")
	if _, err := rt.Create(ctx, s); err != nil {
		b.Fatal(err)
	}
	defer func() {
		_ = rt.Stop(context.Background(), s.ID, runtime.StopOptions{})
		_ = rt.Delete(context.Background(), s.ID)
	}()
	if err := rt.Start(ctx, s.ID); err != nil {
		b.Fatal(err)
	}
	if err := runtimetest.WaitAgent(ctx, rt, s.ID, 30*time.Second); err != nil {
		b.Fatal(err)
	}
	if res, err := runtimetest.Run(ctx, rt, s.ID, "", "/bin/sh", "-c",
		`head -c 100663296 /dev/urandom > /tmp/ballast && (v=$(head -c8 /dev/urandom | od -An -tx1 | tr -d ' \n'); i=0; while :; do i=$((i+1)); echo "$v $i" > /c.tmp && mv /c.tmp /c; sleep 0.02; done) >/dev/null 2>&1 </dev/null &`); err != nil || res.ExitCode != 0 {
		b.Fatalf("holder: %v %+v", err, res)
	}
	v0, _ := waitCounter(b, rt, s.ID, 1)
	p, rc := rt.(runtime.Pauser), rt.(runtime.Reclaimer)
	var pause, resume, reclaim, restore []time.Duration
	var before, after, img []int64
	n := 0
	for b.Loop() {
		_, c0 := waitCounter(b, rt, s.ID, 1)
		t0 := time.Now()
		if err := p.Pause(ctx, s.ID); err != nil {
			b.Fatal(err)
		}
		pause = append(pause, time.Since(t0))
		t0 = time.Now()
		if err := p.Resume(ctx, s.ID); err != nil {
			b.Fatal(err)
		}
		resume = append(resume, time.Since(t0))
		if err := p.Pause(ctx, s.ID); err != nil {
			b.Fatal(err)
		}
		t0 = time.Now()
		rs, err := rc.Reclaim(ctx, s.ID)
		if err != nil {
			b.Fatal(err)
		}
		reclaim = append(reclaim, time.Since(t0))
		before, after = append(before, rs.Before), append(after, rs.After)
		var size int64
		ents, _ := os.ReadDir(filepath.Join(s.StateDir, reclaimDir))
		for _, e := range ents {
			if fi, err := e.Info(); err == nil {
				size += fi.Size()
			}
		}
		img = append(img, size)
		t0 = time.Now()
		if err := p.Resume(ctx, s.ID); err != nil {
			b.Fatal(err)
		}
		restore = append(restore, time.Since(t0))
		if v, _ := waitCounter(b, rt, s.ID, c0+1); v != v0 {
			b.Fatalf("value %q after the restore, %q before", v, v0)
		}
		n++
	}
	medI := func(v []int64) int64 { c := slices.Clone(v); slices.Sort(c); return c[len(c)/2] }
	ms := func(d []time.Duration) string { return fmt.Sprintf("%.0f ms", float64(median(d).Microseconds())/1000) }
	mib := func(v int64) string { return fmt.Sprintf("%.1f MiB", float64(v)/(1<<20)) }
	b.ReportMetric(float64(median(reclaim).Microseconds())/1000, "ms-reclaim")
	b.ReportMetric(float64(median(restore).Microseconds())/1000, "ms-restore")
	b.ReportMetric(float64(medI(before)-medI(after))/(1<<20), "MiB-freed")
	b.Logf("\n| gvisor (%s, 256 MiB limit, 96 MiB in its tmpfs; n=%d, medians) | |\n|---|---|\n"+
		"| pause in place (runsc pause) | %s |\n| resume in place (runsc resume) | %s |\n"+
		"| reclaim: runsc checkpoint to disk, sandbox deleted | %s |\n"+
		"| memory charged before / after the reclaim (cgroup) | %s / %s |\n| memory freed | %s |\n"+
		"| checkpoint written | %s |\n| resume of a reclaimed sandbox: runsc restore | %s |",
		rt.Info().Version, n, ms(pause), ms(resume), ms(reclaim), mib(medI(before)), mib(medI(after)), mib(medI(before)-medI(after)), mib(medI(img)), ms(restore))
}

// benchFactory is newFactory's backend and spec for a benchmark.
func benchFactory(b *testing.B) (runtime.Runtime, runtime.Spec) {
	testutil.RequiresRoot(b)
	rt, err := New(b.Context(), Config{RunscPath: runscPath(b), StateRoot: "/run/opendsec/gvisor-test/runsc", CgroupParent: "/opendsec-gvisor-test", AgentPath: testutil.AgentBinary(b)})
	if err != nil {
		b.Fatalf("new gvisor runtime: %v", err)
	}
	return rt, runtime.Spec{
		Rootfs:    runtime.Rootfs{Image: "test/busybox", Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: testutil.BusyboxRootfs(b)}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 256, PidsLimit: defaultPids},
	}
}

// median is the middle of d (the upper one of an even count).
func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}
