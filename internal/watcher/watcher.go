// Package watcher polls every node for health, capacity and sandboxes and
// serves the aggregated view to apiservers (WatcherService). It keeps no
// durable state: after a restart the first poll rebuilds the view.
package watcher

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// FailureThreshold is how many consecutive failed polls mark a node that
// was healthy as unhealthy. A node never reached is unhealthy from the start.
const FailureThreshold = 2

// Watcher polls nodes and holds the view. Create it with New.
type Watcher struct {
	interval time.Duration
	timeout  time.Duration
	nodes    *nodeclient.Pool

	mu sync.RWMutex
	// order is the directory's node IDs at the last poll; guarded by mu.
	order []string
	// status by node ID; guarded by mu. Entries are replaced, never mutated.
	status map[string]*watcherv1.NodeStatus
	// failures counts consecutive failed polls by node ID; guarded by mu.
	failures map[string]int

	metrics *metrics
}

var _ watcherv1connect.WatcherServiceHandler = (*Watcher)(nil)

// New returns a Watcher for the nodes of the directory nodes (read at New
// and at every poll), calling them with httpClient (nil means
// nodeclient.DefaultHTTPClient) and the node-scope service token.
func New(cfg config.Watcher, nodes nodeclient.Directory, httpClient *http.Client, token string) *Watcher {
	return NewWithTokens(cfg, nodes, httpClient, auth.StaticToken(token))
}

// NewWithTokens is New with each poll taking its token from tokens (a
// renewed auth.ServiceToken).
func NewWithTokens(cfg config.Watcher, nodes nodeclient.Directory, httpClient *http.Client, tokens auth.TokenSource) *Watcher {
	interval := time.Duration(cfg.PollIntervalMS) * time.Millisecond
	if interval <= 0 {
		interval = time.Second
	}
	w := &Watcher{
		interval: interval,
		// A poll may take up to one interval plus slack, never less than 2s,
		// so a slow node is not marked unhealthy by a too-short deadline.
		timeout:  max(2*interval, 2*time.Second),
		nodes:    nodeclient.NewPool(nodes, nodeclient.Options{HTTPClient: httpClient, Tokens: tokens}),
		status:   map[string]*watcherv1.NodeStatus{},
		failures: map[string]int{},
	}
	// Seed the view (every node unhealthy, not polled yet) so that it lists
	// the nodes before the first poll; a directory that cannot answer now
	// leaves it empty until then.
	sctx, cancel := context.WithTimeout(context.Background(), w.timeout)
	defer cancel()
	if seed, err := w.nodes.List(sctx); err == nil {
		w.track(seed)
	}
	w.metrics = newMetrics(w)
	return w
}

