package node

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// DefaultShutdownTimeout bounds Close's wait for operations in flight.
const DefaultShutdownTimeout = 30 * time.Second

// gate admits the operations that write the sandbox table (creates, stops,
// pauses, resumes, timeout and network changes) until shutdown begins, and
// lets shutdown wait for the ones admitted.
type gate struct {
	mu      sync.Mutex
	closing bool              // guarded by mu
	next    uint64            // guarded by mu
	ops     map[uint64]string // in flight: what each is; guarded by mu
	idle    chan struct{}     // closed when closing and ops is empty; guarded by mu

	once sync.Once
	done chan struct{} // closed when shutdown has finished
	err  error         // shutdown's result; read after done
}

// begin admits one operation described by what ("create sandbox x") and
// returns the function that ends it, or an unavailable error once shutdown
// has begun.
func (n *Node) begin(what string) (func(), error) {
	g := &n.gate
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closing {
		return nil, errdefs.New(errdefs.ErrUnavailable,
			"node %s is shutting down; retry when it is back (its sandboxes keep running) or use another node", n.cfg.ID)
	}
	if g.ops == nil {
		g.ops = map[uint64]string{}
	}
	g.next++
	id := g.next
	g.ops[id] = what
	return func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		delete(g.ops, id)
		if g.closing && len(g.ops) == 0 && g.idle != nil {
			close(g.idle)
			g.idle = nil
		}
	}, nil
}

// inFlight lists the operations still running, sorted.
func (g *gate) inFlight() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]string, 0, len(g.ops))
	for _, w := range g.ops {
		out = append(out, w)
	}
	sort.Strings(out)
	return out
}

// Close shuts the node down with DefaultShutdownTimeout as the bound (see
// Shutdown).
func (n *Node) Close() error {
	ctx, cancel := context.WithTimeoutCause(context.Background(), DefaultShutdownTimeout,
		fmt.Errorf("node shutdown exceeded %s", DefaultShutdownTimeout))
	defer cancel()
	return n.Shutdown(ctx)
}

// Shutdown stops the node: new creates, stops, pauses and resumes are
// refused with an unavailable error; the reaper stops; then Shutdown waits,
// until ctx ends, for the operations already admitted (the reaper's stops
// among them), and closes the sandbox table. Sandboxes keep running.
//
// An operation still running when ctx ends is left for recovery: it can no
// longer write the table (bbolt refuses writes once closed, and a write in
// progress finishes first), so its record keeps the state it had — creating
// or stopping — and the next start finishes or undoes it. A later call
// returns the first call's result once that has finished.
func (n *Node) Shutdown(ctx context.Context) error {
	g := &n.gate
	first := false
	g.once.Do(func() {
		first = true
		g.done = make(chan struct{})
	})
	if !first {
		select {
		case <-g.done:
			return g.err
		case <-ctx.Done():
			return fmt.Errorf("wait for node shutdown: %w", context.Cause(ctx))
		}
	}
	defer close(g.done)

	g.mu.Lock()
	g.closing = true
	idle := make(chan struct{})
	if len(g.ops) == 0 {
		close(idle)
	} else {
		g.idle = idle
	}
	g.mu.Unlock()
	close(n.closed)
	n.stopLife()

	// The reaper and the goroutines waiting for a stop slot end at once;
	// reaper stops already running are operations, waited for below.
	reaper := make(chan struct{})
	go func() {
		n.wg.Wait()
		close(reaper)
	}()
	l := log.G(ctx).With("node.id", n.cfg.ID)
	waitStart := time.Now()
	for _, ch := range []chan struct{}{idle, reaper} {
		select {
		case <-ch:
			continue
		case <-ctx.Done():
		}
		left := g.inFlight()
		l.Warn("node shutdown deadline passed with operations in flight; leaving them for recovery at the next start",
			"in_flight", left, "waited", time.Since(waitStart).Round(time.Millisecond), "cause", context.Cause(ctx))
		break
	}
	if n.pool != nil {
		// Prestarted sandboxes are cheap to make again: remove them
		// rather than leave containers nobody will take (a crash leaves
		// them to recovery, which removes them too).
		n.pool.drain()
	}
	if err := n.table.close(); err != nil {
		g.err = fmt.Errorf("close sandbox table: %w", err)
	}
	return g.err
}

// isShuttingDown reports whether err is the refusal of an operation because
// the node is shutting down.
func (n *Node) shuttingDown(err error) bool {
	if !errors.Is(err, errdefs.ErrUnavailable) {
		return false
	}
	select {
	case <-n.closed:
		return true
	default:
		return false
	}
}
