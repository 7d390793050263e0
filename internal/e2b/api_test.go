package e2b

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// fakeAPI is an in-memory sandbox service for testing the gateway's REST
// logic; the live suite in test/e2b runs the real one.
type fakeAPI struct {
	mu    sync.Mutex
	sbs   map[string]*v1.Sandbox
	clock time.Time
	// bearers are the tokens (auth.BearerFrom) of the create, get, list
	// and stop calls.
	bearers []string
	// forks are the ForkSandbox requests.
	forks []*v1.ForkSandboxRequest
	// networkOff refuses any network policy, as a node whose
	// node.network.enabled is false does.
	networkOff bool
	// extraImages are images besides the default ones that creates find.
	extraImages []string
	// pauses are the PauseSandbox requests.
	pauses []*v1.PauseSandboxRequest
	// noFSPause refuses filesystem-only pauses as a node whose backend
	// cannot do them does (microvm, vm).
	noFSPause bool
}

// seen records the token the call in ctx carries; f.mu is held.
func (f *fakeAPI) seen(ctx context.Context) { f.bearers = append(f.bearers, auth.BearerFrom(ctx)) }

var _ SandboxAPI = (*fakeAPI)(nil)

func newFakeAPI() *fakeAPI {
	return &fakeAPI{sbs: map[string]*v1.Sandbox{}, clock: time.Unix(1_800_000_000, 0)}
}

func (f *fakeAPI) CreateSandbox(ctx context.Context, r *connect.Request[v1.CreateSandboxRequest]) (*connect.Response[v1.CreateSandboxResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen(ctx)
	if f.networkOff && r.Msg.GetSpec().GetNetwork() != nil {
		return nil, errdefs.ToConnect(errdefs.NetworkOff("n001"))
	}
	if f.noFSPause && r.Msg.GetSpec().GetOnTimeout() == sandboxspec.OnTimeoutPauseFilesystem {
		return nil, errdefs.ToConnect(errdefs.Invalid("on_timeout", "the microvm backend cannot pause a sandbox keeping only its files; give \"pause\" (memory kept) or \"stop\", or run it on a backend that can (container)"))
	}
	if !slices.Contains(append([]string{"root/py:3.11", DefaultImage, CodeInterpreterImage, "root/busybox"}, f.extraImages...), r.Msg.GetSpec().GetImage()) {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "image %q not found", r.Msg.GetSpec().GetImage()))
	}
	f.clock = f.clock.Add(time.Second)
	sb := &v1.Sandbox{
		Id: sandboxid.New("n001"), Spec: r.Msg.GetSpec(), State: v1.SandboxState_SANDBOX_STATE_RUNNING,
		CreatedAt: timestamppb.New(f.clock), ExpiresAt: timestamppb.New(f.clock.Add(time.Duration(r.Msg.GetSpec().GetTimeoutSeconds()) * time.Second)),
	}
	f.sbs[sb.Id] = sb
	return connect.NewResponse(&v1.CreateSandboxResponse{Sandbox: sb}), nil
}

func (f *fakeAPI) GetSandbox(ctx context.Context, r *connect.Request[v1.GetSandboxRequest]) (*connect.Response[v1.GetSandboxResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen(ctx)
	sb, ok := f.sbs[r.Msg.GetId()]
	if !ok {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "sandbox not found"))
	}
	return connect.NewResponse(&v1.GetSandboxResponse{Sandbox: sb}), nil
}

