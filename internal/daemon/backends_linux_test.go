package daemon

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/testutil"
)

// TestSecondBackendFromConfig: a backend registered by its package (here
// the fake, imported by this test only) runs beside the container backend
// once the config's node.backends names it — nothing in internal/node
// knows it. Sandboxes of both are created, paused, resumed and stopped
// through the public API, and placement names the backends the node
// offers when asked for one it does not.
func TestSecondBackendFromConfig(t *testing.T) {
	testutil.RequiresRoot(t)
	agent := testutil.AgentBinary(t)
	s := startUpWith(t, false, func(cfg *config.Config) {
		cfg.Node.AgentPath = agent
		cfg.Node.Backends = map[string]json.RawMessage{
			"container":      json.RawMessage(`{}`),
			runtimefake.Name: json.RawMessage(`{"options": ["tier"]}`),
		}
		cfg.Node.WarmPool.Size = 0
		store, err := image.Open(cfg.Node.ImageDir)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := store.ImportDir(t.Context(), "root/busybox", testutil.BusyboxRootfs(t), image.Config{Env: []string{"PATH=/bin"}}); err != nil {
			t.Fatal(err)
		}
	})
	iss, err := loadIssuer(t.Context(), s.cfg)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := EnsureBootstrapToken(s.cfg, iss)
	if err != nil {
		t.Fatal(err)
	}
	api := opendsecv1connect.NewSandboxServiceClient(h2cClient(), "http://"+s.api, connect.WithInterceptors(auth.ClientInterceptor(admin)))
	ctx := t.Context()

	// The watcher must have seen the node's backends before placement can
	// use them.
	deadline := time.Now().Add(10 * time.Second)
	for _, backend := range []string{"container", runtimefake.Name} {
		var sb *opendsecv1.Sandbox
		for {
			resp, err := api.CreateSandbox(ctx, connect.NewRequest(&opendsecv1.CreateSandboxRequest{
				Spec: &opendsecv1.SandboxSpec{Image: "root/busybox", Backend: backend, TimeoutSeconds: 300}}))
			if err == nil {
				sb = resp.Msg.GetSandbox()
				break
			}
			if connect.CodeOf(err) != connect.CodeUnavailable || time.Now().After(deadline) {
				t.Fatalf("create on %s: %v", backend, err)
			}
			time.Sleep(50 * time.Millisecond) // polling for the watcher's first view
		}
		if sb.GetSpec().GetBackend() != backend || sb.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
			t.Fatalf("created %s sandbox: backend %q state %s", backend, sb.GetSpec().GetBackend(), sb.GetState())
		}
		id := sb.GetId()
		p, err := api.PauseSandbox(ctx, connect.NewRequest(&opendsecv1.PauseSandboxRequest{Id: id}))
		if err != nil || p.Msg.GetSandbox().GetState() != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
			t.Fatalf("pause %s sandbox: %v %v", backend, p, err)
		}
		r, err := api.ResumeSandbox(ctx, connect.NewRequest(&opendsecv1.ResumeSandboxRequest{Id: id}))
		if err != nil || r.Msg.GetSandbox().GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
			t.Fatalf("resume %s sandbox: %v %v", backend, r, err)
		}
		if _, err := api.StopSandbox(ctx, connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id})); err != nil {
			t.Fatalf("stop %s sandbox: %v", backend, err)
		}
		if _, err := api.GetSandbox(ctx, connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: id})); connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("get of a stopped %s sandbox: %v; want not found", backend, err)
		}
	}
	_, err = api.CreateSandbox(ctx, connect.NewRequest(&opendsecv1.CreateSandboxRequest{
		Spec: &opendsecv1.SandboxSpec{Image: "root/busybox", Backend: "vm"}}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !containsAll(err.Error(), "vm", "container", runtimefake.Name) {
		t.Fatalf("create on a backend no node offers: %v; want invalid argument naming the offered ones", err)
	}
	s.stop(t)
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}
