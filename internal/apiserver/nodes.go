package apiserver

import (
	"cmp"
	"context"
	"sync"

	"google.golang.org/protobuf/types/known/timestamppb"

	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// liveNode is a node the watcher sees healthy, with what it last reported.
type liveNode struct {
	*nodeclient.Client
	status *watcherv1.NodeStatus
}

// healthyNodes returns the nodes the watcher sees healthy that this
// apiserver can reach.
func (s *Server) healthyNodes(ctx context.Context) ([]liveNode, error) {
	view, err := s.nodeView(ctx)
	if err != nil {
		return nil, err
	}
	var out []liveNode
	for _, st := range view {
		if !st.GetHealthy() {
			continue
		}
		if n, err := s.nodes.Get(ctx, st.GetNodeId()); err == nil {
			out = append(out, liveNode{Client: n, status: st})
		}
	}
	return out, nil
}

// onEach calls fn on every node at once and waits for all of them.
func onEach(nodes []liveNode, fn func(liveNode)) {
	var wg sync.WaitGroup
	for _, n := range nodes {
		wg.Go(func() { fn(n) })
	}
	wg.Wait()
}

// byCreated orders what lists merge from several nodes: oldest first, then
// by ID.
func byCreated[T interface {
	GetCreatedAt() *timestamppb.Timestamp
	GetId() string
}](a, b T) int {
	if c := a.GetCreatedAt().AsTime().Compare(b.GetCreatedAt().AsTime()); c != 0 {
		return c
	}
	return cmp.Compare(a.GetId(), b.GetId())
}