// Run polls every node at once, then every interval, until ctx ends.
func (w *Watcher) Run(ctx context.Context) error {
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		w.Poll(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Poll reads the node directory, then polls every node concurrently, each
// with its own timeout, and updates the view. A node new to the directory
// enters the view unhealthy ("not polled yet") until it answers; one gone
// from it leaves the view. When the directory cannot be read, the view
// stays as it was.
func (w *Watcher) Poll(ctx context.Context) {
	nodes, err := w.nodes.List(ctx)
	if err != nil {
		if ctx.Err() == nil {
			log.G(ctx).Warn("read the node directory; keeping the last view", log.Err(err))
		}
		return
	}
	w.track(nodes)
	var wg sync.WaitGroup
	for _, n := range nodes {
		wg.Go(func() {
			pctx, cancel := context.WithTimeoutCause(ctx, w.timeout, fmt.Errorf("poll node %s: no answer within %s", n.ID(), w.timeout))
			defer cancel()
			st, err := w.pollNode(pctx, n)
			w.record(ctx, n.Info(), st, err)
		})
	}
	wg.Wait()
}

// track makes the view's nodes those of the directory: new ones enter
// unhealthy, not polled yet; a node whose address changed is polled anew.
func (w *Watcher) track(nodes []*nodeclient.Client) {
	w.mu.Lock()
	defer w.mu.Unlock()
	order := make([]string, 0, len(nodes))
	seen := make(map[string]bool, len(nodes))
	for _, n := range nodes {
		info := n.Info()
		order = append(order, info.ID)
		seen[info.ID] = true
		if st, ok := w.status[info.ID]; !ok || st.GetAddress() != info.Addr {
			w.status[info.ID] = &watcherv1.NodeStatus{NodeId: info.ID, Address: info.Addr, LastError: "not polled yet"}
			w.failures[info.ID] = 0
		}
	}
	for id := range w.status {
		if !seen[id] {
			delete(w.status, id)
			delete(w.failures, id)
		}
	}
	w.order = order
}

func (w *Watcher) pollNode(ctx context.Context, n *nodeclient.Client) (*watcherv1.NodeStatus, error) {
	c := n.Node()
	addr := n.Info().Addr
	info, err := c.Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		return nil, fmt.Errorf("node info: %w", errdefs.FromConnect(err))
	}
	if id := info.Msg.GetNodeId(); id != n.ID() {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "node at %s reports id %q but is configured as %q; fix nodes[].id", addr, id, n.ID())
	}
	st := &watcherv1.NodeStatus{
		NodeId:   n.ID(),
		Address:  addr,
		Healthy:  info.Msg.GetHealthy(),
		LastSeen: timestamppb.Now(),
		Info:     info.Msg,
	}
	if !st.Healthy {
		st.LastError = "node reports itself unhealthy"
	}
	if info.Msg.GetSandboxCounts() {
		// The node counted: move its counts out of Info, so NodeStatus
		// carries them once, as with a node that does not count.
		st.SandboxesByBackend, st.SandboxesByTask = info.Msg.GetSandboxesByBackend(), info.Msg.GetSandboxesByTask()
		info.Msg.SandboxesByBackend, info.Msg.SandboxesByTask, info.Msg.SandboxCounts = nil, nil, false
		if st.SandboxesByBackend == nil {
			st.SandboxesByBackend = map[string]int64{}
		}
		if st.SandboxesByTask == nil {
			st.SandboxesByTask = map[string]int64{}
		}
		return st, nil
	}
	// A node older than the counts: list its sandboxes and count them.
	list, err := c.ListSandboxes(ctx, connect.NewRequest(&nodev1.ListSandboxesRequest{}))
	if err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", errdefs.FromConnect(err))
	}
	st.SandboxesByBackend, st.SandboxesByTask = map[string]int64{}, map[string]int64{}
	for _, sb := range list.Msg.GetSandboxes() {
		switch sb.GetState() {
		case nodev1.SandboxState_SANDBOX_STATE_STOPPED, nodev1.SandboxState_SANDBOX_STATE_FAILED:
			continue
		}
		backend := sb.GetSpec().GetBackend()
		if backend == "" {
			backend = info.Msg.GetDefaultBackend()
		}
		st.SandboxesByBackend[backend]++
		if task := sb.GetSpec().GetTaskId(); task != "" {
			st.SandboxesByTask[task]++
		}
	}
	return st, nil
}

func (w *Watcher) record(ctx context.Context, n nodeclient.NodeInfo, st *watcherv1.NodeStatus, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	prev, ok := w.status[n.ID]
	if !ok || prev.GetAddress() != n.Addr {
		return // left the directory, or moved, while it was polled
	}
	if err == nil {
		w.metrics.pollDone(nil)
		w.failures[n.ID] = 0
		w.status[n.ID] = st
		return
	}
	if errors.Is(err, context.Canceled) && ctx.Err() != nil {
		return // shutting down; keep the last view
	}
	w.metrics.pollDone(err)
	w.failures[n.ID]++
	next := proto.CloneOf(prev)
	next.LastError = err.Error()
	if w.failures[n.ID] >= FailureThreshold || prev.GetLastSeen() == nil {
		if next.Healthy {
			log.G(ctx).Warn("node unhealthy", log.NodeID(n.ID), log.Err(err))
		}
		next.Healthy = false
	}
	w.status[n.ID] = next
}

// Nodes returns the current view in the directory's order (empty before
// the first poll).
func (w *Watcher) Nodes() []*watcherv1.NodeStatus {
	w.mu.RLock()
	defer w.mu.RUnlock()
	out := make([]*watcherv1.NodeStatus, 0, len(w.order))
	for _, id := range w.order {
		out = append(out, w.status[id])
	}
	return out
}

// ListNodes serves the view.
func (w *Watcher) ListNodes(ctx context.Context, _ *connect.Request[watcherv1.ListNodesRequest]) (*connect.Response[watcherv1.ListNodesResponse], error) {
	return connect.NewResponse(&watcherv1.ListNodesResponse{Nodes: w.Nodes()}), nil
}

// Handler returns the WatcherService route and handler; pass the auth
// interceptor in opts.
func (w *Watcher) Handler(opts ...connect.HandlerOption) (string, http.Handler) {
	opts = append(opts, connect.WithInterceptors(errdefs.Interceptor()))
	return watcherv1connect.NewWatcherServiceHandler(w, opts...)
}
