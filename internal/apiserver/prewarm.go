package apiserver

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// MaxPrewarmTTLSec bounds a prewarm's ttl_seconds (the node's
// MaxPrewarmTTL).
const MaxPrewarmTTLSec = 86400

// PrewarmSandboxes asks the warm pool of placement's best node for the
// spec to hold count prestarted sandboxes of its shape. With several
// nodes, what one could not hold (its capacity or pool bound) is asked of
// the next candidate, in placement's order; nodes lists each one's part.
// A node without a warm pool is skipped (its reason is reported).
func (s *Server) PrewarmSandboxes(ctx context.Context, req *connect.Request[v1.PrewarmSandboxesRequest]) (*connect.Response[v1.PrewarmSandboxesResponse], error) {
	count := req.Msg.GetCount()
	if count < 1 || count > MaxBatch {
		return nil, errdefs.Invalid("count", "%d must be between 1 and the node's node.warm_pool.max_sandboxes", count)
	}
	if ttl := req.Msg.GetTtlSeconds(); ttl < 0 || ttl > MaxPrewarmTTLSec {
		return nil, errdefs.Invalid("ttl_seconds", "%d must be between 0 (the pool's idle TTL) and %d seconds", ttl, MaxPrewarmTTLSec)
	}
	if req.Msg.GetSpec().GetSnapshot() != "" {
		return nil, errdefs.Invalid("spec.snapshot", "a restore is made from its snapshot, never from the warm pool; leave snapshot unset to prewarm")
	}
	spec, err := normalizeSpec(req.Msg.GetSpec())
	if err != nil {
		return nil, err
	}
	if err := checkNetworkPolicy(ctx, spec.GetNetwork()); err != nil {
		return nil, err
	}
	cands, err := s.candidates(ctx, spec)
	if err != nil {
		return nil, err
	}
	out := &v1.PrewarmSandboxesResponse{}
	var reasons []string
	left := count
	for _, nodeID := range cands {
		if left == 0 {
			break
		}
		n, err := s.nodes.Get(ctx, nodeID)
		if err != nil {
			return nil, fmt.Errorf("prewarm sandboxes: %w", err)
		}
		resp, err := n.Node().PrewarmSandboxes(ctx, connect.NewRequest(&nodev1.PrewarmSandboxesRequest{
			Spec: nodeSpec(spec), Count: left, TtlSeconds: req.Msg.GetTtlSeconds(), Wait: req.Msg.GetWait(),
		}))
		if err != nil {
			err = remoteErr(ctx, "prewarm sandboxes on node "+nodeID, err)
			if ctx.Err() != nil || errors.Is(err, errdefs.ErrInvalidArgument) && len(out.Nodes) == 0 {
				return nil, err
			}
			reasons = append(reasons, fmt.Sprintf("node %s: %v", nodeID, err))
			continue
		}
		m := resp.Msg
		out.Nodes = append(out.Nodes, &v1.PrewarmNodeResult{NodeId: nodeID, Held: m.GetHeld(), Ready: m.GetReady(), Reason: m.GetReason()})
		out.Held += m.GetHeld()
		out.Ready += m.GetReady()
		out.TtlSeconds = max(out.TtlSeconds, m.GetTtlSeconds())
		left -= m.GetHeld()
		if m.GetReason() != "" {
			reasons = append(reasons, m.GetReason())
		}
	}
	if len(out.Nodes) == 0 {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "no node could prewarm: %s", strings.Join(reasons, "; "))
	}
	if out.Held < count {
		out.Reason = strings.Join(reasons, "; ")
	}
	return connect.NewResponse(out), nil
}
