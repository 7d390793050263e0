package container

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// startMemhog starts a sandbox running memhog with 20 MiB of written
// random memory and waits for its counter.
func startMemhog(t *testing.T, rt *Runtime, tmpl runtime.Spec) (runtime.Spec, runtime.Handle, *sandbox) {
	t.Helper()
	ctx := t.Context()
	bin, err := os.ReadFile(testutil.MemhogBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	spec, h := runtimetest.StartSandbox(t, rt, tmpl)
	if err := runtimetest.WriteFile(ctx, rt, spec.ID, "/memhog", bin); err != nil {
		t.Fatal(err)
	}
	if res, err := runtimetest.Run(ctx, rt, spec.ID, "", "/bin/sh", "-c",
		"chmod +x /memhog && (/memhog -mib 20 -pattern random >/dev/null 2>&1 </dev/null &)"); err != nil || res.ExitCode != 0 {
		t.Fatalf("start memhog: %v %+v", err, res)
	}
	sb, err := rt.get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	hostCount(t, sb, 1)
	return spec, h, sb
}

// hostCount polls the sandbox's /count from the host side of its writable
// layer (readable while it is frozen) until it is at least n; it returns
// the value.
func hostCount(t *testing.T, sb *sandbox, n int) int {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		b, err := os.ReadFile(filepath.Join(sb.st.upper(), "count"))
		if c, cerr := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && cerr == nil && c >= n {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("counter did not reach %d in 15 s (last %q, %v)", n, b, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (r *Runtime) memFile(sb *sandbox, name string) string {
	return filepath.Join(r.cg.v1["memory"], sb.st.CgroupPath, name)
}

// TestReclaimPushesMemoryOutAndResumes: a sandbox with 20 MiB of written
// anonymous memory, paused and reclaimed, drops most of it from RAM (into
// swap; the test makes zram swap when the host has none); resumed, its
// process is alive, its counter goes on from where it was and its memory
// holds what it wrote. Its memory limit is what it was throughout.
func TestReclaimPushesMemoryOutAndResumes(t *testing.T) {
	f := newFactory(t)
	rti, tmpl := f(t)
	rt := rti.(*Runtime)
	ctx := t.Context()
	if rt.cg.v2 {
		t.Log("cgroup v2: memory.reclaim")
	}
	hadSwap := testutil.SwapBytes() > 0
	start := time.Now()
	spec, _, sb := startMemhog(t, rt, tmpl)
	t.Logf("memhog started in %s", time.Since(start))

	if _, err := rt.Reclaim(ctx, spec.ID); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("reclaim of a running sandbox: %v, want failed_precondition", err)
	}
	if err := rt.Pause(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if !hadSwap {
		// Without swap only page cache goes, and the result says why.
		start := time.Now()
		rs, err := rt.Reclaim(ctx, spec.ID)
		if err != nil {
			t.Fatalf("reclaim without swap: %v", err)
		}
		t.Logf("reclaim without swap took %s: %+v", time.Since(start), rs)
		if rs.Note != NoSwapNote || rs.After < 20<<20 {
			t.Fatalf("reclaim without swap: %+v; want the anonymous 20 MiB kept and the no-swap note", rs)
		}
		if err := rt.Resume(ctx, spec.ID); err != nil {
			t.Fatal(err)
		}
		testutil.EnsureSwap(t, 512<<20)
		if err := rt.Pause(ctx, spec.ID); err != nil {
			t.Fatal(err)
		}
	}
	var limitBefore int64
	if !rt.cg.v2 {
		var err error
		if limitBefore, err = readInt(rt.memFile(sb, "memory.limit_in_bytes")); err != nil {
			t.Fatal(err)
		}
	}
	at := hostCount(t, sb, 1)
	start = time.Now()
	rs, err := rt.Reclaim(ctx, spec.ID)
	if err != nil {
		t.Fatalf("reclaim: %v", err)
	}
	t.Logf("reclaim took %s", time.Since(start))
	t.Logf("reclaim: before %d after %d freed %d note %q", rs.Before, rs.After, rs.Freed(), rs.Note)
	if rs.Before < 20<<20 || rs.Freed() < 16<<20 || rs.Note != "" {
		t.Fatalf("reclaim: %+v; want at least 16 of the 20 MiB written freed, no note", rs)
	}
	cur, err := rt.cg.memoryCharged(sb.st.CgroupPath)
	if err != nil {
		t.Fatal(err)
	}
	if cur > rs.Before-16<<20 {
		t.Fatalf("cgroup charged %d after the reclaim, %d before: want at least 16 MiB less", cur, rs.Before)
	}
	if !rt.cg.v2 {
		if swapped, ok := readKeyed(rt.memFile(sb, "memory.stat"), "swap"); ok && swapped < 16<<20 {
			t.Fatalf("memory.stat swap %d after the reclaim: want the 20 MiB in swap", swapped)
		}
		if l, err := readInt(rt.memFile(sb, "memory.limit_in_bytes")); err != nil || l != limitBefore {
			t.Fatalf("memory limit after reclaim %d (%v), want %d as before", l, err, limitBefore)
		}
		if _, err := os.Stat(filepath.Join(sb.st.Bundle, reclaimLimitFile)); !os.IsNotExist(err) {
			t.Fatalf("saved limit left in the bundle: %v", err)
		}
	}
	if c := hostCount(t, sb, 1); c != at {
		t.Fatalf("counter moved from %d to %d while paused", at, c)
	}
	if err := rt.Resume(ctx, spec.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}
	// The same process counts on: the next values follow at, not 1.
	next := hostCount(t, sb, at+5)
	if next > at+1000 {
		t.Fatalf("counter jumped from %d to %d", at, next)
	}
	t.Logf("resumed, counting on at %d", next)
	if res, err := runtimetest.Run(ctx, rt, spec.ID, "", "/bin/sh", "-c",
		"touch /verify; for i in $(seq 500); do [ -f /verify.out ] && break; sleep 0.02; done; cat /verify.out"); err != nil || !strings.HasPrefix(res.Stdout, "ok ") {
		t.Fatalf("memory check after resume: %v %+v", err, res)
	}
}

// TestReclaimLimitRestoredAtRecover: a node killed between lowering the
// limit and putting it back leaves the original in the bundle; the next
// Recover (and a Resume) writes it back.
func TestReclaimLimitRestoredAtRecover(t *testing.T) {
	f := newFactory(t)
	rti, tmpl := f(t)
	rt := rti.(*Runtime)
	if rt.cg.v2 {
		t.Skip("cgroup v2 never lowers memory.max for a reclaim")
	}
	ctx := t.Context()
	spec, h := runtimetest.StartSandbox(t, rt, tmpl)
	sb, err := rt.get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Pause(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	limitFile := rt.memFile(sb, "memory.limit_in_bytes")
	orig, err := readInt(limitFile)
	if err != nil {
		t.Fatal(err)
	}
	// As a reclaim killed mid-way leaves it.
	if err := writeFileSync(filepath.Join(sb.st.Bundle, reclaimLimitFile), []byte(strconv.FormatInt(orig, 10))); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(limitFile, []byte(strconv.Itoa(orig2(orig))), 0); err != nil {
		t.Fatal(err)
	}
	rt2, _ := f(t)
	if err := rt2.Recover(ctx, h); err != nil {
		t.Fatal(err)
	}
	if l, err := readInt(limitFile); err != nil || l != orig {
		t.Fatalf("limit after recover %d (%v), want %d", l, err, orig)
	}
	if _, err := os.Stat(filepath.Join(sb.st.Bundle, reclaimLimitFile)); !os.IsNotExist(err) {
		t.Fatalf("saved limit left after recover: %v", err)
	}
	if err := rt2.(runtime.Pauser).Resume(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
}

// orig2 is a lowered limit: half of orig.
func orig2(orig int64) int { return int(orig / 2) }
