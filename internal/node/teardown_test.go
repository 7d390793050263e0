package node

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// TestStopDefersTeardown: with DeferTeardown, Stop returns once the
// sandbox is dead (the backend's Delete still blocked): it is gone from
// Get and its CPU and memory are free, but it counts against
// max_sandboxes until its teardown ends; shutdown waits for that teardown,
// which leaves nothing.
func TestStopDefersTeardown(t *testing.T) {
	f := newFakeNode(t, func(c *Config) { c.DeferTeardown, c.MaxSandboxes = true, 2 })
	release, entered := make(chan struct{}), make(chan string, 4)
	f.rt.Hook(runtimefake.OpDelete, func(_ context.Context, id string) error {
		entered <- id
		<-release
		return nil
	})
	a := f.create(t, specRecord{CPU: 1, MemoryMB: 64, TimeoutSec: 600})
	f.create(t, specRecord{CPU: 1, MemoryMB: 64, TimeoutSec: 600})
	stopped := make(chan error, 1)
	go func() { stopped <- f.Stop(t.Context(), a.ID, "test") }()
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatalf("stop: %v", err)
		}
	case <-time.After(10 * time.Second): // a bound for a failure, not a wait
		close(release)
		t.Fatal("stop waited for the backend's delete; want it to return once the sandbox is dead")
	}
	if st, err := f.rt.Status(t.Context(), a.ID); err != nil || st.State != runtime.StateStopped {
		t.Fatalf("backend state of the stopped sandbox: %+v, %v; want stopped (dead) before Stop returned", st, err)
	}
	if _, _, err := f.Get(t.Context(), a.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("get of the stopped sandbox: %v; want not found", err)
	}
	if cpu, mem, n := f.Usage(); cpu != 1 || mem != 64 || n != 1 {
		t.Fatalf("usage after the stop: %g CPU, %d MiB, %d sandboxes; want 1, 64, 1", cpu, mem, n)
	}
	_, err := f.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "root/busybox", CPU: 1, MemoryMB: 64, TimeoutSec: 600}})
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "torn down") {
		t.Fatalf("create while a stopped sandbox is still torn down at max_sandboxes 2: %v; want resource exhausted saying so", err)
	}
	if id := <-entered; id != a.ID {
		t.Fatalf("delete of %s; want %s", id, a.ID)
	}
	close(release)
	f.rt.Hook(runtimefake.OpDelete, nil)
	if err := f.Close(); err != nil { // waits for the teardown
		t.Fatal(err)
	}
	if _, err := os.Stat(a.StateDir); !os.IsNotExist(err) {
		t.Fatalf("stopped sandbox's dir after its teardown: %v; want it gone", err)
	}
	if _, err := f.rt.Status(context.Background(), a.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("backend still has the torn-down sandbox: %v", err)
	}
}

// TestDeferredTeardownFinishedAfterRestart: a node that goes away while a
// stopped sandbox's teardown is pending (its backend delete failing) leaves
// the record "stopping"; the next start finishes the teardown.
func TestDeferredTeardownFinishedAfterRestart(t *testing.T) {
	f := newFakeNode(t, func(c *Config) { c.DeferTeardown = true })
	release := make(chan struct{})
	f.rt.Hook(runtimefake.OpDelete, func(context.Context, string) error {
		<-release
		return errors.New("delete interrupted")
	})
	a := f.create(t, specRecord{TimeoutSec: 600})
	if err := f.Stop(t.Context(), a.ID, "test"); err != nil {
		t.Fatal(err)
	}
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	f.Shutdown(gone) // the node goes away without waiting for the teardown
	close(release)   // the teardown's delete fails; the node is closed
	f.rt.Hook(runtimefake.OpDelete, nil)
	if _, err := os.Stat(a.StateDir); err != nil {
		t.Fatalf("the interrupted teardown removed the dir already: %v", err)
	}

	n2, err := New(t.Context(), f.cfg) // same table, same backend
	if err != nil {
		t.Fatal(err)
	}
	defer n2.Close()
	recs, err := n2.table.all()
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r.ID == a.ID {
			t.Fatalf("record of the stopped sandbox after restart: %s; want it removed", r.State)
		}
	}
	if _, err := os.Stat(a.StateDir); !os.IsNotExist(err) {
		t.Fatalf("stopped sandbox's dir after restart: %v; want it gone", err)
	}
	if _, err := f.rt.Status(t.Context(), a.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("backend still has the sandbox after restart: %v", err)
	}
}
