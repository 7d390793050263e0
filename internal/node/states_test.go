package node

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// TestTransitions: the table allows exactly the documented moves, and a
// refused one is a failed precondition naming both states.
func TestTransitions(t *testing.T) {
	all := []string{stateCreating, statePooled, stateRunning, statePaused, stateStopping}
	allowed := map[[2]string]bool{
		{stateCreating, stateRunning}: true, {stateCreating, stateStopping}: true,
		{statePooled, stateCreating}: true, {statePooled, stateRunning}: true, {statePooled, stateStopping}: true,
		{stateRunning, statePaused}: true, {stateRunning, stateStopping}: true,
		{statePaused, stateRunning}: true, {statePaused, stateStopping}: true,
		{stateStopping, stateStopping}: true,
	}
	for _, from := range all {
		for _, to := range all {
			rec := &record{ID: "t001x", State: from}
			next, err := transition(rec, to)
			switch {
			case allowed[[2]string{from, to}]:
				if err != nil || next.State != to || rec.State != from {
					t.Errorf("%s → %s: %v (next %q, record now %q)", from, to, err, next.State, rec.State)
				}
			default:
				if !errors.Is(err, errdefs.ErrFailedPrecondition) {
					t.Errorf("%s → %s allowed (%v); the table forbids it", from, to, err)
				}
			}
		}
	}
	_, err := transition(&record{ID: "t001x", State: stateStopping}, statePaused)
	if err == nil || !containsAll(err.Error(), "t001x", stateStopping, statePaused) {
		t.Fatalf("refusal %v does not name the sandbox and both states", err)
	}
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// TestRunStepsUndoesInReverse: a failing step undoes the steps done before
// it, last first, and not itself or the ones after.
func TestRunStepsUndoesInReverse(t *testing.T) {
	var log []string
	mk := func(name string, fail bool) step {
		return step{
			name: name,
			do: func(context.Context) error {
				log = append(log, "do "+name)
				if fail {
					return errors.New(name + " failed")
				}
				return nil
			},
			undo: func(ctx context.Context) {
				if ctx.Err() != nil {
					t.Errorf("undo of %s got an ended context", name)
				}
				log = append(log, "undo "+name)
			},
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel() // undo must run even when the caller has gone
	err := runSteps(ctx, []step{mk("a", false), mk("b", false), mk("c", true), mk("d", false)})
	if err == nil || err.Error() != "c failed" {
		t.Fatalf("err = %v", err)
	}
	want := []string{"do a", "do b", "do c", "undo b", "undo a"}
	if !slices.Equal(log, want) {
		t.Fatalf("ran %v, want %v", log, want)
	}
}
