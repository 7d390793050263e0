package e2b

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
)

// validatingAPI is the fake API with the apiserver's own validation of a
// create (sandboxspec), so what the gateway sends is judged as the real
// API would.
type validatingAPI struct{ *fakeAPI }

func (v validatingAPI) CreateSandbox(ctx context.Context, r *connect.Request[v1.CreateSandboxRequest]) (*connect.Response[v1.CreateSandboxResponse], error) {
	if err := sandboxspec.CheckRequestID("request_id", r.Msg.GetRequestId(), sandboxspec.MaxRequestIDLen); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	s, err := specpb.FromProto(r.Msg.GetSpec())
	if err == nil {
		_, err = sandboxspec.Normalize(s)
	}
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return v.fakeAPI.CreateSandbox(ctx, r)
}

// badInputGateway is a gateway over validatingAPI and the API key of its
// one principal. Its node is never dialled (no sandbox a request can name
// exists on it).
func badInputGateway(t testing.TB) (*Gateway, string) {
	t.Helper()
	keys := NewKeyStore(filepath.Join(t.TempDir(), "keys.json"))
	key, err := keys.Create("team-a")
	if err != nil {
		t.Fatal(err)
	}
	iss, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	nodes, err := nodeclient.NewStaticDirectory(nodeclient.NodeInfo{ID: "n001", Addr: "http://127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	gw, err := New(Config{API: validatingAPI{newFakeAPI()}, Keys: keys, Tokens: iss, Secret: []byte("0123456789abcdef0123"),
		Nodes: nodes, NodeTokens: auth.StaticToken("unused"),
		Templates: map[string]string{DefaultTemplate: "root/py:3.11"}})
	if err != nil {
		t.Fatal(err)
	}
	return gw, key
}

// TestSecurityBadInputE2BCreate: every unbounded field of E2B's create body
// is refused with 400 naming it (as E2B's SDKs send it) and its limit.
func TestSecurityBadInputE2BCreate(t *testing.T) {
	gw, key := badInputGateway(t)
	many := func(n int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprintf("K%d", i)] = "v"
		}
		return m
	}
	body := func(v any) string {
		b, _ := json.Marshal(v)
		return string(b)
	}
	for _, tc := range []struct {
		name, body, want string
	}{
		{"long templateID", body(map[string]any{"templateID": strings.Repeat("t", 100<<10)}), "templateID: is longer than 256 bytes"},
		{"many envVars", body(map[string]any{"templateID": "base", "envVars": many(4097)}), "envVars: has 4097 variables; at most 4096 are allowed"},
		{"huge envVar", body(map[string]any{"templateID": "base", "envVars": map[string]string{"A": strings.Repeat("x", 200<<10)}}), "is 204802 bytes; one variable may be at most 131071"},
		{"many metadata", body(map[string]any{"templateID": "base", "metadata": many(65)}), "metadata: has 65 entries; at most 64 are allowed"},
		{"long metadata value", body(map[string]any{"templateID": "base", "metadata": map[string]string{"k": strings.Repeat("v", 300)}}), "at most 256 are allowed"},
		{"many allowOut", body(map[string]any{"templateID": "base", "network": map[string]any{"allowOut": strings.Split(strings.Repeat("1.1.1.1,", 65), ",")[:65]}}), "network.allowOut: has 65 entries; at most 64"},
		{"body over 1 MiB", body(map[string]any{"templateID": "base", "metadata": map[string]string{"k": strings.Repeat("v", 2<<20)}}), "request body is larger than 1048576 bytes"},
	} {
		for _, path := range []string{"/sandboxes", "/v2/sandboxes"} {
			req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(tc.body))
			req.Header.Set("X-API-Key", key)
			w := httptest.NewRecorder()
			gw.ServeHTTP(w, req)
			if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), tc.want) {
				t.Errorf("%s %s: %d %s, want 400 with %q", tc.name, path, w.Code, w.Body, tc.want)
			}
		}
	}
}

// allowedStatus is what the gateway may answer to bad input: a client
// error, or 501 for a route it does not support. Never 500.
func allowedStatus(code int) bool {
	return code < 500 || code == http.StatusNotImplemented
}

// FuzzCreateSandbox posts arbitrary bytes as E2B's create body (v1 and v2)
// to the real gateway over an API that validates like the apiserver: the
// gateway never panics and never answers 5xx (an internal error) for them.
// Seeds: testdata/fuzz/FuzzCreateSandbox and the bodies below.
func FuzzCreateSandbox(f *testing.F) {
	for _, b := range []string{
		`{"templateID":"base"}`,
		`{"templateID":"base","timeout":60,"metadata":{"sandbox_test_id":"x"},"envVars":{"A":"b"}}`,
		`{"templateID":"base","autoPause":true,"secure":true,"allow_internet_access":false}`,
		`{"templateID":"base","network":{"allowOut":["pypi.org","10.0.0.0/8"],"denyOut":["0.0.0.0/0"],"allowPublicTraffic":false}}`,
		`{"templateID":"base","volumeMounts":[{"name":"v","path":"/v"}],"mcp":{}}`,
		`{"templateID":"base","autoPauseMemory":false,"autoResume":{"enabled":true}}`,
		`{"templateID":"","timeout":-1}`,
		`[]`, `null`, ``, `{"templateID":1}`,
	} {
		f.Add([]byte(b), false)
		f.Add([]byte(b), true)
	}
	gw, key := badInputGateway(f)
	f.Fuzz(func(t *testing.T, body []byte, v2 bool) {
		path := "/sandboxes"
		if v2 {
			path = "/v2/sandboxes"
		}
		req := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
		req.Header.Set("X-API-Key", key)
		w := httptest.NewRecorder()
		gw.ServeHTTP(w, req)
		if !allowedStatus(w.Code) {
			t.Fatalf("POST %s %q: %d %s", path, body, w.Code, w.Body)
		}
		if w.Code != http.StatusCreated && !json.Valid(w.Body.Bytes()) {
			t.Fatalf("POST %s %q: %d with a body that is not JSON: %q", path, body, w.Code, w.Body)
		}
	})
}

