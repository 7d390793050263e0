package agent

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// activity counts requests in flight. A port tunnel counts for as long as
// it is open: its handler returns only when both directions are done.
type activity struct {
	mu       sync.Mutex
	inFlight int
	last     time.Time // last request start or end
}

func (t *activity) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.add(1)
		defer t.add(-1)
		next.ServeHTTP(w, r)
	})
}

func (t *activity) add(n int) {
	t.mu.Lock()
	t.inFlight += n
	t.last = time.Now()
	t.mu.Unlock()
}

func (t *activity) snapshot() (inFlight int, last time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.inFlight, t.last
}

// busyFunc reports why the agent is needed ("" when it is not).
type busyFunc func() string

// waitIdle returns nil once busy has reported nothing, and no request has
// started or ended, for d; or ctx's error.
func waitIdle(ctx context.Context, d time.Duration, busy busyFunc, act *activity) error {
	tick := time.NewTicker(min(max(d/10, 20*time.Millisecond), time.Second))
	defer tick.Stop()
	since := time.Now()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case now := <-tick.C:
			if busy() != "" {
				since = now
				continue
			}
			if _, last := act.snapshot(); last.After(since) {
				since = last
			}
			if now.Sub(since) >= d {
				return nil
			}
		}
	}
}
