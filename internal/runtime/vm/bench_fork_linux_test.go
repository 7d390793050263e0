package vm

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// smapsKB reads /proc/<pid>/smaps_rollup's fields in kB.
func smapsKB(pid int) map[string]int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		return nil
	}
	out := map[string]int64{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 3 && f[2] == "kB" {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			out[strings.TrimSuffix(f[0], ":")] = v
		}
	}
	return out
}

func medianD(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func medianI(vs []int64) int64 {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkGuestFork measures, on one booted guest holding a value in a
// shell, in every iteration one after the other: Snapshot (call and source
// pause), Restore + Start (to the identity set), Fork of 1 and of 4 (the
// call, the source's pause, each fork's Start to the identity set, the 4
// started at once) and the memory of the 4 forks' QEMUs (smaps_rollup: Rss,
// Pss, Private) beside the source's. bench/vm-fork.sh runs it.
func BenchmarkGuestFork(b *testing.B) {
	if os.Getenv("OPENDSEC_ROOT_TESTS") != "1" {
		b.Skip("OPENDSEC_ROOT_TESTS=1 runs the vm benchmarks")
	}
	r := guestRuntime(b)
	ctx := context.Background()
	mkns := func(name string) *tapNetNS {
		ns, err := newTapNetNS(name + "-" + strconv.Itoa(os.Getpid()))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(ns.close)
		return ns
	}
	srcNS := mkns("bsrc")
	src := "bench-fork-src"
	if _, err := r.Create(ctx, runtime.Spec{ID: src, StateDir: filepath.Join(b.TempDir(), "sb"), Rootfs: guestRootfs(b), Resources: guestRes(64), Network: srcNS.attachment()}); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), src) }()
	t0 := time.Now()
	if err := r.Start(ctx, src); err != nil {
		b.Fatal(err)
	}
	boot := time.Since(t0)
	if res, err := runtimetest.Run(ctx, r, src, "", "/bin/sh", "-c",
		`(v=$(head -c8 /dev/urandom | od -An -tx1 | tr -d ' \n'); while :; do echo "$v" > /v; sleep 1; done) >/dev/null 2>&1 </dev/null &`); err != nil || res.ExitCode != 0 {
		b.Fatalf("holder: %v %+v", err, res)
	}
	check := func(id string) {
		if res, err := runtimetest.Run(ctx, r, id, "", "cat", "/v"); err != nil || res.ExitCode != 0 {
			b.Fatalf("cat /v in %s: %v %+v", id, err, res)
		}
	}
	var (
		snapCall, snapFrozen, restore   []time.Duration
		f1Call, f1Frozen, f1Start       []time.Duration
		f4Call, f4Frozen, f4Start, f4W  []time.Duration
		p4Call, p4Frozen, p4Start, p4W  []time.Duration
		rss, pss, priv, srcRss, srcPriv []int64
		prss, ppss, ppriv               []int64
	)
	n := 0
	for i := 0; b.Loop(); i++ {
		// Snapshot, then a restore of it.
		dir := b.TempDir()
		t := time.Now()
		if _, err := r.Snapshot(ctx, src, dir); err != nil {
			b.Fatal(err)
		}
		snapCall = append(snapCall, time.Since(t))
		rf, err := loadSnapshot(dir)
		if err != nil {
			b.Fatal(err)
		}
		snapFrozen = append(snapFrozen, time.Duration(rf.m.FrozenNS))
		ns := mkns(fmt.Sprintf("brs%d", i))
		rid := fmt.Sprintf("bench-restore-%d", i)
		t = time.Now()
		if _, err := r.Restore(ctx, runtime.Spec{ID: rid, StateDir: filepath.Join(b.TempDir(), "sb"), Rootfs: guestRootfs(b), Resources: guestRes(64), Network: ns.attachment()}, dir); err != nil {
			b.Fatal(err)
		}
		if err := r.Start(ctx, rid); err != nil {
			b.Fatal(err)
		}
		restore = append(restore, time.Since(t))
		check(rid)
		if err := r.Delete(ctx, rid); err != nil {
			b.Fatal(err)
		}
		// Fork of 1 and of 4.
		for _, mode := range []struct {
			count   int
			private bool
		}{{1, false}, {4, false}, {4, true}} {
			count := mode.count
			var specs []runtime.Spec
			for k := range count {
				ns := mkns(fmt.Sprintf("bf%d%t-%d-%d", count, mode.private, i, k))
				specs = append(specs, runtime.Spec{ID: fmt.Sprintf("bench-fork%d-%t-%d-%d", count, mode.private, i, k), StateDir: filepath.Join(b.TempDir(), "sb"),
					Rootfs: guestRootfs(b), Resources: guestRes(64), Network: ns.attachment()})
			}
			r.privateSnapshots = mode.private
			t := time.Now()
			res, err := r.Fork(ctx, src, specs)
			r.privateSnapshots = false
			if err != nil {
				b.Fatal(err)
			}
			call := time.Since(t)
			var (
				wg     sync.WaitGroup
				mu     sync.Mutex
				starts []time.Duration
				errs   []error
			)
			tw := time.Now()
			for _, s := range specs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					t := time.Now()
					err := r.Start(ctx, s.ID)
					mu.Lock()
					defer mu.Unlock()
					starts = append(starts, time.Since(t))
					if err != nil {
						errs = append(errs, err)
					}
				}()
			}
			wg.Wait()
			wall := time.Since(tw)
			if len(errs) > 0 {
				b.Fatal(errs[0])
			}
			for _, s := range specs {
				check(s.ID)
			}
			switch {
			case count == 1:
				f1Call, f1Frozen, f1Start = append(f1Call, call), append(f1Frozen, res[0].SourceFrozen), append(f1Start, starts...)
			case mode.private:
				p4Call, p4Frozen, p4Start, p4W = append(p4Call, call), append(p4Frozen, res[0].SourceFrozen), append(p4Start, starts...), append(p4W, wall)
				for _, s := range specs {
					sb, _ := r.get(s.ID)
					m := smapsKB(sb.st.Pid)
					prss, ppss, ppriv = append(prss, m["Rss"]), append(ppss, m["Pss"]), append(ppriv, m["Private_Clean"]+m["Private_Dirty"])
				}
			default:
				f4Call, f4Frozen, f4Start, f4W = append(f4Call, call), append(f4Frozen, res[0].SourceFrozen), append(f4Start, starts...), append(f4W, wall)
				for _, s := range specs {
					sb, _ := r.get(s.ID)
					m := smapsKB(sb.st.Pid)
					rss, pss, priv = append(rss, m["Rss"]), append(pss, m["Pss"]), append(priv, m["Private_Clean"]+m["Private_Dirty"])
				}
				ssb, _ := r.get(src)
				m := smapsKB(ssb.st.Pid)
				srcRss, srcPriv = append(srcRss, m["Rss"]), append(srcPriv, m["Private_Clean"]+m["Private_Dirty"])
			}
			for _, s := range specs {
				if err := r.Delete(ctx, s.ID); err != nil {
					b.Fatal(err)
				}
			}
		}
		n++
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.0f ms", float64(d.Microseconds())/1000) }
	b.ReportMetric(float64(medianD(snapFrozen).Microseconds())/1000, "ms-snapshot-frozen")
	b.ReportMetric(float64(medianD(restore).Microseconds())/1000, "ms-restore")
	b.ReportMetric(float64(medianI(pss)), "kB-pss/fork")
	b.Logf("\n| what (n=%d iterations, medians) | shared RAM file (default) | RAM in the stream (private copies) |\n|---|---|---|\n"+
		"| boot of the source to agent ready | %s | |\n"+
		"| snapshot: call / source paused | %s / %s | |\n"+
		"| restore of the snapshot: Restore + Start to the identity set | %s | |\n"+
		"| fork 1: Fork call / source paused / Start of the fork | %s / %s / %s | |\n"+
		"| fork 4: Fork call / source paused | %s / %s | %s / %s |\n"+
		"| fork 4: Start per fork (4 at once) / all 4 started | %s / %s | %s / %s |\n"+
		"| per fork (4 running): Rss / Pss / Private (kB) | %d / %d / %d | %d / %d / %d |\n"+
		"| per fork: shared (Rss - Private, kB) | %d | %d |\n"+
		"| source (booted): Rss / Private (kB) | %d / %d | |",
		n, ms(boot), ms(medianD(snapCall)), ms(medianD(snapFrozen)), ms(medianD(restore)),
		ms(medianD(f1Call)), ms(medianD(f1Frozen)), ms(medianD(f1Start)),
		ms(medianD(f4Call)), ms(medianD(f4Frozen)), ms(medianD(p4Call)), ms(medianD(p4Frozen)),
		ms(medianD(f4Start)), ms(medianD(f4W)), ms(medianD(p4Start)), ms(medianD(p4W)),
		medianI(rss), medianI(pss), medianI(priv), medianI(prss), medianI(ppss), medianI(ppriv),
		medianI(rss)-medianI(priv), medianI(prss)-medianI(ppriv), medianI(srcRss), medianI(srcPriv))
}
