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
		AgentPath:      agentPath,
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
