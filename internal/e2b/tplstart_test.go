package e2b

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// fakeAgent is the agent's process service: "ready-after-2" fails twice,
// then succeeds; "never-ready" always fails.
type fakeAgent struct {
	processconnect.UnimplementedProcessHandler
	mu    sync.Mutex
	calls []string // user|cwd|command
	tries int
}

func (f *fakeAgent) Start(_ context.Context, req *connect.Request[process.StartRequest], st *connect.ServerStream[process.StartResponse]) error {
	cmd := strings.Join(req.Msg.GetProcess().GetArgs(), " ")
	f.mu.Lock()
	f.calls = append(f.calls, req.Header().Get("Authorization")+"|"+req.Msg.GetProcess().GetCwd()+"|"+cmd)
	code := int32(0)
	switch {
	case strings.Contains(cmd, "ready-after-2"):
		f.tries++
		if f.tries <= 2 {
			code = 1
		}
	case strings.Contains(cmd, "never-ready"):
		code = 7
	}
	f.mu.Unlock()
	ev := func(e *process.ProcessEvent) error { return st.Send(&process.StartResponse{Event: e}) }
	if err := ev(&process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: 42}}}); err != nil {
		return err
	}
	if strings.Contains(cmd, "serve-forever") {
		// A start command: runs on; the gateway closes its stream.
		time.Sleep(50 * time.Millisecond)
		return nil
	}
	return ev(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: &process.ProcessEvent_EndEvent{ExitCode: code, Exited: true}}})
}

func TestTemplateStartAndReadyCmd(t *testing.T) {
	agent := &fakeAgent{}
	path, ph := processconnect.NewProcessHandler(agent)
	mux := http.NewServeMux()
	mux.Handle(nodeclient.AgentPrefix, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The gateway's node token, never the principal's.
		if r.Header.Get(auth.TokenHeader) != "node" {
			http.Error(w, "wrong token", http.StatusForbidden)
			return
		}
		// /agent/<id>/process.Process/Start → the process service.
		rest := strings.TrimPrefix(r.URL.Path, nodeclient.AgentPrefix)
		_, p, _ := strings.Cut(rest, "/")
		r.URL.Path, r.URL.RawPath = "/"+p, ""
		if !strings.HasPrefix(r.URL.Path, path) {
			http.NotFound(w, r)
			return
		}
		ph.ServeHTTP(w, r)
	}))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)

	h := newHarnessAt(t, srv.URL, auth.StaticToken("node"))
	fb := &fakeBuilder{}
	h.gw.cfg.Builder = fb
	h.gw.cfg.StateDir = t.TempDir()
	h.gw.cfg.ReadyTimeout = 2 * time.Second
	h.gw.api = h.gw.apiMux()
	t.Cleanup(h.gw.builds.Wait)

	build := func(name, ready string) {
		t.Helper()
		tid, bid, w, _ := h.startBuild(name, `{"fromTemplate":"base","steps":[{"type":"WORKDIR","args":["/srv"]}],
			"startCmd":"serve-forever","readyCmd":"`+ready+`"}`)
		if w.Code != 202 {
			t.Fatalf("start: %d %s", w.Code, w.Body)
		}
		if st, logs := h.waitBuild(h.keyA, tid, bid); st["status"] != buildReady {
			t.Fatalf("build: %v %v", st, logs)
		}
		req, _ := fb.last()
		if req.StartCmd != "serve-forever" || req.ReadyCmd != ready {
			t.Fatalf("the image config's commands: %+v", req)
		}
		h.api.extraImages = append(h.api.extraImages, req.Name)
	}
	build("srv", "ready-after-2")
	w, _ := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"srv"}`)
	if w.Code != 201 {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	agent.mu.Lock()
	calls := agent.calls
	agent.mu.Unlock()
	if len(calls) != 4 || !strings.HasSuffix(calls[0], "|/srv|-c serve-forever") || !strings.HasSuffix(calls[3], "|/srv|-c ready-after-2") ||
		!strings.HasPrefix(calls[0], "Basic ") {
		t.Fatalf("calls %q", calls)
	}

	// A ready command that never succeeds: no sandbox, a message without
	// the node's internals.
	h.gw.cfg.ReadyTimeout = 500 * time.Millisecond
	build("never", "never-ready")
	before := len(h.api.sbs)
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"never"}`)
	if w.Code != http.StatusGatewayTimeout || !strings.Contains(m["message"].(string), `ready command "never-ready" did not succeed`) ||
		strings.Contains(m["message"].(string), "127.0.0.1") {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	if len(h.api.sbs) != before {
		t.Fatalf("the sandbox was left: %d, before %d", len(h.api.sbs), before)
	}
}
