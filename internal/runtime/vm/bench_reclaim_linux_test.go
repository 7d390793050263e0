package vm

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// BenchmarkGuestReclaim measures task pause with reclaim on one booted
// guest holding 96 MiB in a tmpfs and a counter: in every iteration a
// pause and resume in place (the resume with its clock step), then a
// pause, Reclaim (the state to disk, QEMU gone: time, memory before and
// after) and Resume (the restore to the identity set); the counter must
// count on. bench/reclaim.sh runs it.
func BenchmarkGuestReclaim(b *testing.B) {
	if os.Getenv("OPENDSEC_ROOT_TESTS") != "1" {
		b.Skip("OPENDSEC_ROOT_TESTS=1 runs the vm benchmarks")
	}
	r := guestRuntime(b)
	ctx := context.Background()
	ns, err := newTapNetNS("brcl-" + strconv.Itoa(os.Getpid()))
	if err != nil {
		b.Fatal(err)
	}
	defer ns.close()
	id := "bench-reclaim"
	if _, err := r.Create(ctx, runtime.Spec{ID: id, StateDir: filepath.Join(b.TempDir(), "sb"), Rootfs: guestRootfs(b), Resources: guestRes(64), Network: ns.attachment()}); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), id) }()
	if err := r.Start(ctx, id); err != nil {
		b.Fatal(err)
	}
	if res, err := runtimetest.Run(ctx, r, id, "", "/bin/sh", "-c",
		`mkdir -p /run/ballast && mount -t tmpfs tmpfs /run/ballast && head -c 100663296 /dev/urandom > /run/ballast/x && `+
			`(v=$(head -c8 /dev/urandom | od -An -tx1 | tr -d ' \n'); i=0; while :; do i=$((i+1)); echo "$v $i" > /c.tmp && mv /c.tmp /c; sleep 0.05; done) >/dev/null 2>&1 </dev/null &`); err != nil || res.ExitCode != 0 {
		b.Fatalf("holder: %v %+v", err, res)
	}
	v0, _ := waitCounter(b, r, id, 1)
	var pause, resume, reclaim, restore []time.Duration
	var before, after, stateBytes []int64
	n := 0
	for b.Loop() {
		_, c0 := waitCounter(b, r, id, 1)
		t := time.Now()
		if err := r.Pause(ctx, id); err != nil {
			b.Fatal(err)
		}
		pause = append(pause, time.Since(t))
		t = time.Now()
		if err := r.Resume(ctx, id); err != nil {
			b.Fatal(err)
		}
		resume = append(resume, time.Since(t))
		if err := r.Pause(ctx, id); err != nil {
			b.Fatal(err)
		}
		t = time.Now()
		rs, err := r.Reclaim(ctx, id)
		if err != nil {
			b.Fatal(err)
		}
		reclaim = append(reclaim, time.Since(t))
		before, after = append(before, rs.Before), append(after, rs.After)
		sb, _ := r.get(id)
		if fi, err := os.Stat(filepath.Join(sb.st.StateDir, reclaimDir, reclaimStateFile)); err == nil {
			stateBytes = append(stateBytes, fi.Size())
		}
		t = time.Now()
		if err := r.Resume(ctx, id); err != nil {
			b.Fatal(err)
		}
		restore = append(restore, time.Since(t))
		if v, _ := waitCounter(b, r, id, c0+1); v != v0 {
			b.Fatalf("value %q after the restore, %q before", v, v0)
		}
		n++
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.0f ms", float64(d.Microseconds())/1000) }
	mib := func(v int64) string { return fmt.Sprintf("%.1f MiB", float64(v)/(1<<20)) }
	b.ReportMetric(float64(median(reclaim).Microseconds())/1000, "ms-reclaim")
	b.ReportMetric(float64(median(restore).Microseconds())/1000, "ms-restore")
	b.ReportMetric(float64(median(before)-median(after))/(1<<20), "MiB-freed")
	b.Logf("\n| vm (QEMU %s, 256 MiB guest, 96 MiB in a guest tmpfs; n=%d, medians) | |\n|---|---|\n"+
		"| pause in place (QMP stop) | %s |\n"+
		"| resume in place (cont, agent answers, clock stepped) | %s |\n"+
		"| reclaim: state to disk, QEMU quits, RAM file removed | %s |\n"+
		"| memory charged before / after the reclaim (cgroup) | %s / %s |\n"+
		"| memory freed | %s |\n"+
		"| state written (guest RAM in the stream) | %s |\n"+
		"| resume of a reclaimed VM: QEMU -incoming to the identity set | %s |",
		r.accel, n, ms(median(pause)), ms(median(resume)), ms(median(reclaim)), mib(median(before)), mib(median(after)),
		mib(median(before)-median(after)), mib(median(stateBytes)), ms(median(restore)))
}

// median is the middle of vs (the upper one of an even count); 0 for none.
func median[T int64 | time.Duration](vs []T) T {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	return s[len(s)/2]
}
