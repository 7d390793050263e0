package agent

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// trimCounter wraps a handler in an idleTrimmer whose trim counts calls and
// records when each happened.
type trimCounter struct {
	n    atomic.Int32
	last atomic.Int64 // unix nanos of the latest trim
}

func (c *trimCounter) trim() {
	c.last.Store(time.Now().UnixNano())
	c.n.Add(1)
}

func serve(h http.Handler, path string) {
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodPost, path, nil))
}

// waitTrims polls until want trims happened or the deadline passes.
func (c *trimCounter) waitTrims(t *testing.T, want int32) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for c.n.Load() < want {
		if time.Now().After(deadline) {
			t.Fatalf("trims = %d after 5s; want %d", c.n.Load(), want)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestIdleTrimOnceAfterWork(t *testing.T) {
	const after = 50 * time.Millisecond
	var c trimCounter
	tr := newIdleTrimmer(after, c.trim)
	h := tr.wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))

	// The idle period starts inside serve, as the request ends: measure
	// from before it (after it returns, up to the whole period may be gone).
	started := time.Now()
	serve(h, "/process.Process/List")
	c.waitTrims(t, 1)
	if waited := time.Unix(0, c.last.Load()).Sub(started); waited < after {
		t.Fatalf("trimmed %s after the request ended; want at least %s", waited, after)
	}
	// Nothing ran since: another idle period must not trim again.
	time.Sleep(3 * after)
	if n := c.n.Load(); n != 1 {
		t.Fatalf("trims = %d with no work since the first; want 1", n)
	}
	// New work arms it again.
	serve(h, "/files")
	c.waitTrims(t, 2)
}

func TestIdleTrimWaitsForRequestsInFlight(t *testing.T) {
	const after = 20 * time.Millisecond
	var c trimCounter
	tr := newIdleTrimmer(after, c.trim)
	release := make(chan struct{})
	entered := make(chan struct{})
	h := tr.wrap(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			close(entered)
			<-release
		}
	}))
	done := make(chan struct{})
	go func() {
		serve(h, "/slow")
		close(done)
	}()
	<-entered
	// A quick request ends while the slow one still runs: no trim may be
	// scheduled until the slow one ends too.
	serve(h, "/quick")
	time.Sleep(5 * after)
	if n := c.n.Load(); n != 0 {
		t.Fatalf("trimmed %d times while a request was in flight", n)
	}
	close(release)
	<-done
	c.waitTrims(t, 1)
}

func TestIdleTrimIgnoresHealth(t *testing.T) {
	const after = 20 * time.Millisecond
	var c trimCounter
	tr := newIdleTrimmer(after, c.trim)
	h := tr.wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	for range 3 {
		serve(h, "/health")
	}
	tr.mu.Lock()
	armed, dirty := tr.timer != nil, tr.dirty
	tr.mu.Unlock()
	if armed || dirty {
		t.Fatalf("after /health only: timer armed %t, dirty %t; want neither", armed, dirty)
	}
}

func TestIdleTrimStopCancels(t *testing.T) {
	const after = 20 * time.Millisecond
	var c trimCounter
	tr := newIdleTrimmer(after, c.trim)
	h := tr.wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	serve(h, "/envs")
	tr.stop()
	time.Sleep(5 * after)
	if n := c.n.Load(); n != 0 {
		t.Fatalf("trimmed %d times after stop", n)
	}
}