// FuzzRoutes sends arbitrary methods, paths with query strings, bodies,
// sandbox routing headers and Host names to the gateway (the REST routes,
// the signed /files route and the traffic proxy's routing): never a panic
// nor a 5xx other than 501. Seeds: testdata/fuzz/FuzzRoutes and below.
func FuzzRoutes(f *testing.F) {
	for _, s := range []struct{ method, target, body, sandbox, host string }{
		{"GET", "/sandboxes?metadata=a%3Db&state=running,paused&limit=10&nextToken=x", "", "", ""},
		{"GET", "/v2/sandboxes?limit=-1&nextToken=%zz", "", "", ""},
		{"GET", "/sandboxes/n001aaaaaaaaaaaaaaaa-client", "", "", ""},
		{"DELETE", "/sandboxes/n001aaaaaaaaaaaaaaaa", "", "", ""},
		{"POST", "/sandboxes/n001aaaaaaaaaaaaaaaa/timeout", `{"timeout":30}`, "", ""},
		{"POST", "/sandboxes/x/refreshes", `{"duration":1e309}`, "", ""},
		{"POST", "/v2/sandboxes/x/connect", `{"timeout":10}`, "", ""},
		{"PUT", "/sandboxes/x/network", `{"allowOut":["*.a.b"]}`, "", ""},
		{"GET", "/sandboxes/metrics?sandbox_ids=a,b,c", "", "", ""},
		{"GET", "/sandboxes/x/metrics?start=-1&end=99999999999999", "", "", ""},
		{"GET", "/files?path=/etc/passwd&signature=v1_abc&signature_expiration=1", "", "", ""},
		{"POST", "/files?path=/.opendsec/agent&username=user", "pwned", "n001aaaaaaaaaaaaaaaa", ""},
		{"GET", "/health", "", "", "49983-n001aaaaaaaaaaaaaaaa.opendsec.local"},
		{"GET", "/", "", "", "0-x.opendsec.local:80"},
		{"POST", "/templates/x", "", "", ""},
		{"GET", "/v2/sandboxes/x/logs?cursor=-1&limit=99999&direction=zz&level=q&search=%00", "", "", ""},
		{"GET", "/sandboxes/n001aaaaaaaaaaaaaaaa/logs?start=1e99&limit=-3", "", "", ""},
		{"GET", "/teams", "", "", ""},
		{"PATCH", "/v2/templates/x", `{"public":1}`, "", ""},
		{"GET", "/templates/x/builds/y/logs?cursor=z&source=q", "", "", ""},
		{"GET", "/secrets/x", "", "", ""},
	} {
		f.Add(s.method, s.target, []byte(s.body), s.sandbox, s.host)
	}
	gw, key := badInputGateway(f)
	f.Fuzz(func(t *testing.T, method, target string, body []byte, sandbox, host string) {
		if !validMethod(method) || !strings.HasPrefix(target, "/") {
			return // net/http refuses these before any handler runs
		}
		req, err := http.NewRequest(method, "http://gateway"+target, bytes.NewReader(body))
		if err != nil {
			return
		}
		req.RequestURI = target
		req.Header.Set("X-API-Key", key)
		if sandbox != "" {
			if !validHeaderValue(sandbox) {
				return
			}
			req.Header.Set("E2b-Sandbox-Id", sandbox)
			req.Header.Set("E2b-Sandbox-Port", "49983")
		}
		if host != "" && validHeaderValue(host) {
			req.Host = host
		}
		w := httptest.NewRecorder()
		gw.ServeHTTP(w, req)
		// E2B's own answer for traffic to a sandbox that does not exist
		// is a 502 its SDKs recognise.
		notFound := w.Code == http.StatusBadGateway && strings.Contains(w.Body.String(), "The sandbox was not found")
		if !allowedStatus(w.Code) && !notFound {
			t.Fatalf("%s %q (sandbox %q, host %q): %d %s", method, target, sandbox, host, w.Code, w.Body)
		}
	})
}

func validMethod(m string) bool {
	if m == "" || len(m) > 16 {
		return false
	}
	for _, c := range m {
		if c < 'A' || c > 'Z' {
			return false
		}
	}
	return true
}

func validHeaderValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c == 0x7f {
			return false
		}
	}
	return true
}
