package node

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// fakeNode is a node over the fake backend: no root, no runc.
type fakeNode struct {
	*Node
	rt  *runtimefake.Runtime
	cfg Config
}

func newFakeNode(t *testing.T, mutate ...func(*Config)) *fakeNode {
	t.Helper()
	rt := runtimefake.New(runtimefake.Config{StateRoot: t.Name() + "-" + sandboxid.New("fake")})
	cfg := Config{
		ID:             "t001",
		StateDir:       t.TempDir(),
		Backends:       map[string]runtime.Runtime{runtimefake.Name: rt},
		DefaultBackend: runtimefake.Name,
		Images:         images{layer: t.TempDir(), mu: new(sync.Mutex), holds: map[string]bool{}},
		CPU:            4,
		MemoryMB:       4096,
		ReapInterval:   20 * time.Millisecond,
	}
	for _, m := range mutate {
		m(&cfg)
	}
	n, err := New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		n.StopAll(context.Background(), "test cleanup")
		n.Close()
	})
	return &fakeNode{Node: n, rt: rt, cfg: cfg}
}

func (f *fakeNode) create(t *testing.T, s specRecord) *record {
	t.Helper()
	if s.Image == "" {
		s.Image = "root/busybox"
	}
	rec, err := f.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: s})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	return rec
}

// TestFakeLifecycle: create, pause, resume and stop through the node over
// the fake backend; the guest gets the image's env under the sandbox's.
func TestFakeLifecycle(t *testing.T) {
	f := newFakeNode(t)
	ctx := t.Context()
	rec := f.create(t, specRecord{Env: map[string]string{"PATH": "/mine", "A": "1"}, TimeoutSec: 600})
	if rec.State != stateRunning {
		t.Fatalf("state after create: %s", rec.State)
	}
	env, err := f.rt.Env(rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(env, " ") != "PATH=/mine A=1" {
		t.Fatalf("guest env %v; want the image's PATH overridden by the sandbox's, then A", env)
	}
	if err := runtimetest.WriteFile(ctx, f.rt, rec.ID, "/x", []byte("y")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Pause(ctx, rec.ID); err != nil {
		t.Fatalf("pause: %v", err)
	}
	if st, _ := f.rt.Status(ctx, rec.ID); st.State != runtime.StatePaused {
		t.Fatalf("backend state after pause: %s", st.State)
	}
	if _, err := f.Resume(ctx, rec.ID, 0); err != nil {
		t.Fatalf("resume: %v", err)
	}
	if b, err := runtimetest.ReadFile(ctx, f.rt, rec.ID, "/x"); err != nil || string(b) != "y" {
		t.Fatalf("file after resume: %q %v", b, err)
	}
	if err := f.Stop(ctx, rec.ID, "test"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.rt.Status(ctx, rec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("backend still has the stopped sandbox: %v", err)
	}
}

// TestDeathSeenAtOnce: a sandbox whose init dies is reported failed, with
// the backend's reason, as soon as the backend's Wait returns — not at its
// timeout — and its resources are released.
func TestDeathSeenAtOnce(t *testing.T) {
	f := newFakeNode(t)
	rec := f.create(t, specRecord{TimeoutSec: 3600, MemoryMB: 256})
	_, mem0, _ := f.Usage()
	killed := time.Now()
	if err := f.rt.Kill(rec.ID, "killed by signal 9"); err != nil {
		t.Fatal(err)
	}
	var got *nodev1.Sandbox
	for time.Since(killed) < 5*time.Second {
		_, sb, err := f.Get(t.Context(), rec.ID)
		if err != nil {
			t.Fatalf("get after death: %v", err)
		}
		if p := f.toProto(sb); p.State == nodev1.SandboxState_SANDBOX_STATE_FAILED {
			got = p
			break
		}
		time.Sleep(5 * time.Millisecond) // polling the node's view
	}
	if got == nil {
		t.Fatal("sandbox not reported failed within 5 s of its death")
	}
	if d := time.Since(killed); d > time.Second {
		t.Errorf("death reported after %s; want within a second", d)
	}
	if !strings.Contains(got.Reason, "killed by signal 9") {
		t.Errorf("reason %q does not carry the backend's", got.Reason)
	}
	// Its cleanup follows the report.
	for deadline := time.Now().Add(5 * time.Second); ; {
		_, mem, _ := f.Usage()
		_, err := f.rt.Status(t.Context(), rec.ID)
		if mem == mem0-256 && errdefs.IsNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("5 s after the death: %d MiB reserved (want %d), backend status err %v (want not found)", mem, mem0-256, err)
		}
		time.Sleep(5 * time.Millisecond) // polling the node's cleanup
	}
	// A call into it says it died, and why.
	w := httptest.NewRecorder()
	f.AgentProxy().ServeHTTP(w, httptest.NewRequest(http.MethodGet, AgentPrefix+rec.ID+"/health", nil))
	if w.Code != errdefs.HTTPStatus(errdefs.ErrFailedPrecondition) || !strings.Contains(w.Body.String(), "died: killed by signal 9") {
		t.Errorf("agent call into the dead sandbox: %d %s; want failed precondition saying it died and why", w.Code, w.Body.String())
	}
	// The reason is also marked for clients (nodeclient, the SDKs).
	if h := w.Header().Get(errdefs.DiedMetadataKey); h != "killed by signal 9" || !strings.Contains(w.Body.String(), `"died":"killed by signal 9"`) {
		t.Errorf("agent call into the dead sandbox: header %s %q, body %s; want the reason in both", errdefs.DiedMetadataKey, h, w.Body.String())
	}
}

// TestStopIsNotADeath: a sandbox the node stops is not reported failed.
func TestStopIsNotADeath(t *testing.T) {
	f := newFakeNode(t)
	rec := f.create(t, specRecord{})
	if err := f.Stop(t.Context(), rec.ID, "asked"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.Get(t.Context(), rec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("get after stop: %v; want not found", err)
	}
	if n := promtest.ToFloat64(f.metrics.deaths); n != 0 {
		t.Fatalf("deaths counted after a stop: %v", n)
	}
}
