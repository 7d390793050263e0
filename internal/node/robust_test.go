package node

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// stuckFreezer is a fake backend whose Pause always fails, like a freezer
// that never leaves FREEZING. Only the methods recovery, pause and stop use
// are implemented.
type stuckFreezer struct {
	blockingRuntime
	pauses atomic.Int32
}

func (r *stuckFreezer) Pause(context.Context, string) error {
	r.pauses.Add(1)
	return errdefs.New(errdefs.ErrDeadlineExceeded, "freezer still FREEZING after 10s (thawed again)")
}

func (r *stuckFreezer) Resume(context.Context, string) error { return nil }

var _ runtime.Pauser = (*stuckFreezer)(nil)

// openRecorded opens a node over a table holding recs, with backend rt
// called "fake".
func openRecorded(t *testing.T, rt runtime.Runtime, recs ...*record) *Node {
	t.Helper()
	dir := t.TempDir()
	agentPath := filepath.Join(dir, "agent")
	for _, p := range []string{agentPath, filepath.Join(dir, "opendsec-init")} {
		if err := os.WriteFile(p, nil, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	stateDir := filepath.Join(dir, "state")
	tbl, err := openTable(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if err := tbl.put(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := tbl.close(); err != nil {
		t.Fatal(err)
	}
	n, err := New(t.Context(), Config{
		ID:             "t001",
		StateDir:       stateDir,
		Backends:       map[string]runtime.Runtime{"fake": rt},
		DefaultBackend: "fake",
		Images:         images{mu: new(sync.Mutex), holds: map[string]bool{}},
		CPU:            4,
		MemoryMB:       4096,
		ReapInterval:   20 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	return n
}

// An auto_pause sandbox whose pause fails is stopped at its timeout instead
// of living on: with a freezer that cannot freeze, and with a backend that
// cannot pause at all (a record from before the backend changed).
func TestAutoPauseFailureStops(t *testing.T) {
	for _, tc := range []struct {
		name     string
		rt       func() runtime.Runtime
		attempts func(runtime.Runtime) int32
	}{
		{"stuck freezer", func() runtime.Runtime {
			return &stuckFreezer{blockingRuntime: blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}}}
		}, func(rt runtime.Runtime) int32 { return rt.(*stuckFreezer).pauses.Load() }},
		{"backend without pause", func() runtime.Runtime {
			return &blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}}
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			now := time.Now().UTC()
			rec := &record{ID: sandboxid.New("t001"), Backend: "fake", State: stateRunning,
				Spec:      specRecord{Backend: "fake", TimeoutSec: 1, AutoPause: true},
				CreatedAt: now, ExpiresAt: now.Add(-time.Second), StateDir: filepath.Join(t.TempDir(), "sb")}
			rt := tc.rt()
			n := openRecorded(t, rt, rec)
			waitGone(t, n, rec.ID, 5*time.Second)
			if tc.attempts != nil && tc.attempts(rt) == 0 {
				t.Fatal("the sandbox was stopped without an auto-pause attempt")
			}
		})
	}
}

// auto_pause on a backend that cannot pause is refused at create, naming
// the field, and nothing is made.
func TestAutoPauseRefusedWithoutPauser(t *testing.T) {
	rt := &blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}}
	n := openRecorded(t, rt)
	_, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New("t001"), Spec: specRecord{Image: "root/busybox", AutoPause: true}})
	var fe *errdefs.FieldError
	if !errdefs.IsInvalidArgument(err) || !errors.As(err, &fe) || fe.Field != "auto_pause" {
		t.Fatalf("create with auto_pause on the fake backend: %v, want invalid argument naming auto_pause", err)
	}
	if _, _, c := n.Usage(); c != 0 {
		t.Fatalf("%d sandboxes after a refused create, want 0", c)
	}
}

// blockingDiffer is a fake backend whose Diff blocks until release is
// closed (or ctx ends) and then fails without calling fn.
type blockingDiffer struct {
	blockingRuntime
	entered chan struct{}
	release chan struct{}
}

var errDiffReleased = errors.New("diff released")

func (r *blockingDiffer) DiffRootfs(ctx context.Context, _ string, _ func(context.Context, runtime.RootfsDiff) error) error {
	r.entered <- struct{}{}
	select {
	case <-r.release:
		return errDiffReleased
	case <-ctx.Done():
		return ctx.Err()
	}
}

var _ runtime.RootfsDiffer = (*blockingDiffer)(nil)

// A shutdown waits for a pack_diff in flight (the sandbox is frozen for it)
// and refuses new ones with unavailable.
func TestShutdownWaitsForPackDiff(t *testing.T) {
	now := time.Now().UTC()
	rec := &record{ID: sandboxid.New("t001"), Backend: "fake", State: stateRunning,
		Spec:      specRecord{Backend: "fake", TimeoutSec: 3600},
		CreatedAt: now, ExpiresAt: now.Add(time.Hour), StateDir: filepath.Join(t.TempDir(), "sb")}
	rt := &blockingDiffer{blockingRuntime: blockingRuntime{stopping: map[string]int{}, stops: map[string]int{}},
		entered: make(chan struct{}, 4), release: make(chan struct{})}
	n := openRecorded(t, rt, rec)
	released := false
	t.Cleanup(func() { // before the node's Close
		if !released {
			close(rt.release)
		}
	})
	packed := make(chan error, 1)
	go func() {
		_, err := n.PackDiff(context.Background(), nil, rec.ID, "team/saved:v1", nil)
		packed <- err
	}()
	select {
	case <-rt.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("pack_diff never reached the backend")
	}
	closed := make(chan error, 1)
	go func() { closed <- n.Close() }()
	deadline := time.Now().Add(5 * time.Second)
	for !n.closing() {
		if time.Now().After(deadline) {
			t.Fatal("shutdown never began")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
	late, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	_, err := n.PackDiff(late, nil, rec.ID, "team/saved:v2", nil)
	cancel()
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("pack_diff during shutdown: %v; want unavailable", err)
	}
	if got := n.gate.inFlight(); len(got) != 1 || got[0] != "pack diff of sandbox "+rec.ID {
		t.Fatalf("operations in flight during shutdown: %q; want the pack_diff", got)
	}
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a pack_diff was in flight", err)
	default:
	}
	released = true
	close(rt.release)
	select {
	case err := <-packed:
		if !errors.Is(err, errDiffReleased) {
			t.Fatalf("pack_diff in flight: %v; want the backend's answer", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("pack_diff did not finish")
	}
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the pack_diff finished")
	}
}