func (f *fakeAPI) ListSandboxes(ctx context.Context, r *connect.Request[v1.ListSandboxesRequest]) (*connect.Response[v1.ListSandboxesResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen(ctx)
	var out []*v1.Sandbox
next:
	for _, sb := range f.sbs {
		for k, v := range r.Msg.GetLabels() {
			if sb.GetSpec().GetLabels()[k] != v {
				continue next
			}
		}
		out = append(out, sb)
	}
	return connect.NewResponse(&v1.ListSandboxesResponse{Sandboxes: out}), nil
}

func (f *fakeAPI) StopSandbox(ctx context.Context, r *connect.Request[v1.StopSandboxRequest]) (*connect.Response[v1.StopSandboxResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen(ctx)
	delete(f.sbs, r.Msg.GetId())
	return connect.NewResponse(&v1.StopSandboxResponse{}), nil
}

func (f *fakeAPI) SetTimeout(_ context.Context, r *connect.Request[v1.SetTimeoutRequest]) (*connect.Response[v1.SetTimeoutResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb := f.sbs[r.Msg.GetId()]
	sb.ExpiresAt = timestamppb.New(time.Now().Add(time.Duration(r.Msg.GetTimeoutSeconds()) * time.Second))
	return connect.NewResponse(&v1.SetTimeoutResponse{Sandbox: sb}), nil
}

func (f *fakeAPI) SetNetwork(_ context.Context, r *connect.Request[v1.SetNetworkRequest]) (*connect.Response[v1.SetNetworkResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sbs[r.Msg.GetId()]
	if !ok {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "sandbox not found"))
	}
	sb.Spec.Network = r.Msg.GetNetwork()
	return connect.NewResponse(&v1.SetNetworkResponse{Sandbox: sb}), nil
}

type harness struct {
	t    *testing.T
	api  *fakeAPI
	gw   *Gateway
	keyA string
	keyB string
	iss  *auth.Issuer
}

func newHarness(t *testing.T) *harness {
	t.Helper()
	// The node address is never dialled by these tests.
	return newHarnessAt(t, "http://127.0.0.1:1", auth.StaticToken("unused"))
}

// newHarnessAt is newHarness with node n001 at addr, called with tokens.
func newHarnessAt(t *testing.T, addr string, tokens auth.TokenSource) *harness {
	t.Helper()
	keys := NewKeyStore(filepath.Join(t.TempDir(), "keys.json"))
	a, err := keys.Create("team-a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := keys.Create("team-b")
	if err != nil {
		t.Fatal(err)
	}
	api := newFakeAPI()
	iss, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	nodes, err := nodeclient.NewStaticDirectory(nodeclient.NodeInfo{ID: "n001", Addr: addr})
	if err != nil {
		t.Fatal(err)
	}
	gw, err := New(Config{API: api, Keys: keys, Tokens: iss, Secret: []byte("0123456789abcdef0123"),
		Nodes: nodes, NodeTokens: tokens})
	if err != nil {
		t.Fatal(err)
	}
	return &harness{t: t, api: api, gw: gw, keyA: a, keyB: b, iss: iss}
}

func (h *harness) do(key, method, path, body string) (*httptest.ResponseRecorder, map[string]any) {
	h.t.Helper()
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	if key != "" {
		req.Header.Set("X-API-Key", key)
	}
	w := httptest.NewRecorder()
	h.gw.ServeHTTP(w, req)
	var m map[string]any
	if strings.HasPrefix(strings.TrimSpace(w.Body.String()), "{") {
		if err := json.Unmarshal(w.Body.Bytes(), &m); err != nil {
			h.t.Fatalf("%s %s: body %q: %v", method, path, w.Body, err)
		}
	}
	return w, m
}

func TestCreateGetKill(t *testing.T) {
	h := newHarness(t)
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"sandbox_test_id":"x"},"envVars":{"A":"b"}}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	id := m["sandboxID"].(string)
	if m["envdVersion"] != EnvdVersion || m["clientID"] != ClientID || m["templateID"] != "base" || m["domain"] != DefaultDomain {
		t.Fatalf("create response %v", m)
	}
	if tok, _ := m["envdAccessToken"].(string); tok != h.gw.accessToken(id) || tok == "" {
		t.Fatalf("v2 create must issue the envd access token, got %v", m["envdAccessToken"])
	}
	spec := h.api.sbs[id].GetSpec()
	if spec.GetEnv()["A"] != "b" || spec.GetUser() != "user" || spec.GetWorkdir() != "/home/user" || spec.GetTimeoutSeconds() != 300 {
		t.Fatalf("spec sent to OpenDsec: %v", spec)
	}
	w, m = h.do(h.keyA, "GET", "/sandboxes/"+id, "")
	if w.Code != 200 || m["state"] != "running" || m["metadata"].(map[string]any)["sandbox_test_id"] != "x" {
		t.Fatalf("get: %d %v", w.Code, m)
	}
	// Another principal sees nothing of it.
	if w, _ := h.do(h.keyB, "GET", "/sandboxes/"+id, ""); w.Code != http.StatusNotFound {
		t.Fatalf("get by another key: %d", w.Code)
	}
	if w, _ := h.do(h.keyB, "DELETE", "/sandboxes/"+id, ""); w.Code != http.StatusNotFound {
		t.Fatalf("kill by another key: %d", w.Code)
	}
	if w, _ := h.do(h.keyA, "DELETE", "/sandboxes/"+id, ""); w.Code != http.StatusNoContent {
		t.Fatalf("kill: %d %s", w.Code, w.Body)
	}
	if w, m := h.do(h.keyA, "DELETE", "/sandboxes/"+id, ""); w.Code != http.StatusNotFound || m["code"] != float64(404) {
		t.Fatalf("second kill: %d %v", w.Code, m)
	}
}

func TestV1CreateSecureDefault(t *testing.T) {
	h := newHarness(t)
	_, m := h.do(h.keyA, "POST", "/sandboxes", `{"templateID":"base"}`)
	if m["envdAccessToken"] == nil {
		t.Fatalf("v1 create without secure must default to secure: %v", m)
	}
	id := m["sandboxID"].(string)
	if got := h.api.sbs[id].GetSpec().GetTimeoutSeconds(); got != 15 {
		t.Fatalf("v1 default timeout = %d; want 15", got)
	}
	_, m = h.do(h.keyA, "POST", "/sandboxes", `{"templateID":"base","secure":false}`)
	if _, ok := m["envdAccessToken"]; ok {
		t.Fatalf("secure=false must not issue a token: %v", m)
	}
}

func TestBadInputChangesNothing(t *testing.T) {
	h := newHarness(t)
	for _, c := range []struct {
		key, method, path, body string
		status                  int
		msg                     string
	}{
		{"", "POST", "/v2/sandboxes", `{"templateID":"base"}`, 401, "missing API key"},
		{"e2b_" + strings.Repeat("ab", 20), "POST", "/v2/sandboxes", `{"templateID":"base"}`, 401, "invalid API key"},
		{h.keyA, "POST", "/v2/sandboxes", `{"templateID":`, 400, "not valid JSON"},
		{h.keyA, "POST", "/v2/sandboxes", `{}`, 400, "templateID"},
		{h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","timeout":0}`, 400, "greater than 0"},
		{h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","timeout":86401}`, 400, "cannot be greater than 24 hours"},
		{h.keyA, "POST", "/v2/sandboxes", `{"templateID":"nope"}`, 404, "template \"nope\" not found"},
		{h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"k":"` + strings.Repeat("v", 300) + `"}}`, 400, "metadata"},
		{h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","metadata":` + bigMap(100) + `}`, 400, "at most 64"},
		{h.keyA, "GET", "/sandboxes/n001aaaaaaaaaaaaaaaa", "", 404, "not found"},
		{h.keyA, "GET", "/sandboxes/bad!", "", 404, "not found"},
		{h.keyA, "GET", "/v2/sandboxes?limit=0", "", 400, "limit"},
		{h.keyA, "GET", "/v2/sandboxes?state=frozen", "", 400, "state"},
		{h.keyA, "GET", "/v2/sandboxes?nextToken=zzz", "", 400, "nextToken"},
		{h.keyA, "GET", "/v2/sandboxes?metadata=novalue", "", 400, "metadata"},
	} {
		w, m := h.do(c.key, c.method, c.path, c.body)
		msg, _ := m["message"].(string)
		if w.Code != c.status || m["code"] != float64(c.status) || !strings.Contains(msg, c.msg) {
			t.Errorf("%s %s %s: %d %s; want %d with %q", c.method, c.path, c.body, w.Code, w.Body, c.status, c.msg)
		}
	}
	if len(h.api.sbs) != 0 {
		t.Fatalf("bad input made %d sandboxes", len(h.api.sbs))
	}
}

func bigMap(n int) string {
	parts := make([]string, n)
	for i := range parts {
		parts[i] = `"k` + strings.Repeat("x", i%5) + string(rune('a'+i%26)) + string(rune('a'+i/26)) + `":"v"`
	}
	return "{" + strings.Join(parts, ",") + "}"
}

func TestListPagingAndFilters(t *testing.T) {
	h := newHarness(t)
	var ids []string
	for i := range 3 {
		md := `{"group":"g"}`
		if i == 2 {
			md = `{"group":"other"}`
		}
		_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","metadata":`+md+`}`)
		ids = append(ids, m["sandboxID"].(string))
	}
	h.do(h.keyB, "POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"group":"g"}}`)

	var got []string
	path := "/v2/sandboxes?limit=1&metadata=" + "group%3Dg"
	for range 5 {
		w, _ := h.do(h.keyA, "GET", path, "")
		var page []map[string]any
		if err := json.Unmarshal(w.Body.Bytes(), &page); err != nil || w.Code != 200 {
			t.Fatalf("list: %d %s", w.Code, w.Body)
		}
		for _, p := range page {
			got = append(got, p["sandboxID"].(string))
		}
		next := w.Header().Get("X-Next-Token")
		if next == "" {
			break
		}
		path = "/v2/sandboxes?limit=1&metadata=group%3Dg&nextToken=" + next
	}
	// Newest first; only team A's sandboxes with group=g.
	if want := []string{ids[1], ids[0]}; strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("paged list = %v; want %v", got, want)
	}
	w, _ := h.do(h.keyA, "GET", "/v2/sandboxes?order=asc", "")
	var all []map[string]any
	_ = json.Unmarshal(w.Body.Bytes(), &all)
	if len(all) != 3 || all[0]["sandboxID"] != ids[0] || w.Header().Get("X-Total-Running") != "3" {
		t.Fatalf("asc list = %v (total %s)", all, w.Header().Get("X-Total-Running"))
	}
}

func TestConnectNeverShortensAndTimeout(t *testing.T) {
	h := newHarness(t)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","timeout":3600}`)
	id := m["sandboxID"].(string)
	before := h.api.sbs[id].GetExpiresAt().AsTime()
	if w, m := h.do(h.keyA, "POST", "/v2/sandboxes/"+id+"/connect", `{"timeout":10}`); w.Code != 200 || m["sandboxID"] != id {
		t.Fatalf("connect: %d %v", w.Code, m)
	}
	if after := h.api.sbs[id].GetExpiresAt().AsTime(); !after.Equal(before) {
		t.Fatalf("connect shortened the lifetime from %s to %s", before, after)
	}
	if w, _ := h.do(h.keyA, "POST", "/sandboxes/"+id+"/timeout", `{"timeout":10}`); w.Code != http.StatusNoContent {
		t.Fatalf("set timeout: %d", w.Code)
	}
	if left := time.Until(h.api.sbs[id].GetExpiresAt().AsTime()); left > 11*time.Second {
		t.Fatalf("set timeout left %s; want about 10s", left)
	}
	if w, _ := h.do(h.keyA, "POST", "/sandboxes/n001aaaaaaaaaaaaaaaa/connect", `{"timeout":10}`); w.Code != http.StatusNotFound {
		t.Fatalf("connect unknown: %d", w.Code)
	}
}

func TestProxyRefusesUnknownAndInternal(t *testing.T) {
	h := newHarness(t)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	id := m["sandboxID"].(string)
	for _, c := range []struct {
		id, port, path string
		status         int
	}{
		{"n001bbbbbbbbbbbbbbbb", "49983", "/health", 502},
		{id, "49983", "/init", 404},
		{id, "49983", "/_opendsec/port/22", 404},
		{id, "49983", "/process.Process/List", 401}, // no access token
		{"BAD", "49983", "/health", 400},
		{id, "", "/health", 400},
	} {
		req := httptest.NewRequest("POST", c.path, nil)
		req.Header.Set("E2b-Sandbox-Id", c.id)
		if c.port != "" {
			req.Header.Set("E2b-Sandbox-Port", c.port)
		}
		w := httptest.NewRecorder()
		h.gw.ServeHTTP(w, req)
		if w.Code != c.status {
			t.Errorf("%s %s: %d %s; want %d", c.id, c.path, w.Code, w.Body, c.status)
		}
	}
	if id, port, ok := h.gw.hostRoute("8000-" + id + ".opendsec.local:3000"); !ok || port != 8000 || id == "" {
		t.Fatalf("hostRoute did not parse a sandbox host")
	}
	if _, _, ok := h.gw.hostRoute("127.0.0.1:3000"); ok {
		t.Fatalf("hostRoute routed the API host")
	}
}

// base and code-interpreter-v1 start root/base and root/code-interpreter
// unless e2b.templates maps them; any other template is an image name.
func TestTemplateImages(t *testing.T) {
	h := newHarness(t)
	for _, c := range []struct{ template, image string }{
		{DefaultTemplate, "root/base"},
		{CodeInterpreterTemplate, "root/code-interpreter"},
		{"root/busybox", "root/busybox"},
	} {
		w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"`+c.template+`"}`)
		if w.Code != http.StatusCreated {
			t.Fatalf("create %s: %d %s", c.template, w.Code, w.Body)
		}
		if img := h.api.sbs[m["sandboxID"].(string)].GetSpec().GetImage(); img != c.image || m["templateID"] != c.template {
			t.Errorf("%s created image %q (template %v), want %q", c.template, img, m["templateID"], c.image)
		}
	}
	cfg := h.gw.cfg
	cfg.Templates = map[string]string{CodeInterpreterTemplate: "team/jupyter:1"}
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if img := g.imageFor(CodeInterpreterTemplate); img != "team/jupyter:1" {
		t.Errorf("mapped %s: image %q, want team/jupyter:1", CodeInterpreterTemplate, img)
	}
	if img := g.imageFor(DefaultTemplate); img != DefaultImage {
		t.Errorf("unmapped %s: image %q, want %q", DefaultTemplate, img, DefaultImage)
	}
}

// The gateway calls the API as each API key's principal: every REST call
// carries a user-scope token for that principal, signed by the issuer, and
// never the gateway's own (admin) token; key B's calls are B's.
func TestCallsActAsPrincipal(t *testing.T) {
	h := newHarness(t)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	id, _ := m["sandboxID"].(string)
	h.do(h.keyA, "GET", "/sandboxes/"+id, "")
	h.do(h.keyA, "GET", "/v2/sandboxes", "")
	h.do(h.keyB, "GET", "/sandboxes/"+id, "")
	h.do(h.keyB, "DELETE", "/sandboxes/"+id, "")
	h.do(h.keyA, "DELETE", "/sandboxes/"+id, "")
	h.api.mu.Lock()
	bearers := slices.Clone(h.api.bearers)
	h.api.mu.Unlock()
	var got []string
	for _, tok := range bearers {
		c, err := auth.Verify(h.iss.PublicKey(), tok, time.Now())
		if err != nil {
			t.Fatalf("API call with token %q: %v", tok, err)
		}
		got = append(got, c.Subject+"/"+c.Scope)
	}
	// B's kill looks the sandbox up (and finds it is not B's) before any
	// stop; A's kill looks it up, then stops it.
	want := []string{"team-a/user", "team-a/user", "team-a/user", "team-b/user", "team-b/user", "team-a/user", "team-a/user"}
	if !slices.Equal(got, want) {
		t.Fatalf("API calls made as %q, want %q", got, want)
	}
}

// E2B sandboxes let user sudo, as E2B's do: creates ask for privilege
// escalation unless e2b.allow_privilege_escalation is false.
func TestCreateAllowsPrivilegeEscalation(t *testing.T) {
	h := newHarness(t)
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	if !h.api.sbs[m["sandboxID"].(string)].GetSpec().GetAllowPrivilegeEscalation() {
		t.Fatal("E2B create did not allow privilege escalation (sudo as user)")
	}
	cfg := h.gw.cfg
	cfg.NoPrivilegeEscalation = true
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.gw = g
	w, m = h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	if h.api.sbs[m["sandboxID"].(string)].GetSpec().GetAllowPrivilegeEscalation() {
		t.Fatal("with e2b.allow_privilege_escalation false the create still allowed privilege escalation")
	}
}
