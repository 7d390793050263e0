package e2b

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// barrierAPI holds every metrics call until `need` calls are in flight at
// once (or a deadline passes, then the call fails): a gateway that asks
// sandboxes one after another cannot pass it.
type barrierAPI struct {
	*fakeAPI
	need int

	mu      sync.Mutex
	arrived int
	all     chan struct{}
}

func (b *barrierAPI) GetSandboxMetrics(ctx context.Context, r *connect.Request[v1.GetSandboxMetricsRequest]) (*connect.Response[v1.GetSandboxMetricsResponse], error) {
	b.mu.Lock()
	b.arrived++
	if b.arrived == b.need {
		close(b.all)
	}
	b.mu.Unlock()
	select {
	case <-b.all:
	case <-time.After(5 * time.Second):
		return nil, fmt.Errorf("only %d of %d metrics calls were in flight at once", b.arrived, b.need)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return b.fakeAPI.GetSandboxMetrics(ctx, r)
}

func TestMetricsManyAsksConcurrently(t *testing.T) {
	h := newHarness(t)
	var ids []string
	for range 5 {
		_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
		ids = append(ids, m["sandboxID"].(string))
	}
	h.gw.cfg.API = &barrierAPI{fakeAPI: h.api, need: len(ids), all: make(chan struct{})}
	// Suffixed IDs ("<id>-<clientID>") and repeats are the same sandbox.
	q := strings.Join(ids, ",") + "," + ids[0] + "-" + ClientID + ",n001aaaaaaaaaaaaaaaa"
	w, m := h.do(h.keyA, "GET", "/sandboxes/metrics?sandbox_ids="+q, "")
	sbs, _ := m["sandboxes"].(map[string]any)
	if w.Code != http.StatusOK || len(sbs) != len(ids) {
		t.Fatalf("metrics of many: %d %v; want %d samples", w.Code, m, len(ids))
	}
	for _, id := range ids {
		if s, _ := sbs[id].(map[string]any); s == nil || s["diskUsed"] != float64(4096) {
			t.Fatalf("sample of %s: %v", id, sbs[id])
		}
	}
}
