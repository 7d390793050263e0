package watcher_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func scrape(t *testing.T, h http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
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

func TestMetricsCountPollsAndNodes(t *testing.T) {
	a := &fakeNode{id: "n001", healthy: true}
	b := &fakeNode{id: "n002", fail: true}
	w, _ := setup(t, a, b)
	for _, want := range []string{
		`opendsec_watcher_polls_total{result="ok"} 0`,
		`opendsec_watcher_nodes{healthy="false"} 2`,
	} {
		if body := scrape(t, w.MetricsHandler()); !strings.Contains(body, want) {
			t.Fatalf("before any poll GET /metrics lacks %s:\n%s", want, body)
		}
	}
	w.Poll(t.Context())
	body := scrape(t, w.MetricsHandler())
	for _, want := range []string{
		`opendsec_watcher_polls_total{result="ok"} 1`,
		`opendsec_watcher_polls_total{result="error"} 1`,
		`opendsec_watcher_nodes{healthy="true"} 1`,
		`opendsec_watcher_nodes{healthy="false"} 1`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("GET /metrics lacks %s", want)
		}
	}
	if t.Failed() {
		t.Logf("metrics:\n%s", body)
	}
}
