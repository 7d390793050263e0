package apiserver

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"

	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
)

// gatedWatcher answers ListNodes with view n (n = call number) once let go.
type gatedWatcher struct {
	calls chan int
	gate  chan struct{}
	n     int
}

func (w *gatedWatcher) ListNodes(ctx context.Context, _ *connect.Request[watcherv1.ListNodesRequest]) (*connect.Response[watcherv1.ListNodesResponse], error) {
	w.n++
	n := w.n
	w.calls <- n
	select {
	case <-w.gate:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return connect.NewResponse(&watcherv1.ListNodesResponse{Nodes: []*watcherv1.NodeStatus{{NodeId: string(rune('a' + n))}}}), nil
}

// TestNodeViewStaleWhileRefreshing: a view past ViewTTL but within
// ViewMaxStale is served at once while one background fetch replaces it; a
// view past ViewMaxStale is fetched before it is served.
func TestNodeViewStaleWhileRefreshing(t *testing.T) {
	w := &gatedWatcher{calls: make(chan int, 4), gate: make(chan struct{}, 4)}
	s := &Server{cfg: Config{Watcher: w, ViewTTL: time.Minute, ViewMaxStale: time.Hour}}
	ctx := t.Context()
	w.gate <- struct{}{}
	v, err := s.nodeView(ctx)
	if err != nil || len(v) != 1 || v[0].GetNodeId() != "b" || <-w.calls != 1 {
		t.Fatalf("first view: %v, %v", v, err)
	}
	// Older than the TTL: served as it is, one fetch starts (and waits
	// at the gate), a second call starts no other.
	s.viewMu.Lock()
	s.viewAt = time.Now().Add(-2 * time.Minute)
	s.viewMu.Unlock()
	for range 2 {
		if v, err := s.nodeView(ctx); err != nil || v[0].GetNodeId() != "b" {
			t.Fatalf("stale view: %v, %v", v, err)
		}
	}
	if n := <-w.calls; n != 2 {
		t.Fatalf("background fetch is call %d", n)
	}
	w.gate <- struct{}{}
	deadline := time.Now().Add(10 * time.Second)
	for {
		s.viewMu.Lock()
		id, fetching := s.view[0].GetNodeId(), s.viewFetching
		s.viewMu.Unlock()
		if id == "c" && !fetching {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("background fetch never replaced the view (have %q)", id)
		}
		time.Sleep(time.Millisecond) // polling a condition with a deadline
	}
	select {
	case n := <-w.calls:
		t.Fatalf("unexpected fetch %d: two stale reads started two fetches", n)
	default:
	}
	// Older than ViewMaxStale: fetched before it is served.
	s.viewMu.Lock()
	s.viewAt = time.Now().Add(-2 * time.Hour)
	s.viewMu.Unlock()
	w.gate <- struct{}{}
	if v, err := s.nodeView(ctx); err != nil || v[0].GetNodeId() != "d" {
		t.Fatalf("view past max stale: %v, %v", v, err)
	}
}
