// Package watcher polls every node for health, capacity and sandboxes and
// serves the aggregated view to apiservers (WatcherService). It keeps no
// durable state: after a restart the first poll rebuilds the view.
package watcher

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// FailureThreshold is how many consecutive failed polls mark a node that
// was healthy as unhealthy. A node never reached is unhealthy from the start.
const FailureThreshold = 2

// Watcher polls nodes and holds the view. Create it with New.
type Watcher struct {
	interval time.Duration
	timeout  time.Duration
	nodes    []config.NodeRef
	clients  map[string]nodev1connect.NodeServiceClient

	mu sync.RWMutex
	// status by node ID; guarded by mu. Entries are replaced, never mutated.
	status map[string]*watcherv1.NodeStatus
	// failures counts consecutive failed polls by node ID; guarded by mu.
	failures map[string]int

	metrics *metrics
}

var _ watcherv1connect.WatcherServiceHandler = (*Watcher)(nil)

// New returns a Watcher for nodes, calling them with httpClient (nil means
// http.DefaultClient) and the node-scope service token.
func New(cfg config.Watcher, nodes []config.NodeRef, httpClient *http.Client, token string) *Watcher {
	return NewWithTokens(cfg, nodes, httpClient, auth.StaticToken(token))
}

// NewWithTokens is New with each poll taking its token from tokens (a
// renewed auth.ServiceToken).
func NewWithTokens(cfg config.Watcher, nodes []config.NodeRef, httpClient *http.Client, tokens auth.TokenSource) *Watcher {
	interval := time.Duration(cfg.PollIntervalMS) * time.Millisecond
	if interval <= 0 {
		interval = time.Second
	}
	hc := auth.ClientFrom(httpClient, tokens)
	w := &Watcher{
		interval: interval,
		// A poll may take up to one interval plus slack, never less than 2s,
		// so a slow node is not marked unhealthy by a too-short deadline.
		timeout:  max(2*interval, 2*time.Second),
		nodes:    slices.Clone(nodes),
		clients:  map[string]nodev1connect.NodeServiceClient{},
		status:   map[string]*watcherv1.NodeStatus{},
		failures: map[string]int{},
	}
	for _, n := range nodes {
		w.clients[n.ID] = nodev1connect.NewNodeServiceClient(hc, n.Address)
		w.status[n.ID] = &watcherv1.NodeStatus{NodeId: n.ID, Address: n.Address, LastError: "not polled yet"}
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

// Poll polls every node concurrently, each with its own timeout, and
// updates the view.
func (w *Watcher) Poll(ctx context.Context) {
	var wg sync.WaitGroup
	for _, n := range w.nodes {
		wg.Go(func() {
			pctx, cancel := context.WithTimeoutCause(ctx, w.timeout, fmt.Errorf("poll node %s: no answer within %s", n.ID, w.timeout))
			defer cancel()
			st, err := w.pollNode(pctx, n)
			w.record(ctx, n, st, err)
		})
	}
	wg.Wait()
}

func (w *Watcher) pollNode(ctx context.Context, n config.NodeRef) (*watcherv1.NodeStatus, error) {
	c := w.clients[n.ID]
	info, err := c.Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		return nil, fmt.Errorf("node info: %w", errdefs.FromConnect(err))
	}
	if id := info.Msg.GetNodeId(); id != n.ID {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "node at %s reports id %q but is configured as %q; fix nodes[].id", n.Address, id, n.ID)
	}
	list, err := c.ListSandboxes(ctx, connect.NewRequest(&nodev1.ListSandboxesRequest{}))
	if err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", errdefs.FromConnect(err))
	}
	st := &watcherv1.NodeStatus{
		NodeId:             n.ID,
		Address:            n.Address,
		Healthy:            info.Msg.GetHealthy(),
		LastSeen:           timestamppb.Now(),
		Info:               info.Msg,
		SandboxesByBackend: map[string]int64{},
		SandboxesByTask:    map[string]int64{},
	}
	if !st.Healthy {
		st.LastError = "node reports itself unhealthy"
	}
	for _, sb := range list.Msg.GetSandboxes() {
		switch sb.GetState() {
		case v1.SandboxState_SANDBOX_STATE_STOPPED, v1.SandboxState_SANDBOX_STATE_FAILED:
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

func (w *Watcher) record(ctx context.Context, n config.NodeRef, st *watcherv1.NodeStatus, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
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
	prev := w.status[n.ID]
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

// Nodes returns the current view, ordered by node ID.
func (w *Watcher) Nodes() []*watcherv1.NodeStatus {
	w.mu.RLock()
	defer w.mu.RUnlock()
	out := make([]*watcherv1.NodeStatus, 0, len(w.status))
	for _, n := range w.nodes {
		out = append(out, w.status[n.ID])
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
	return watcherv1connect.NewWatcherServiceHandler(w, opts...)
}
