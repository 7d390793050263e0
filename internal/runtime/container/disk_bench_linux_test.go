package container

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// BenchmarkDiskQuota measures, side by side in one run (the modes take
// turns in every iteration), what the writable-layer quota costs: the
// latency of Create and of Create+Start+agent ready, the time a sandbox
// takes to write 256 MiB with fsync, and how and how fast a 64 MiB quota
// fills. Modes: none (no quota: the upper on the state dir's filesystem)
// and image (a sparse ext4 image, loop-mounted); project when
// OPENDSEC_BENCH_PRJQUOTA_DIR names a directory on a filesystem mounted
// with prjquota. bench/disk-quota.sh runs it.
func BenchmarkDiskQuota(b *testing.B) {
	testutil.RequiresRoot(b)
	rt, err := New(Config{StateRoot: filepath.Join(b.TempDir(), "runc"), CgroupParent: "/opendsec-test", AgentPath: testutil.AgentBinary(b)})
	if err != nil {
		b.Fatal(err)
	}
	tmpl := runtime.Spec{
		Rootfs:    runtime.Rootfs{Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: testutil.BusyboxRootfs(b)}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 512},
	}
	type mode struct {
		name     string
		diskMB   int64
		parent   string
		directIO bool
	}
	const quotaMB = 256
	modes := []mode{{"none", 0, b.TempDir(), false}, {"image-buffered", quotaMB, b.TempDir(), false}, {"image", quotaMB, b.TempDir(), true}}
	if d := os.Getenv("OPENDSEC_BENCH_PRJQUOTA_DIR"); d != "" {
		modes = append(modes, mode{"project", quotaMB, d, false})
	}
	ctx := context.Background()
	create := map[string][]time.Duration{}
	ready := map[string][]time.Duration{}
	write := map[string][]time.Duration{}
	fill := map[string][]time.Duration{}
	fillMsg := map[string]string{}
	run := func(id, script string) (runtimetest.Result, time.Duration) {
		t0 := time.Now()
		res, err := runtimetest.Run(ctx, rt, id, "root", "/bin/sh", "-c", script)
		if err != nil {
			b.Fatal(err)
		}
		return res, time.Since(t0)
	}
	for b.Loop() {
		for _, m := range modes {
			spec := tmpl
			spec.Resources.DiskMB = m.diskMB
			spec.ID = runtimetest.NewID("dqb")
			spec.StateDir = filepath.Join(m.parent, spec.ID)
			rt.images.directIO = m.directIO
			t0 := time.Now()
			if _, err := rt.Create(ctx, spec); err != nil {
				b.Fatal(err)
			}
			t1 := time.Now()
			if err := rt.Start(ctx, spec.ID); err != nil {
				b.Fatal(err)
			}
			if err := runtimetest.WaitAgent(ctx, rt, spec.ID, 20*time.Second); err != nil {
				b.Fatal(err)
			}
			create[m.name] = append(create[m.name], t1.Sub(t0))
			ready[m.name] = append(ready[m.name], time.Since(t0))
			if res, d := run(spec.ID, "dd if=/dev/zero of=/w bs=1M count=128 conv=fsync 2>&1 && rm /w"); res.ExitCode != 0 {
				b.Fatalf("%s: write 256 MiB: %s", m.name, res.Stdout)
			} else {
				write[m.name] = append(write[m.name], d)
			}
			if m.diskMB > 0 {
				// Fill the quota: the time to ENOSPC and the message.
				res, d := run(spec.ID, "dd if=/dev/zero of=/fill bs=1M count=1024 2>&1; rm -f /fill")
				fill[m.name] = append(fill[m.name], d)
				for _, l := range strings.Split(res.Stdout, "\n") {
					if strings.Contains(l, "error") {
						fillMsg[m.name] = l
					}
				}
			}
			b.StopTimer()
			if err := rt.Delete(ctx, spec.ID); err != nil {
				b.Fatal(err)
			}
			os.RemoveAll(spec.StateDir)
			b.StartTimer()
		}
	}
	med := func(ds []time.Duration) float64 {
		if len(ds) == 0 {
			return 0
		}
		s := slices.Clone(ds)
		slices.Sort(s)
		return float64(s[len(s)/2].Microseconds()) / 1000
	}
	for _, m := range modes {
		b.ReportMetric(med(create[m.name]), "create-ms-"+m.name)
		b.ReportMetric(med(ready[m.name]), "ready-ms-"+m.name)
		if w := med(write[m.name]); w > 0 {
			b.ReportMetric(128/(w/1000), "write-MBps-"+m.name)
		}
		if f := med(fill[m.name]); f > 0 {
			b.ReportMetric(f, "fill-ms-"+m.name)
		}
		fmt.Fprintf(os.Stderr, "%s: n=%d create p50 %.1f ms, create+start+ready p50 %.1f ms, 128 MiB fsync write p50 %.0f ms, fill %d MiB p50 %.0f ms; full: %q\n",
			m.name, len(create[m.name]), med(create[m.name]), med(ready[m.name]), med(write[m.name]), quotaMB, med(fill[m.name]), fillMsg[m.name])
	}
}
