package agent

import (
	"net/http"
	"runtime/debug"
	"sync"
	"time"
)

// DefaultIdleTrimAfter is how long the agent waits after its last request
// ends before it returns freed memory to the OS.
const DefaultIdleTrimAfter = 10 * time.Second

// idleTrimmer runs trim once the agent has served no request for after,
// and only if a request ran since the previous trim: a burst of work (say a
// process streaming output at full speed) leaves the heap grown with
// garbage that the Go runtime would otherwise hand back only slowly, while
// an agent that stays idle is not woken for nothing.
type idleTrimmer struct {
	after time.Duration
	trim  func()

	mu     sync.Mutex
	active int    // requests in flight
	gen    uint64 // bumped by every request start
	dirty  bool   // a request ran since the last trim
	timer  *time.Timer
}

func newIdleTrimmer(after time.Duration, trim func()) *idleTrimmer {
	return &idleTrimmer{after: after, trim: trim}
}

// freeOSMemory is the production trim: a GC, then every free page back.
func freeOSMemory() { debug.FreeOSMemory() }

func (t *idleTrimmer) begin() {
	t.mu.Lock()
	t.active++
	t.gen++
	t.dirty = true
	if t.timer != nil {
		t.timer.Stop()
	}
	t.mu.Unlock()
}

func (t *idleTrimmer) end() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.active--
	if t.active > 0 {
		return
	}
	gen := t.gen
	if t.timer != nil {
		t.timer.Stop()
	}
	t.timer = time.AfterFunc(t.after, func() { t.fire(gen) })
}

// fire trims if nothing started since the timer was armed for gen.
func (t *idleTrimmer) fire(gen uint64) {
	t.mu.Lock()
	if t.active > 0 || t.gen != gen || !t.dirty {
		t.mu.Unlock()
		return
	}
	t.dirty = false
	t.mu.Unlock()
	t.trim()
}

// stop cancels a pending trim.
func (t *idleTrimmer) stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.timer != nil {
		t.timer.Stop()
	}
	t.dirty = false
}

// wrap counts every request but GET /health as work: the node polls
// /health while a sandbox starts, and a fresh agent has nothing to return.
func (t *idleTrimmer) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			next.ServeHTTP(w, r)
			return
		}
		t.begin()
		defer t.end()
		next.ServeHTTP(w, r)
	})
}
