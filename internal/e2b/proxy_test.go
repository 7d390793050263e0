package e2b

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// trafficNode stands in for node n001's agent proxy over HTTP/1.1 and h2c
// on loopback: it checks the gateway's node token, answers envd's /health,
// and serves the agent's port tunnel (a real HTTP/1.1 Upgrade) to a
// loopback HTTP server standing in for port 8000 inside the sandbox. Port
// 49999 answers the agent's 503 for a service that cannot start.
type trafficNode struct {
	url string
	// paused makes the node's sandbox paused: a call with
	// NoAutoResumeHeader is refused as the node refuses it, any other
	// call resumes it.
	paused atomic.Bool

	mu   sync.Mutex
	seen []string // "<proto> <path> <caller's token if it leaked>" of each request
}

func newTrafficNode(t *testing.T) (*trafficNode, auth.TokenSource) {
	t.Helper()
	key, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	tok, err := key.Issue("e2b-gateway", auth.ScopeNode, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "port 8000 got %s %s host=%s", r.Method, r.URL.RequestURI(), r.Host)
	}))
	t.Cleanup(app.Close)

	n := &trafficNode{}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.mu.Lock()
		leak := ""
		if strings.Contains(r.Header.Get("Authorization")+r.Header.Get(auth.TokenHeader), "the-callers-own") {
			leak = "caller's token"
		}
		if r.Header.Get(nodeclient.NoAutoResumeHeader) != "" {
			leak += "no-resume"
		}
		n.seen = append(n.seen, fmt.Sprintf("%s %s %s", r.Proto, r.URL.Path, leak))
		n.mu.Unlock()
		if n.paused.Load() {
			if r.Header.Get(nodeclient.NoAutoResumeHeader) != "" {
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set(nodeclient.NoAutoResumeHeader, "paused")
				w.WriteHeader(http.StatusBadRequest)
				json.NewEncoder(w).Encode(map[string]any{"code": 400, "message": "sandbox is paused", "status": "failed_precondition"})
				return
			}
			n.paused.Store(false) // resumed
		}
		_, sub, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/agent/"), "/")
		switch sub {
		case "health":
			w.WriteHeader(http.StatusNoContent)
		case "_opendsec/port/49999":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			json.NewEncoder(w).Encode(map[string]any{"code": 503, "message": "python3 is not in the image"})
		case "_opendsec/port/8000":
			up, err := net.Dial("tcp", app.Listener.Addr().String())
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			defer up.Close()
			conn, brw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				return
			}
			defer conn.Close()
			brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
			brw.Flush()
			go io.Copy(up, brw)
			io.Copy(conn, up)
		default:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadGateway)
			json.NewEncoder(w).Encode(map[string]any{"code": 502, "message": "port is not open"})
		}
	})
	srv := httptest.NewUnstartedServer(auth.NewVerifier(key.PublicKey(), auth.ScopeNode).Middleware(h))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	n.url = srv.URL
	return n, auth.StaticToken(tok)
}

func (n *trafficNode) requests() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.seen...)
}

