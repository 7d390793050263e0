package daemon

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestPprofEndpoint: debug.pprof_listen serves Go's profiles there until
// the daemon's context ends; empty, nothing listens.
func TestPprofEndpoint(t *testing.T) {
	if addr, err := startPprof(t.Context(), ""); err != nil || addr != "" {
		t.Fatalf("off: %q, %v", addr, err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	addr, err := startPprof(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://" + addr + "/debug/pprof/goroutine?debug=1")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "startPprof") {
		t.Fatalf("goroutine profile: %s: %.300s", resp.Status, b)
	}
	cancel()
	// Serve returns once the listener is closed: connections are refused.
	for {
		r, err := http.Get("http://" + addr + "/debug/pprof/")
		if err != nil {
			break
		}
		r.Body.Close()
	}
}
