package opendsec

import (
	"context"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// PrewarmResult says how many prestarted sandboxes the warm pool will hold
// (Held; fewer than asked when Reason says why: the node's capacity or
// node.warm_pool.max_sandboxes), how many are ready now, the TTL in
// effect, and each node's part.
type PrewarmResult = opendsecv1.PrewarmSandboxesResponse

// PrewarmOptions are Prewarm's optional settings.
type PrewarmOptions struct {
	// TTL is how long the pool holds the sandboxes if no create takes
	// them; 0 means the pool's idle TTL (node.warm_pool.idle_ttl_sec).
	// Whole seconds, at most 24h.
	TTL time.Duration
	// Wait returns only once the pool holds them (or ctx ends).
	Wait bool
}

// Prewarm asks the warm pool to hold count prestarted sandboxes of spec's
// shape (backend, image, cpu, memory, disk, pids limit, user, workdir,
// network; env, labels and timeouts may differ), so that the creates of
// that shape that follow — a BatchCreate of count — each take one instead
// of starting from scratch. Each create of the shape consumes one of the
// count; afterwards, or after the TTL, the pool goes back to its normal
// size. Call it while the trainer computes, before the burst.
func (c *Client) Prewarm(ctx context.Context, spec *SandboxSpec, count int, opts PrewarmOptions) (*PrewarmResult, error) {
	if spec == nil {
		return nil, invalid("spec", "is required; pass at least an image")
	}
	if count < 1 || count > MaxBatch {
		return nil, invalid("count", "must be between 1 and the node's node.warm_pool.max_sandboxes, got %d", count)
	}
	if opts.TTL < 0 || opts.TTL > 24*time.Hour {
		return nil, invalid("ttl", "must be between 0 (the pool's idle TTL) and 24h, got %s", opts.TTL)
	}
	req := &opendsecv1.PrewarmSandboxesRequest{Spec: spec, Count: int32(count), TtlSeconds: int64(opts.TTL / time.Second), Wait: opts.Wait} //nolint:gosec // count checked above
	var out *PrewarmResult
	err := c.withRetry(ctx, func() error {
		resp, err := c.sandboxes.PrewarmSandboxes(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		out = resp.Msg
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