// TestProxyReachesTheSandboxThroughItsNode: envd traffic goes to the
// node's agent path over h2c with the gateway's node token (the caller's
// own bearer token stripped), user ports through a real tunnel over
// HTTP/1.1, and refusals map to E2B's answers.
func TestProxyReachesTheSandboxThroughItsNode(t *testing.T) {
	node, tokens := newTrafficNode(t)
	h := newHarnessAt(t, node.url, tokens)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	id := m["sandboxID"].(string)

	send := func(host, sandbox, port, path string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("GET", path, nil)
		req.Host = host
		if sandbox != "" {
			req.Header.Set("E2b-Sandbox-Id", sandbox)
			req.Header.Set("E2b-Sandbox-Port", port)
		}
		req.Header.Set("Authorization", "Bearer the-callers-own")
		w := httptest.NewRecorder()
		h.gw.ServeHTTP(w, req)
		return w
	}

	if w := send("api.opendsec.local", id, "49983", "/health"); w.Code != http.StatusNoContent {
		t.Fatalf("envd /health: %d %s", w.Code, w.Body)
	}
	if got, want := node.requests(), "HTTP/2.0 /agent/"+id+"/health "; len(got) != 1 || got[0] != want {
		t.Fatalf("node saw %q, want [%q]", got, want)
	}

	w := send("8000-"+id+".opendsec.local", "", "", "/hello?x=1")
	if w.Code != http.StatusOK || w.Body.String() != "port 8000 got GET /hello?x=1 host=8000-"+id+".opendsec.local" {
		t.Fatalf("port 8000 by host: %d %q", w.Code, w.Body)
	}
	if got := node.requests(); len(got) != 2 || got[1] != "HTTP/1.1 /agent/"+id+"/_opendsec/port/8000 " {
		t.Fatalf("node saw %q, want the tunnel over HTTP/1.1 second", got)
	}

	w = send("49999-"+id+".opendsec.local", "", "", "/contexts")
	if w.Code != http.StatusServiceUnavailable || !strings.Contains(w.Body.String(), "python3 is not in the image") {
		t.Fatalf("interpreter that cannot start: %d %s; want the agent's 503 and reason", w.Code, w.Body)
	}
	w = send("9-"+id+".opendsec.local", "", "", "/")
	if w.Code != http.StatusBadGateway || !strings.Contains(w.Body.String(), "port is not open") {
		t.Fatalf("closed port: %d %s", w.Code, w.Body)
	}

	// A sandbox of a node the directory does not know never reaches a node.
	before := len(node.requests())
	w = send("api.opendsec.local", "n009"+id[4:], "49983", "/health")
	if w.Code != http.StatusBadGateway || !strings.Contains(w.Body.String(), "The sandbox was not found") {
		t.Fatalf("unknown node: %d %s", w.Code, w.Body)
	}
	if len(node.requests()) != before {
		t.Fatal("a sandbox of an unknown node was sent to node n001")
	}
}

// TestProxyTrafficToPausedSandboxGoesToItsNode: traffic to a paused
// sandbox, envd's and a user port's, is sent to its node, which resumes it
// first; envd's /health (E2B's isRunning) answers 502 without waking it.
func TestProxyTrafficToPausedSandboxGoesToItsNode(t *testing.T) {
	node, tokens := newTrafficNode(t)
	h := newHarnessAt(t, node.url, tokens)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","secure":false}`)
	id := m["sandboxID"].(string)
	token, _ := m["envdAccessToken"].(string)
	if w, m := h.do(h.keyA, "POST", "/sandboxes/"+id+"/pause", ``); w.Code != http.StatusNoContent {
		t.Fatalf("pause: %d %v", w.Code, m)
	}
	send := func(host, port, path string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("GET", path, nil)
		req.Host = host
		if port != "" {
			req.Header.Set("E2b-Sandbox-Id", id)
			req.Header.Set("E2b-Sandbox-Port", port)
		}
		req.Header.Set("X-Access-Token", token)
		w := httptest.NewRecorder()
		h.gw.ServeHTTP(w, req)
		return w
	}
	if w := send("api.opendsec.local", "49983", "/health"); w.Code != http.StatusBadGateway {
		t.Fatalf("envd /health of a paused sandbox: %d %s, want 502 (not running)", w.Code, w.Body)
	}
	if got := node.requests(); len(got) != 0 {
		t.Fatalf("the probe of a paused sandbox reached its node: %q", got)
	}
	if w := send("api.opendsec.local", "49983", "/files?path=/x"); len(node.requests()) != 1 || node.requests()[0] != "HTTP/2.0 /agent/"+id+"/files " {
		t.Fatalf("envd traffic to a paused sandbox: %d %s; node saw %q, want it sent to the node", w.Code, w.Body, node.requests())
	}
	w := send("8000-"+id+".opendsec.local", "", "/hello")
	if w.Code != http.StatusOK || !strings.HasPrefix(w.Body.String(), "port 8000 got GET /hello") {
		t.Fatalf("port traffic to a paused sandbox: %d %q, want it tunnelled", w.Code, w.Body)
	}
}

