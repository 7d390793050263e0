package e2b

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestPromMetricsCountRequestsByRoute(t *testing.T) {
	h := newHarness(t)
	srv := httptest.NewServer(h.gw)
	t.Cleanup(srv.Close)
	call := func(method, path, body string, hdr map[string]string) (int, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(t.Context(), method, srv.URL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, b
	}
	key := map[string]string{"X-API-Key": h.keyA}

	code, b := call("POST", "/v2/sandboxes", `{"templateID":"base"}`, key)
	if code != http.StatusCreated {
		t.Fatalf("create: %d %s", code, b)
	}
	var sb struct{ SandboxID string }
	if err := json.Unmarshal(b, &sb); err != nil || sb.SandboxID == "" {
		t.Fatalf("create response %s: %v", b, err)
	}
	if code, b := call("GET", "/sandboxes/"+sb.SandboxID, "", key); code != http.StatusOK {
		t.Fatalf("get: %d %s", code, b)
	}
	if code, _ := call("GET", "/sandboxes/"+sb.SandboxID, "", nil); code != http.StatusUnauthorized {
		t.Fatalf("get without a key: %d, want 401", code)
	}
	if code, _ := call("GET", "/files", "", map[string]string{"E2b-Sandbox-Id": sb.SandboxID}); code != http.StatusBadRequest {
		t.Fatalf("sandbox traffic without a port: %d, want 400", code)
	}

	code, b = call("GET", "/metrics", "", nil) // no key, like /health
	if code != http.StatusOK {
		t.Fatalf("GET /metrics: %d %s", code, b)
	}
	body := string(b)
	for _, want := range []string{
		`opendsec_e2b_requests_total{code="201",route="POST /v2/sandboxes"} 1`,
		`opendsec_e2b_requests_total{code="200",route="GET /sandboxes/{id}"} 1`,
		`opendsec_e2b_requests_total{code="401",route="GET /sandboxes/{id}"} 1`,
		fmt.Sprintf(`opendsec_e2b_requests_total{code="400",route=%q} 1`, routeProxy),
	} {
		if !strings.Contains(body, want) {
			t.Errorf("GET /metrics lacks %s", want)
		}
	}
	if strings.Contains(body, sb.SandboxID) {
		t.Errorf("GET /metrics names sandbox %s", sb.SandboxID)
	}
	if t.Failed() {
		t.Logf("metrics:\n%s", body)
	}
}
