package opendsec

import (
	"context"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// MaxForkCount is the most sandboxes one ForkSandbox makes.
const MaxForkCount = 64

// ForkOptions tune ForkSandbox.
type ForkOptions struct {
	// RequestID makes the fork idempotent: a retry with the same one
	// returns the same forks. Empty: the client picks one, so its own
	// retries are safe.
	RequestID string
	// Timeout is the forks' lifetime (rounded up to whole seconds); 0 is
	// the source's.
	Timeout time.Duration
}

// Fork is one sandbox a fork made.
type Fork struct {
	Sandbox *Sandbox
	// MemoryPreserved: the fork resumed the source's memory and processes
	// (VM backends). False on containers: the fork has the source's files
	// and its processes started again.
	MemoryPreserved bool
}

// ForkResult is what ForkSandbox made.
type ForkResult struct {
	Forks []Fork
	// SourceFrozen is how long the source was frozen while its state was
	// copied.
	SourceFrozen time.Duration
}

// ForkSandbox makes count (1..MaxForkCount) new running sandboxes from a
// running or paused one, on its node: each has the source's files at this
// instant, its image, limits, env, network policy, labels and task, a new
// ID and hostname, and ParentId = id. All or none are made.
func (c *Client) ForkSandbox(ctx context.Context, id string, count int, opts ForkOptions) (*ForkResult, error) {
	if id == "" {
		return nil, invalid("sandbox_id", "is required; pass the ID of the sandbox to fork")
	}
	if count < 1 || count > MaxForkCount {
		return nil, invalid("count", "is %d; give 1..%d forks", count, MaxForkCount)
	}
	if opts.Timeout < 0 {
		return nil, invalid("timeout", "must be 0 (the source's lifetime) or positive, got %s", opts.Timeout)
	}
	rid := opts.RequestID
	if rid == "" {
		rid = newRequestID()
	}
	resp, err := c.sandboxes.ForkSandbox(ctx, connect.NewRequest(&opendsecv1.ForkSandboxRequest{
		SandboxId:      id,
		Count:          int32(count),
		RequestId:      rid,
		TimeoutSeconds: int64((opts.Timeout + time.Second - 1) / time.Second),
	}))
	if err != nil {
		return nil, convertError(err)
	}
	out := &ForkResult{SourceFrozen: time.Duration(resp.Msg.GetSourceFrozenUs()) * time.Microsecond}
	for _, f := range resp.Msg.GetForks() {
		out.Forks = append(out.Forks, Fork{Sandbox: f.GetSandbox(), MemoryPreserved: f.GetMemoryPreserved()})
	}
	return out, nil
}