// TestProxyAutoResumeOff: a sandbox created with autoResume
// {"enabled": false} is not woken by traffic while paused: envd and user
// ports answer E2B's 502 "sandbox not found" and nothing reaches its node;
// once resumed (connect) traffic flows again. Its detail says
// lifecycle.autoResume false; an unset or true autoResume says true.
func TestProxyAutoResumeOff(t *testing.T) {
	node, tokens := newTrafficNode(t)
	h := newHarnessAt(t, node.url, tokens)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","autoPause":true,"autoResume":{"enabled":false}}`)
	id := m["sandboxID"].(string)
	token, _ := m["envdAccessToken"].(string)
	send := func(host, port, path string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("GET", path, nil)
		req.Host = host
		if port != "" {
			req.Header.Set("E2b-Sandbox-Id", id)
			req.Header.Set("E2b-Sandbox-Port", port)
		}
		req.Header.Set("X-Access-Token", token)
		w := httptest.NewRecorder()
		h.gw.ServeHTTP(w, req)
		return w
	}
	// Running: traffic flows (and a lookup made while it ran is not kept
	// to let traffic through once it is paused).
	if w := send("8000-"+id+".opendsec.local", "", "/up"); w.Code != http.StatusOK {
		t.Fatalf("port traffic to a running sandbox: %d %s", w.Code, w.Body)
	}
	if _, d := h.do(h.keyA, "GET", "/sandboxes/"+id, ""); d["lifecycle"].(map[string]any)["autoResume"] != false {
		t.Fatalf("detail lifecycle %v, want autoResume false", d["lifecycle"])
	}
	h.api.mu.Lock()
	h.api.sbs[id].State = v1.SandboxState_SANDBOX_STATE_PAUSED // paused by its node (timeout), not through the gateway
	h.api.mu.Unlock()
	before := len(node.requests())
	if w := send("api.opendsec.local", "49983", "/files?path=/x"); w.Code != http.StatusBadGateway || !strings.Contains(w.Body.String(), "The sandbox was not found") {
		t.Fatalf("envd traffic to a paused sandbox with autoResume off: %d %s, want 502", w.Code, w.Body)
	}
	if w := send("8000-"+id+".opendsec.local", "", "/hello"); w.Code != http.StatusBadGateway {
		t.Fatalf("port traffic to a paused sandbox with autoResume off: %d %s, want 502", w.Code, w.Body)
	}
	if got := node.requests(); len(got) != before {
		t.Fatalf("traffic to a paused sandbox with autoResume off reached its node: %q", got[before:])
	}
	// Paused by its node after the gateway looked it up (the API still
	// says running): the gateway's calls ask the node not to resume it,
	// and the node's refusal is E2B's 502.
	h.api.mu.Lock()
	h.api.sbs[id].State = v1.SandboxState_SANDBOX_STATE_RUNNING
	h.api.mu.Unlock()
	node.paused.Store(true)
	before = len(node.requests())
	if w := send("api.opendsec.local", "49983", "/files?path=/x"); w.Code != http.StatusBadGateway || !strings.Contains(w.Body.String(), "The sandbox was not found") {
		t.Fatalf("envd traffic racing a pause, autoResume off: %d %s, want 502", w.Code, w.Body)
	}
	if w := send("8000-"+id+".opendsec.local", "", "/hello"); w.Code != http.StatusBadGateway || !strings.Contains(w.Body.String(), "The sandbox was not found") {
		t.Fatalf("port traffic racing a pause, autoResume off: %d %s, want 502", w.Code, w.Body)
	}
	got := node.requests()[before:]
	if len(got) != 2 || !strings.HasSuffix(got[0], " no-resume") || !strings.HasSuffix(got[1], " no-resume") || !node.paused.Load() {
		t.Fatalf("node saw %q (paused %v), want both calls marked no-resume and the sandbox still paused", got, node.paused.Load())
	}
	h.api.mu.Lock()
	h.api.sbs[id].State = v1.SandboxState_SANDBOX_STATE_PAUSED
	h.api.mu.Unlock()
	node.paused.Store(false)
	if w, m := h.do(h.keyA, "POST", "/v2/sandboxes/"+id+"/connect", `{}`); w.Code != http.StatusCreated {
		t.Fatalf("connect (resume): %d %v", w.Code, m)
	}
	if w := send("8000-"+id+".opendsec.local", "", "/again"); w.Code != http.StatusOK {
		t.Fatalf("port traffic after connect: %d %s", w.Code, w.Body)
	}

	for _, body := range []string{`{"templateID":"base"}`, `{"templateID":"base","autoPause":true,"autoResume":{"enabled":true}}`} {
		_, m := h.do(h.keyA, "POST", "/v2/sandboxes", body)
		if _, d := h.do(h.keyA, "GET", "/sandboxes/"+m["sandboxID"].(string), ""); d["lifecycle"].(map[string]any)["autoResume"] != true {
			t.Errorf("%s: detail lifecycle %v, want autoResume true", body, d["lifecycle"])
		}
	}
}

