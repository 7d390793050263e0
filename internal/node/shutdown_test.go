package node

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// slowCreateRuntime is a fake backend whose Create blocks until release is
// closed; its agent is a real HTTP server on a unix socket answering
// /health. Only the methods create, stop and recovery use are implemented.
type slowCreateRuntime struct {
	runtime.Runtime
	agentSock string
	entered   chan struct{} // receives once per Create that began
	release   chan struct{}
}

func (r *slowCreateRuntime) Info() runtime.Info { return runtime.Info{Name: "fake"} }

// ValidateOptions accepts no options.
func (r *slowCreateRuntime) ValidateOptions(map[string]string) error { return nil }

// Wait blocks: init never ends on its own here.
func (r *slowCreateRuntime) Wait(ctx context.Context, _ string) (runtime.ExitStatus, error) {
	<-ctx.Done()
	return runtime.ExitStatus{}, ctx.Err()
}

func (r *slowCreateRuntime) Create(ctx context.Context, s runtime.Spec) (runtime.Handle, error) {
	r.entered <- struct{}{}
	<-r.release
	return runtime.Handle{ID: s.ID}, nil
}

func (r *slowCreateRuntime) Start(context.Context, string) error { return nil }

func (r *slowCreateRuntime) Stop(context.Context, string, runtime.StopOptions) error { return nil }

func (r *slowCreateRuntime) Delete(context.Context, string) error { return nil }

func (r *slowCreateRuntime) Recover(context.Context, runtime.Handle) error { return nil }

func (r *slowCreateRuntime) Status(context.Context, string) (runtime.Status, error) {
	return runtime.Status{State: runtime.StateRunning}, nil
}

func (r *slowCreateRuntime) AgentConn(ctx context.Context, _ string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "unix", r.agentSock)
}

// fakeAgent serves /health on a unix socket until the test ends.
func fakeAgent(t *testing.T, path string) {
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
}

func openFakeNode(t *testing.T, dir string, rt runtime.Runtime) *Node {
	t.Helper()
	agentPath := filepath.Join(dir, "agent")
	for _, p := range []string{agentPath, filepath.Join(dir, "opendsec-init")} {
		if err := os.WriteFile(p, nil, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n, err := New(t.Context(), Config{
		ID:             "t001",
		StateDir:       filepath.Join(dir, "state"),
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
	return n
}

func tableRecords(t *testing.T, stateDir string) map[string]*record {
	t.Helper()
	tbl, err := openTable(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	defer tbl.close()
	recs, err := tbl.all()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*record{}
	for _, r := range recs {
		out[r.ID] = r
	}
	return out
}

// A shutdown during a create refuses new work with unavailable, lets the
// create finish, and only then closes the table: the sandbox is recorded
// running.
func TestCloseWaitsForCreateInFlight(t *testing.T) {
	dir := t.TempDir()
	rt := &slowCreateRuntime{agentSock: filepath.Join(dir, "agent.sock"), entered: make(chan struct{}, 4), release: make(chan struct{})}
	fakeAgent(t, rt.agentSock)
	n := openFakeNode(t, dir, rt)
	released := false
	t.Cleanup(func() {
		if !released {
			close(rt.release)
		}
	})

	id := sandboxid.New("t001")
	created := make(chan error, 1)
	go func() {
		_, err := n.Create(context.Background(), CreateRequest{ID: id, Spec: specRecord{Image: "root/busybox"}})
		created <- err
	}()
	select {
	case <-rt.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("create never reached the backend")
	}

	closed := make(chan error, 1)
	go func() { closed <- n.Close() }()

	// New work is refused once the shutdown has begun (Close runs in its
	// own goroutine: poll for it to have begun, then try).
	deadline := time.Now().Add(5 * time.Second)
	for !n.closing() {
		if time.Now().After(deadline) {
			t.Fatal("shutdown never began")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
	_, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New("t001"), Spec: specRecord{Image: "root/busybox"}})
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("create during shutdown: %v; want unavailable", err)
	}
	if want := "node t001 is shutting down"; !strings.Contains(err.Error(), want) {
		t.Fatalf("create during shutdown: %q; want it to say %q", err, want)
	}
	if err := n.Stop(t.Context(), id, "test"); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("stop during shutdown: %v; want unavailable", err)
	}
	if _, err := n.Pause(t.Context(), id); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("pause during shutdown: %v; want unavailable", err)
	}
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a create was in flight", err)
	default:
	}

	released = true
	close(rt.release)
	select {
	case err := <-created:
		if err != nil {
			t.Fatalf("create in flight at shutdown: %v; want it to finish", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("create did not finish")
	}
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the create finished")
	}
	recs := tableRecords(t, filepath.Join(dir, "state"))
	if r := recs[id]; r == nil || r.State != stateRunning || r.Handle.ID != id {
		t.Fatalf("record after shutdown: %+v; want the sandbox running with its handle", r)
	}
	if len(recs) != 1 {
		t.Fatalf("%d records after shutdown; want 1 (the refused create left none)", len(recs))
	}
}

// A reaper stop that never returns delays Shutdown only until its deadline;
// the sandbox is left in the table as stopping, and the next start finishes
// the stop.
func TestShutdownBoundedByStuckStop(t *testing.T) {
	dir := t.TempDir()
	stateDir := filepath.Join(dir, "state")
	tbl, err := openTable(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	stuck := &record{ID: sandboxid.New("t001"), Backend: "fake", State: stateRunning,
		CreatedAt: now, ExpiresAt: now.Add(-time.Second), StateDir: filepath.Join(dir, "stuck")}
	if err := tbl.put(stuck); err != nil {
		t.Fatal(err)
	}
	if err := tbl.close(); err != nil {
		t.Fatal(err)
	}
	rt := &blockingRuntime{stuck: stuck.ID, release: make(chan struct{}), stopping: map[string]int{}, stops: map[string]int{}}
	n := openFakeNode(t, dir, rt)
	t.Cleanup(func() { close(rt.release) })

	deadline := time.Now().Add(5 * time.Second)
	for rt.stopCount(stuck.ID) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the reaper never stopped the expired sandbox")
		}
		time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
	}

	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	t0 := time.Now()
	if err := n.Shutdown(ctx); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Fatalf("shutdown took %s with a 300ms deadline", d)
	}
	// Shutdown is idempotent.
	if err := n.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}

	recs := tableRecords(t, stateDir)
	if r := recs[stuck.ID]; r == nil || r.State != stateStopping {
		t.Fatalf("stuck sandbox's record after shutdown: %+v; want it kept as stopping for recovery", r)
	}

	// The next start finishes the stop.
	rt2 := &blockingRuntime{release: make(chan struct{}), stopping: map[string]int{}, stops: map[string]int{}}
	n2 := openFakeNode(t, dir, rt2)
	if _, err := n2.get(stuck.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("stuck sandbox after restart: %v; want not found (recovery finished its stop)", err)
	}
	if rt2.stopCount(stuck.ID) != 1 {
		t.Fatalf("recovery stopped the sandbox %d times; want 1", rt2.stopCount(stuck.ID))
	}
	if err := n2.Close(); err != nil {
		t.Fatal(err)
	}
	if recs := tableRecords(t, stateDir); len(recs) != 0 {
		t.Fatalf("%d records after recovery; want none", len(recs))
	}
}

