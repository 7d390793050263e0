package apiserver_test

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
)

func scrape(t *testing.T, e *env) string {
	t.Helper()
	resp, err := e.hc.Get(e.url + "/metrics") // no token: /metrics is open like /healthz
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s: %s", resp.Status, body)
	}
	return string(body)
}

func TestMetricsCountRequests(t *testing.T) {
	e := setup(t, nil, "n001")
	proc := opendsecv1connect.SandboxServiceListSandboxesProcedure
	if body := scrape(t, e); strings.Contains(body, proc) {
		t.Fatalf("a request is counted before any call:\n%s", body)
	}
	if _, err := e.sbx.ListSandboxes(t.Context(), connect.NewRequest(&v1.ListSandboxesRequest{})); err != nil {
		t.Fatal(err)
	}
	noTok := opendsecv1connect.NewSandboxServiceClient(e.hc, e.url, connect.WithGRPC())
	if _, err := noTok.ListSandboxes(t.Context(), connect.NewRequest(&v1.ListSandboxesRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("call without a token: %v, want unauthenticated", err)
	}
	body := scrape(t, e)
	for _, want := range []string{
		fmt.Sprintf(`opendsec_apiserver_requests_total{code="ok",procedure=%q} 1`, proc),
		fmt.Sprintf(`opendsec_apiserver_requests_total{code="unauthenticated",procedure=%q} 1`, proc),
		fmt.Sprintf(`opendsec_apiserver_request_duration_seconds_count{procedure=%q} 2`, proc),
	} {
		if !strings.Contains(body, want) {
			t.Errorf("GET /metrics lacks %s", want)
		}
	}
	if t.Failed() {
		t.Logf("metrics:\n%s", body)
	}
}