// TestProxyMaskRequestHost: with network.maskRequestHost the Host header
// of requests to user ports is the mask with ${PORT} replaced (E2B's
// proxy); the detail reports the mask; a bad mask is refused at create.
func TestProxyMaskRequestHost(t *testing.T) {
	node, tokens := newTrafficNode(t)
	h := newHarnessAt(t, node.url, tokens)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","network":{"maskRequestHost":"custom-host.example.com:${PORT}"}}`)
	id := m["sandboxID"].(string)
	req := httptest.NewRequest("GET", "/hello", nil)
	req.Host = "8000-" + id + ".opendsec.local"
	w := httptest.NewRecorder()
	h.gw.ServeHTTP(w, req)
	if w.Code != http.StatusOK || w.Body.String() != "port 8000 got GET /hello host=custom-host.example.com:8000" {
		t.Fatalf("masked port traffic: %d %q", w.Code, w.Body)
	}
	if _, d := h.do(h.keyA, "GET", "/sandboxes/"+id, ""); d["network"] == nil || d["network"].(map[string]any)["maskRequestHost"] != "custom-host.example.com:${PORT}" {
		t.Fatalf("detail network %v, want the mask", d["network"])
	}
	// Without a mask the caller's Host goes through (TestProxyReachesTheSandboxThroughItsNode).
	before := len(h.api.sbs)
	for _, bad := range []string{"has space:${PORT}", "a\r\nX-Evil: 1", "host/path", strings.Repeat("a", 300)} {
		body, _ := json.Marshal(map[string]any{"templateID": "base", "network": map[string]any{"maskRequestHost": bad}})
		w, m := h.do(h.keyA, "POST", "/v2/sandboxes", string(body))
		if w.Code != http.StatusBadRequest || !strings.Contains(fmt.Sprint(m["message"]), "network.maskRequestHost") {
			t.Errorf("mask %q: %d %v, want 400 naming network.maskRequestHost", bad, w.Code, m)
		}
	}
	if w, m := h.do(h.keyA, "PUT", "/sandboxes/"+id+"/network", `{"maskRequestHost":"x:${PORT}"}`); w.Code != http.StatusBadRequest || !strings.Contains(fmt.Sprint(m["message"]), "maskRequestHost") {
		t.Errorf("update with maskRequestHost: %d %v, want 400 naming it", w.Code, m)
	}
	if len(h.api.sbs) != before {
		t.Fatalf("refused creates made sandboxes")
	}
}