func (n *Node) closing() bool {
	n.gate.mu.Lock()
	defer n.gate.mu.Unlock()
	return n.gate.closing
}

// A create still running when the shutdown deadline passes is left for
// recovery: Shutdown returns at the deadline, the record stays "creating"
// (the create can no longer write the table), and the next start undoes it.
func TestShutdownLeavesLateCreateForRecovery(t *testing.T) {
	dir := t.TempDir()
	stateDir := filepath.Join(dir, "state")
	rt := &slowCreateRuntime{agentSock: filepath.Join(dir, "agent.sock"), entered: make(chan struct{}, 4), release: make(chan struct{})}
	fakeAgent(t, rt.agentSock)
	n := openFakeNode(t, dir, rt)
	released := false
	t.Cleanup(func() {
		if !released {
			close(rt.release)
		}
	})

	id := sandboxid.New("t001")
	created := make(chan error, 1)
	go func() {
		_, err := n.Create(context.Background(), CreateRequest{ID: id, Spec: specRecord{Image: "root/busybox"}})
		created <- err
	}()
	select {
	case <-rt.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("create never reached the backend")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	t0 := time.Now()
	if err := n.Shutdown(ctx); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Fatalf("shutdown took %s with a 200ms deadline", d)
	}
	if r := tableRecords(t, stateDir)[id]; r == nil || r.State != stateCreating {
		t.Fatalf("record of the late create: %+v; want it kept as creating", r)
	}

	// The late create ends without a sandbox: it could not record one.
	released = true
	close(rt.release)
	select {
	case err := <-created:
		if err == nil {
			t.Fatal("create finished after the table closed; want an error")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("late create did not end")
	}
	if r := tableRecords(t, stateDir)[id]; r == nil || r.State != stateCreating {
		t.Fatalf("record after the late create ended: %+v; want it still creating", r)
	}

	// The next start undoes it.
	rt2 := &slowCreateRuntime{agentSock: rt.agentSock, entered: make(chan struct{}, 4), release: make(chan struct{})}
	n2 := openFakeNode(t, dir, rt2)
	if _, err := n2.get(id); !errdefs.IsNotFound(err) {
		t.Fatalf("late create after restart: %v; want not found", err)
	}
	if err := n2.Close(); err != nil {
		t.Fatal(err)
	}
	if recs := tableRecords(t, stateDir); len(recs) != 0 {
		t.Fatalf("%d records after recovery; want none", len(recs))
	}
}
