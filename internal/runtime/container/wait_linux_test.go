package container

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// waitAsync starts rt.Wait(id) and returns a channel with its result.
func waitAsync(ctx context.Context, rt runtime.Runtime, id string) <-chan waitResult {
	ch := make(chan waitResult, 1)
	go func() {
		st, err := rt.Wait(ctx, id)
		ch <- waitResult{st, err}
	}()
	return ch
}

type waitResult struct {
	st  runtime.ExitStatus
	err error
}

// mustNotEnd checks that Wait of a running sandbox does not return while
// it runs (for a short window: nothing can prove it never would).
func mustNotEnd(t *testing.T, rt runtime.Runtime, id string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if st, err := rt.Wait(ctx, id); err == nil {
		t.Fatalf("Wait of running sandbox %s returned %+v", id, st)
	}
}

// killAndWait kills init with SIGKILL from outside and returns what the
// pending Waits report; each must come within a second of the kill.
func killAndWait(t *testing.T, rt runtime.Runtime, id string, waits ...<-chan waitResult) []runtime.ExitStatus {
	t.Helper()
	killed := time.Now()
	killInit(t, rt, id)
	var out []runtime.ExitStatus
	for i, ch := range waits {
		select {
		case r := <-ch:
			if r.err != nil {
				t.Fatalf("Wait #%d after kill -9 of init: %v", i+1, r.err)
			}
			if d := time.Since(killed); d > time.Second {
				t.Errorf("Wait #%d returned %s after kill -9 of init; want within 1 s", i+1, d)
			}
			if r.st.At.Before(killed) || r.st.At.After(time.Now()) {
				t.Errorf("Wait #%d: At = %s, not between the kill (%s) and now", i+1, r.st.At, killed)
			}
			out = append(out, r.st)
		case <-time.After(5 * time.Second):
			t.Fatalf("Wait #%d did not return within 5 s of kill -9 of init", i+1)
		}
	}
	return out
}

// TestWaitInitKilled: kill -9 of a sandbox's init (a crash, as the node
// would see it) ends every pending Wait within a second with a reason that
// is not "stopped" and no OOM; a sandbox recovered by a fresh runtime (a
// node restart) is watched the same way, and one whose init died while the
// node was down is reported ended at once.
func TestWaitInitKilled(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	ctx := t.Context()

	t.Run("Killed", func(t *testing.T) {
		spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
		mustNotEnd(t, rt, spec.ID)
		got := killAndWait(t, rt, spec.ID, waitAsync(ctx, rt, spec.ID), waitAsync(ctx, rt, spec.ID))
		for _, st := range got {
			if st.Reason == "" || st.Reason == "stopped" || st.OOMKilled || st.ExitCode != -1 {
				t.Errorf("Wait after kill -9 = %+v; want a reason other than stopped, no OOM, exit code -1 (not our child)", st)
			}
		}
		if got[0] != got[1] {
			t.Errorf("two Waits disagree: %+v and %+v", got[0], got[1])
		}
		if st, err := rt.Status(ctx, spec.ID); err != nil || st.State != runtime.StateStopped {
			t.Errorf("status after kill -9 of init = %+v, %v; want stopped", st, err)
		}
		// Later Waits return the same status at once.
		if st, err := rt.Wait(ctx, spec.ID); err != nil || st != got[0] {
			t.Errorf("later Wait = %+v, %v; want %+v", st, err, got[0])
		}
	})

	t.Run("Stopped", func(t *testing.T) {
		spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
		w := waitAsync(ctx, rt, spec.ID)
		if err := rt.Stop(ctx, spec.ID, runtimetest.StopOptions()); err != nil {
			t.Fatal(err)
		}
		select {
		case r := <-w:
			if r.err != nil || r.st.Reason != "stopped" || r.st.OOMKilled {
				t.Errorf("Wait across Stop = %+v, %v; want reason \"stopped\", no OOM", r.st, r.err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Wait did not return within 5 s of Stop")
		}
	})

	t.Run("RecoveredThenKilled", func(t *testing.T) {
		spec, h := runtimetest.StartSandbox(t, rt, tmpl)
		rt2, _ := f(t)
		if err := rt2.Recover(ctx, h); err != nil {
			t.Fatalf("recover: %v", err)
		}
		mustNotEnd(t, rt2, spec.ID)
		got := killAndWait(t, rt2, spec.ID, waitAsync(ctx, rt2, spec.ID))
		if got[0].Reason == "" || got[0].Reason == "stopped" {
			t.Errorf("Wait of a recovered sandbox after kill -9 = %+v; want a crash reason", got[0])
		}
	})

	t.Run("DiedWhileNodeDown", func(t *testing.T) {
		spec, h := runtimetest.StartSandbox(t, rt, tmpl)
		killAndWait(t, rt, spec.ID, waitAsync(ctx, rt, spec.ID))
		rt2, _ := f(t)
		if err := rt2.Recover(ctx, h); err != nil {
			t.Fatalf("recover of a sandbox whose init died: %v", err)
		}
		wctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		st, err := rt2.Wait(wctx, spec.ID)
		if err != nil || st.Reason == "" || st.Reason == "stopped" {
			t.Fatalf("Wait of a recovered, dead sandbox = %+v, %v; want an end with a crash reason at once", st, err)
		}
	})
}

// TestWaitReportsOOM: a process of the sandbox killed by the OOM killer
// (memory_mb 32, a process that grows without bound) does not end the
// sandbox, but once init ends Wait reports OOMKilled with a reason that
// names memory.
func TestWaitReportsOOM(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	tmpl.Resources.MemoryMB = 32
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	ctx := t.Context()
	c := rt.(*Runtime)
	oomFile := "memory.events"
	if !c.cg.v2 {
		oomFile = "memory.oom_control"
	}
	if n := cgroupCounter(t, c, spec.ID, "memory", oomFile, "oom_kill"); n != 0 {
		t.Fatalf("fresh sandbox has oom_kill %d", n)
	}
	w := waitAsync(ctx, rt, spec.ID)
	// awk doubles a string until the kernel kills it (far past 32 MiB).
	res := sh(t, rt, spec.ID, `awk 'BEGIN { s = "xxxxxxxxxxxxxxxx"; while (1) s = s s }'`)
	if res.ExitCode == 0 {
		t.Fatalf("memory hog exited 0: %+v", res)
	}
	if n := cgroupCounter(t, c, spec.ID, "memory", oomFile, "oom_kill"); n == 0 {
		t.Fatalf("the hog ended (%+v) but the sandbox's cgroup counts no OOM kill", res)
	}
	select {
	case r := <-w:
		t.Fatalf("an OOM-killed process ended the sandbox's Wait: %+v, %v", r.st, r.err)
	default:
	}
	if res := sh(t, rt, spec.ID, "echo alive"); res.Stdout != "alive\n" {
		t.Fatalf("sandbox unusable after the OOM kill: %+v", res)
	}
	st := killAndWait(t, rt, spec.ID, w)[0]
	if !st.OOMKilled || !strings.Contains(st.Reason, "memory") {
		t.Fatalf("Wait after an OOM kill in the sandbox = %+v; want OOMKilled and a reason naming memory", st)
	}
}
