package node

import (
	"errors"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// on_timeout decides what the reaper does when a lifetime or an idle
// timeout ends: "pause" pauses (memory and files kept), "stop" (and the
// default) stops.
func TestOnTimeoutReaper(t *testing.T) {
	for _, c := range []struct {
		name      string
		spec      specRecord
		advance   time.Duration
		wantPause bool
	}{
		{"lifetime, pause", specRecord{TimeoutSec: 60, OnTimeout: sandboxspec.OnTimeoutPause}, 61 * time.Second, true},
		{"lifetime, stop", specRecord{TimeoutSec: 60, OnTimeout: sandboxspec.OnTimeoutStop}, 61 * time.Second, false},
		{"lifetime, default", specRecord{TimeoutSec: 60}, 61 * time.Second, false},
		{"lifetime, auto_pause alias", specRecord{TimeoutSec: 60, AutoPause: true}, 61 * time.Second, true},
		{"idle, pause", specRecord{TimeoutSec: 3600, IdleSec: 30, OnTimeout: sandboxspec.OnTimeoutPause}, 31 * time.Second, true},
		{"idle, stop", specRecord{TimeoutSec: 3600, IdleSec: 30, OnTimeout: sandboxspec.OnTimeoutStop}, 31 * time.Second, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			clk := &testClock{}
			f := newFakeNode(t, func(cfg *Config) { cfg.Clock = clk.now })
			rec := f.create(t, c.spec)
			keep := f.create(t, specRecord{TimeoutSec: 3600})
			if c.wantPause != (rec.Spec.OnTimeout == sandboxspec.OnTimeoutPause) {
				t.Fatalf("recorded on_timeout %q", rec.Spec.OnTimeout)
			}
			clk.reapPasses(t, 2)
			if got := stateOf(t, f.Node, rec.ID); got != stateRunning {
				t.Fatalf("before its timeout: %s", got)
			}
			clk.advance(c.advance)
			if c.wantPause {
				waitState(t, f.Node, rec.ID, statePaused)
				mustBackendState(t, f.rt, rec.ID, runtime.StatePaused)
				// The reaper's pause ends after the state shows paused:
				// then later passes must leave the sandbox alone.
				waitReaperDone(t, f.Node, rec.ID)
				clk.reapPasses(t, 2)
				mustStayPaused(t, f.Node, rec.ID, "paused by its timeout")
			} else {
				waitGone(t, f.Node, rec.ID, 10*time.Second)
				if _, err := f.rt.Status(t.Context(), rec.ID); !errdefs.IsNotFound(err) {
					t.Fatalf("backend still has the timed-out sandbox: %v", err)
				}
			}
			if got := stateOf(t, f.Node, keep.ID); got != stateRunning {
				t.Fatalf("a sandbox whose timeouts did not end is %s", got)
			}
		})
	}
}

// on_timeout "pause" on a backend that cannot pause is refused at create,
// naming on_timeout; a bad value is refused naming it too.
func TestOnTimeoutRefused(t *testing.T) {
	n := openRecorded(t, &blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}})
	for _, c := range []struct {
		spec  specRecord
		field string
	}{
		{specRecord{Image: "root/busybox", OnTimeout: "pause"}, "on_timeout"},
		{specRecord{Image: "root/busybox", OnTimeout: "hibernate"}, "on_timeout"},
		{specRecord{Image: "root/busybox", OnTimeout: "stop", AutoPause: true}, "on_timeout"},
	} {
		_, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New("t001"), Spec: c.spec})
		var fe *errdefs.FieldError
		if !errdefs.IsInvalidArgument(err) || !errors.As(err, &fe) || fe.Field != c.field {
			t.Fatalf("create with %+v: %v, want invalid argument naming %s", c.spec, err, c.field)
		}
	}
	if got := len(n.List(t.Context())); got != 0 {
		t.Fatalf("refused creates left %d sandboxes", got)
	}
}

