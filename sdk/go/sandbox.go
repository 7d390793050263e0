package opendsec

import (
	"context"
	"errors"
	"io"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// MaxBatch is the most sandboxes one BatchCreate makes.
const MaxBatch = 32768

// CreateSandbox makes one sandbox from spec and returns it once it runs and
// its agent's socket listens. When the server is unavailable it retries (see
// RetryPolicy) with the same request ID, so a lost answer never leads to a
// second sandbox. The node may hand out a prestarted sandbox from its warm
// pool; the returned sandbox's GetFromWarmPool reports whether it did.
func (c *Client) CreateSandbox(ctx context.Context, spec *SandboxSpec) (*Sandbox, error) {
	return c.CreateSandboxWith(ctx, spec, CreateOptions{})
}

// CreateSandboxWithRequestID is CreateSandbox with a caller-chosen
// idempotency key: calling it again with the same requestID returns the
// sandbox the first call made.
func (c *Client) CreateSandboxWithRequestID(ctx context.Context, spec *SandboxSpec, requestID string) (*Sandbox, error) {
	if spec != nil && requestID == "" {
		return nil, invalid("request_id", "must not be empty")
	}
	return c.CreateSandboxWith(ctx, spec, CreateOptions{RequestID: requestID})
}

// CreateOptions are the less common settings of CreateSandboxWith and
// BatchCreateWith. The zero value behaves as CreateSandbox and BatchCreate.
type CreateOptions struct {
	// RequestID is the idempotency key: a create with the RequestID of an
	// earlier one returns the sandbox that one made. Empty means a fresh
	// random key (retries of this call still share it).
	RequestID string
	// SkipWarmPool makes the node create the sandbox from scratch even when
	// its warm pool holds a matching prestarted one: for measuring the cold
	// path, or ruling the pool out while debugging.
	SkipWarmPool bool
}

// CreateSandboxWith is CreateSandbox with opts.
func (c *Client) CreateSandboxWith(ctx context.Context, spec *SandboxSpec, opts CreateOptions) (*Sandbox, error) {
	if spec == nil {
		return nil, invalid("spec", "is required; pass at least an image")
	}
	requestID := opts.RequestID
	if requestID == "" {
		requestID = newRequestID()
	}
	req := &opendsecv1.CreateSandboxRequest{Spec: spec, RequestId: requestID, SkipWarmPool: opts.SkipWarmPool}
	var sb *Sandbox
	err := c.withRetry(ctx, func() error {
		resp, err := c.sandboxes.CreateSandbox(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		sb = resp.Msg.GetSandbox()
		return nil
	})
	if err != nil {
		return nil, err
	}
	return sb, nil
}

// withRetry runs call until it succeeds, fails with a code other than
// Unavailable, or the retry policy is spent. The error is converted.
func (c *Client) withRetry(ctx context.Context, call func() error) error {
	backoff := c.retry.Backoff
	var err error
	for attempt := 1; ; attempt++ {
		err = convertError(call())
		if err == nil || !IsUnavailable(err) || attempt >= c.retry.Attempts || ctx.Err() != nil {
			return err
		}
		if serr := sleepCtx(ctx, backoff); serr != nil {
			return err
		}
		backoff *= 2
		if c.retry.MaxBackoff > 0 && backoff > c.retry.MaxBackoff {
			backoff = c.retry.MaxBackoff
		}
	}
}

// BatchResult is one item of a BatchCreate: either Sandbox or Err is set.
type BatchResult struct {
	// Index is the item's position, 0 to n-1.
	Index   int
	Sandbox *Sandbox
	Err     error
}

// BatchCreate makes n sandboxes from one spec and calls fn for each as it
// becomes ready or fails, in completion order, from the calling goroutine.
// Items fail one by one (BatchResult.Err); the returned error is for the call
// as a whole. When the stream breaks with Unavailable, BatchCreate retries
// with the same request ID and reports each index only once.
func (c *Client) BatchCreate(ctx context.Context, spec *SandboxSpec, n int, fn func(BatchResult)) error {
	return c.BatchCreateWith(ctx, spec, n, CreateOptions{}, fn)
}

// BatchCreateWith is BatchCreate with opts, which apply to the batch as a
// whole: RequestID is the batch's idempotency key (a batch with the
// RequestID of an earlier one returns the sandboxes that one made) and
// SkipWarmPool makes every sandbox of the batch from scratch.
func (c *Client) BatchCreateWith(ctx context.Context, spec *SandboxSpec, n int, opts CreateOptions, fn func(BatchResult)) error {
	if spec == nil {
		return invalid("spec", "is required; pass at least an image")
	}
	if n < 1 || n > MaxBatch {
		return invalid("count", "must be between 1 and %d, got %d", MaxBatch, n)
	}
	requestID := opts.RequestID
	if requestID == "" {
		requestID = newRequestID()
	}
	req := &opendsecv1.BatchCreateSandboxesRequest{Spec: spec, Count: int32(n), RequestId: requestID, SkipWarmPool: opts.SkipWarmPool}
	seen := make(map[int32]bool, n)
	return c.withRetry(ctx, func() error {
		stream, err := c.sandboxes.BatchCreateSandboxes(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		defer stream.Close()
		for stream.Receive() {
			m := stream.Msg()
			if seen[m.GetIndex()] {
				continue
			}
			seen[m.GetIndex()] = true
			r := BatchResult{Index: int(m.GetIndex()), Sandbox: m.GetSandbox()}
			if m.GetErrorCode() != "" || m.GetSandbox() == nil {
				r.Sandbox = nil
				r.Err = itemError(m.GetErrorCode(), m.GetErrorMessage())
			}
			if fn != nil {
				fn(r)
			}
		}
		if err := stream.Err(); err != nil {
			return err
		}
		if len(seen) < n {
			return &Error{Code: CodeInternal, Message: "batch create stream ended before every item was reported"}
		}
		return nil
	})
}

// itemError builds the error of one failed batch item.
func itemError(code, msg string) error {
	var c Code
	if code == "" || c.UnmarshalText([]byte(code)) != nil {
		c = CodeUnknown
	}
	if msg == "" {
		msg = "sandbox was not created"
	}
	return &Error{Code: c, Message: msg}
}

// GetSandbox returns the sandbox with this ID.
func (c *Client) GetSandbox(ctx context.Context, id string) (*Sandbox, error) {
	resp, err := c.sandboxes.GetSandbox(ctx, connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: id}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetSandbox(), nil
}

// ListFilter selects sandboxes; empty fields match everything.
type ListFilter struct {
	// Labels the sandbox must all carry.
	Labels  map[string]string
	TaskID  string
	Backend string
}

// ListSandboxes returns the caller's sandboxes that match filter.
func (c *Client) ListSandboxes(ctx context.Context, filter ListFilter) ([]*Sandbox, error) {
	resp, err := c.sandboxes.ListSandboxes(ctx, connect.NewRequest(&opendsecv1.ListSandboxesRequest{
		Labels:  filter.Labels,
		TaskId:  filter.TaskID,
		Backend: filter.Backend,
	}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetSandboxes(), nil
}

// StopSandbox stops and deletes a sandbox with its processes and files.
func (c *Client) StopSandbox(ctx context.Context, id string) error {
	_, err := c.sandboxes.StopSandbox(ctx, connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id}))
	return convertError(err)
}

// SetTimeout makes the sandbox's lifetime end d from now (rounded up to whole
// seconds) and returns the updated sandbox.
func (c *Client) SetTimeout(ctx context.Context, id string, d time.Duration) (*Sandbox, error) {
	if d <= 0 {
		return nil, invalid("timeout", "must be positive, got %s", d)
	}
	secs := int64((d + time.Second - 1) / time.Second)
	resp, err := c.sandboxes.SetTimeout(ctx, connect.NewRequest(&opendsecv1.SetTimeoutRequest{Id: id, TimeoutSeconds: secs}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetSandbox(), nil
}

// isEOF reports whether err marks the normal end of a stream.
func isEOF(err error) bool { return errors.Is(err, io.EOF) }

// SetNetwork atomically replaces a running sandbox's network policy and
// returns the updated sandbox. A nil or empty policy denies everything;
// connections the new policy does not allow stop working. A bad rule is
// refused with the field named (network.allow[0].cidr) and nothing changes.
func (c *Client) SetNetwork(ctx context.Context, id string, policy *opendsecv1.NetworkPolicy) (*Sandbox, error) {
	if id == "" {
		return nil, invalid("id", "is required; pass the sandbox ID")
	}
	if policy == nil {
		policy = &opendsecv1.NetworkPolicy{}
	}
	resp, err := c.sandboxes.SetNetwork(ctx, connect.NewRequest(&opendsecv1.SetNetworkRequest{Id: id, Network: policy}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetSandbox(), nil
}
