package agent

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// TestWaitIdleWaitsForBusyAndRequests: waitIdle returns only once busy is
// empty and no request started or ended for d.
func TestWaitIdleWaitsForBusyAndRequests(t *testing.T) {
	act := &activity{}
	var busy atomic.Bool
	busy.Store(true)
	const d = 100 * time.Millisecond
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		done <- waitIdle(t.Context(), d, func() string {
			if busy.Load() {
				return "busy"
			}
			return ""
		}, act)
	}()
	select {
	case <-done:
		t.Fatal("waitIdle returned while busy")
	case <-time.After(5 * d): // observation window
	}
	busy.Store(false)
	// A request in flight counts as busy only through Busy; its end resets
	// the idle clock.
	release := make(chan struct{})
	h := act.wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-release }))
	go h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/x", nil))
	for n, _ := act.snapshot(); n != 1; n, _ = act.snapshot() {
		time.Sleep(time.Millisecond)
	}
	close(release)
	for n, _ := act.snapshot(); n != 0; n, _ = act.snapshot() {
		time.Sleep(time.Millisecond)
	}
	_, last := act.snapshot()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("waitIdle did not return once idle")
	}
	if since := time.Since(last); since < d {
		t.Fatalf("waitIdle returned %s after the last request ended; want at least %s", since, d)
	}
	if time.Since(start) < 5*d {
		t.Fatal("returned too early")
	}
}

func TestWaitIdleCanceled(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := waitIdle(ctx, time.Hour, func() string { return "" }, &activity{}); err == nil {
		t.Fatal("waitIdle ignored its context")
	}
}