// set_timeout on a paused sandbox sets the lifetime it resumes with
// (seconds from the resume); it does not reset the max_paused clock.
func TestSetTimeoutWhilePaused(t *testing.T) {
	clk := &testClock{}
	f := newFakeNode(t, func(cfg *Config) {
		cfg.Clock = clk.now
		cfg.MaxPaused = time.Hour
	})
	rec := f.create(t, specRecord{TimeoutSec: 60})
	paused, err := f.Pause(t.Context(), rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	clk.advance(10 * time.Minute)
	got, err := f.SetTimeout(t.Context(), rec.ID, 900)
	if err != nil {
		t.Fatalf("set_timeout on a paused sandbox: %v", err)
	}
	if got.State != statePaused || !got.PausedAt.Equal(paused.PausedAt) || got.Spec.TimeoutSec != 900 {
		t.Fatalf("after set_timeout: state %s paused_at %s (was %s) timeout %d; want still paused since the same time, timeout 900",
			got.State, got.PausedAt, paused.PausedAt, got.Spec.TimeoutSec)
	}
	if n := f.rt.Calls(runtimefake.OpResume); n != 0 {
		t.Fatalf("set_timeout resumed the sandbox (%d resumes)", n)
	}
	// Recorded, so a restart keeps it.
	recs, err := f.table.all()
	if err != nil || len(recs) != 1 || recs[0].ExpiresAt.Sub(recs[0].PausedAt) != 900*time.Second {
		t.Fatalf("table after set_timeout while paused: %+v %v", recs, err)
	}
	// Its 60 s (and now its 900 s) pass while paused: still paused.
	clk.advance(20 * time.Minute)
	clk.reapPasses(t, 2)
	mustStayPaused(t, f.Node, rec.ID, "paused with a lifetime set while paused")
	resumed, err := f.Resume(t.Context(), rec.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if left := resumed.ExpiresAt.Sub(clk.now()); left > 900*time.Second || left < 899*time.Second {
		t.Fatalf("lifetime after resume = %s, want the 900s set while paused", left)
	}

	// The max_paused clock runs from the pause, not from the set_timeout.
	if _, err := f.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	clk.advance(50 * time.Minute)
	if _, err := f.SetTimeout(t.Context(), rec.ID, 3600); err != nil {
		t.Fatal(err)
	}
	clk.advance(11 * time.Minute)
	waitGone(t, f.Node, rec.ID, 10*time.Second)

	if _, err := f.SetTimeout(t.Context(), rec.ID, 60); !errdefs.IsNotFound(err) {
		t.Fatalf("set_timeout on a stopped sandbox: %v, want not found", err)
	}
}

// The reaper's pause re-checks, under the pause lock, that the timeout it
// acts on still holds: a call in flight (idle) or a lifetime extended
// meanwhile (timeout) puts it off, and nothing is frozen.
func TestOnTimeoutPauseRechecksBeforeFreezing(t *testing.T) {
	clk := &testClock{}
	f := newFakeNode(t, func(cfg *Config) {
		cfg.Clock = clk.now
		cfg.ReapInterval = time.Hour // the test plays the reaper
	})
	rec := f.create(t, specRecord{TimeoutSec: 60, IdleSec: 10, OnTimeout: sandboxspec.OnTimeoutPause})
	sb, _ := f.get(rec.ID)
	clk.advance(20 * time.Second)
	sb.active.Add(1) // a call arrived after the reaper chose the sandbox
	if _, err := f.pauseIf(t.Context(), rec.ID, false, f.stillDue("idle")); !errors.Is(err, errNotDue) {
		t.Fatalf("idle pause with a call in flight: %v, want it put off", err)
	}
	sb.active.Add(-1)
	if _, err := f.SetTimeout(t.Context(), rec.ID, 600); err != nil {
		t.Fatal(err)
	}
	clk.advance(50 * time.Second) // past the lifetime the reaper saw, not the new one
	if _, err := f.pauseIf(t.Context(), rec.ID, false, f.stillDue("timeout")); !errors.Is(err, errNotDue) {
		t.Fatalf("timeout pause after set_timeout: %v, want it put off", err)
	}
	if n := f.rt.Calls(runtimefake.OpPause); n != 0 || stateOf(t, f.Node, rec.ID) != stateRunning {
		t.Fatalf("backend paused %d times, state %s; want running and never frozen", n, stateOf(t, f.Node, rec.ID))
	}
	// Still due: it pauses.
	if _, err := f.pauseIf(t.Context(), rec.ID, false, f.stillDue("idle")); err != nil {
		t.Fatalf("idle pause that is due: %v", err)
	}
	if got := stateOf(t, f.Node, rec.ID); got != statePaused {
		t.Fatalf("state = %s, want paused", got)
	}
}

// The reaper's stop re-checks, under the node's lock, that the timeout it
// acts on still holds: a lifetime extended by set_timeout, a call in flight
// (idle), or a pause since the reaper chose the sandbox puts the stop off.
// The test plays the reaper that chose each sandbox before the change.
func TestOnTimeoutStopRechecksBeforeStopping(t *testing.T) {
	clk := &testClock{}
	f := newFakeNode(t, func(cfg *Config) {
		cfg.Clock = clk.now
		cfg.ReapInterval = time.Hour // the test plays the reaper
		cfg.MaxPaused = time.Hour
	})
	reap := func(id, reason string) {
		t.Helper()
		f.wg.Add(1)
		f.reapOne(id, reason, false, false, make(chan struct{}, 1))
	}
	extended := f.create(t, specRecord{TimeoutSec: 60})
	idle := f.create(t, specRecord{TimeoutSec: 3600, IdleSec: 10})
	paused := f.create(t, specRecord{TimeoutSec: 60})
	due := f.create(t, specRecord{TimeoutSec: 60})
	clk.advance(61 * time.Second) // every lifetime of 60 s and the idle timeout are over
	if _, err := f.SetTimeout(t.Context(), extended.ID, 600); err != nil {
		t.Fatal(err)
	}
	sb, _ := f.get(idle.ID)
	sb.active.Add(1) // a call arrived after the reaper chose the sandbox
	if _, err := f.Pause(t.Context(), paused.ID); err != nil {
		t.Fatal(err)
	}
	reap(extended.ID, "timeout")
	reap(idle.ID, "idle")
	reap(paused.ID, "timeout")
	reap(paused.ID, "paused too long") // paused for 0 s of its hour
	for id, want := range map[string]string{extended.ID: stateRunning, idle.ID: stateRunning, paused.ID: statePaused} {
		if got := stateOf(t, f.Node, id); got != want {
			t.Errorf("%s: state %s after the reaper's stop, want %s (put off)", id, got, want)
		}
	}
	if n := f.rt.Calls(runtimefake.OpStop); n != 0 {
		t.Fatalf("backend stopped %d sandboxes; want none", n)
	}
	// Still due: the reaper stops it.
	reap(due.ID, "timeout")
	waitGone(t, f.Node, due.ID, 10*time.Second)
	sb.active.Add(-1)
}
