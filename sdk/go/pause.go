package opendsec

import (
	"context"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// Metrics is one sample of a sandbox's resource use: CPU (count, percent
// used since the previous sample, cumulative ns), memory (used, limit,
// cache), processes, and the bytes written to its root filesystem.
type Metrics = opendsecv1.SandboxMetrics

// PauseSandbox freezes every process of a sandbox. A paused sandbox keeps
// its memory and files, is never stopped by its timeouts (its lifetime clock
// stops) and persists until it is resumed or stopped; any exec, file or port
// call into it resumes it first (see docs/concepts.md, "Lifecycle").
// Pausing a paused sandbox succeeds.
func (c *Client) PauseSandbox(ctx context.Context, id string) (*Sandbox, error) {
	if id == "" {
		return nil, invalid("id", "is required; pass the sandbox ID")
	}
	resp, err := c.sandboxes.PauseSandbox(ctx, connect.NewRequest(&opendsecv1.PauseSandboxRequest{Id: id}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetSandbox(), nil
}

// PauseSandboxReclaim is PauseSandbox that then pushes the sandbox's memory
// out of RAM (to swap where the node has it; page cache is dropped either
// way), as PauseTask does for a whole task. It returns the bytes freed. A
// backend that cannot reclaim refuses (failed precondition) and the sandbox
// stays as it was.
func (c *Client) PauseSandboxReclaim(ctx context.Context, id string) (*Sandbox, int64, error) {
	if id == "" {
		return nil, 0, invalid("id", "is required; pass the sandbox ID")
	}
	resp, err := c.sandboxes.PauseSandbox(ctx, connect.NewRequest(&opendsecv1.PauseSandboxRequest{Id: id, Reclaim: true}))
	if err != nil {
		return nil, 0, convertError(err)
	}
	return resp.Msg.GetSandbox(), resp.Msg.GetBytesFreed(), nil
}

// PauseSandboxFilesystem pauses a sandbox keeping only its files (E2B's
// pause with memory false): its processes end and its memory and its CPU
// and memory reservation are given back; its writable layer, network
// rules, env, labels and ID stay (Sandbox.PausedFilesystem is set). A
// resume (ResumeSandbox, or any call into it) starts it again on the same
// files with a fresh init, once its node has room for it again. Only the
// container backend can; others answer unimplemented.
func (c *Client) PauseSandboxFilesystem(ctx context.Context, id string) (*Sandbox, error) {
	if id == "" {
		return nil, invalid("id", "is required; pass the sandbox ID")
	}
	resp, err := c.sandboxes.PauseSandbox(ctx, connect.NewRequest(&opendsecv1.PauseSandboxRequest{Id: id, FilesystemOnly: true}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetSandbox(), nil
}

// ResumeSandbox thaws a paused sandbox. With timeout 0 its lifetime
// continues with what was left at the pause; otherwise it ends timeout from
// now (rounded up to whole seconds). Resuming a running sandbox succeeds.
func (c *Client) ResumeSandbox(ctx context.Context, id string, timeout time.Duration) (*Sandbox, error) {
	if id == "" {
		return nil, invalid("id", "is required; pass the sandbox ID")
	}
	secs, err := resumeSeconds(timeout)
	if err != nil {
		return nil, err
	}
	resp, err := c.sandboxes.ResumeSandbox(ctx, connect.NewRequest(&opendsecv1.ResumeSandboxRequest{Id: id, TimeoutSeconds: secs}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetSandbox(), nil
}

func resumeSeconds(d time.Duration) (int64, error) {
	if d < 0 {
		return 0, invalid("timeout", "must be 0 (keep the lifetime left at the pause) or positive, got %s", d)
	}
	return int64((d + time.Second - 1) / time.Second), nil
}

// SandboxMetrics returns a sandbox's current resource use.
func (c *Client) SandboxMetrics(ctx context.Context, id string) (*Metrics, error) {
	if id == "" {
		return nil, invalid("id", "is required; pass the sandbox ID")
	}
	resp, err := c.sandboxes.GetSandboxMetrics(ctx, connect.NewRequest(&opendsecv1.GetSandboxMetricsRequest{Id: id}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetMetrics(), nil
}

// Selector picks the sandboxes of a batch pause or resume. At least one
// field must be set; set fields are AND-ed.
type Selector struct {
	Labels map[string]string
	TaskID string
	IDs    []string
}

func (s Selector) proto() *opendsecv1.SandboxSelector {
	return &opendsecv1.SandboxSelector{Labels: s.Labels, TaskId: s.TaskID, Ids: s.IDs}
}

// BatchFailure is a sandbox a batch pause or resume could not handle. ID is
// empty when a whole node failed to answer.
type BatchFailure struct {
	ID  string
	Err error
}

// BatchOutcome is what a batch pause or resume did.
type BatchOutcome struct {
	// Sandboxes are the ones now paused (or running, for a resume).
	Sandboxes []*Sandbox
	Failures  []BatchFailure
	// Reclaimed lists, for a pause with reclaim, the memory each paused
	// sandbox freed; BytesFreed is their sum over every node.
	Reclaimed  []*SandboxReclaim
	BytesFreed int64
}

// SandboxReclaim is the memory a reclaim pushed out of one sandbox: bytes
// charged in RAM before and after, and a note when less could go (the node
// has no swap, say).
type SandboxReclaim = opendsecv1.SandboxReclaim

func outcome(sbs []*Sandbox, fs []*opendsecv1.BatchFailure) *BatchOutcome {
	o := &BatchOutcome{Sandboxes: sbs}
	for _, f := range fs {
		o.Failures = append(o.Failures, BatchFailure{ID: f.GetSandboxId(), Err: itemError(f.GetErrorCode(), f.GetErrorMessage())})
	}
	return o
}

func (s Selector) check() error {
	if len(s.Labels) == 0 && s.TaskID == "" && len(s.IDs) == 0 {
		return invalid("selector", "is empty; give labels, a task ID or IDs")
	}
	return nil
}

// PauseSandboxes pauses every sandbox sel matches, on every node at once:
// the preemption case of a training job. Sandboxes fail one by one
// (BatchOutcome.Failures); the error is for the call as a whole.
func (c *Client) PauseSandboxes(ctx context.Context, sel Selector) (*BatchOutcome, error) {
	if err := sel.check(); err != nil {
		return nil, err
	}
	resp, err := c.sandboxes.PauseSandboxes(ctx, connect.NewRequest(&opendsecv1.PauseSandboxesRequest{Selector: sel.proto()}))
	if err != nil {
		return nil, convertError(err)
	}
	return outcome(resp.Msg.GetSandboxes(), resp.Msg.GetFailures()), nil
}

// PauseTaskOptions refine PauseTask.
type PauseTaskOptions struct {
	// Reclaim pushes the paused sandboxes' memory out of RAM (to swap where
	// the node has it; page cache either way) and reports what each freed.
	Reclaim bool
	// Labels narrow the task to the sandboxes that have all of these.
	Labels map[string]string
}

// PauseTask pauses every sandbox of the task on every node at once and,
// with opts.Reclaim, frees their memory: the preemption case of a training
// job. A task with no running or paused sandbox is NotFound. ResumeTask
// brings them back; a call to any one of them resumes just that one.
func (c *Client) PauseTask(ctx context.Context, taskID string, opts PauseTaskOptions) (*BatchOutcome, error) {
	if taskID == "" {
		return nil, invalid("task_id", "is required; pass the task ID the sandboxes were created with")
	}
	sel := Selector{TaskID: taskID, Labels: opts.Labels}
	resp, err := c.sandboxes.PauseSandboxes(ctx, connect.NewRequest(&opendsecv1.PauseSandboxesRequest{Selector: sel.proto(), Reclaim: opts.Reclaim}))
	if err != nil {
		return nil, convertError(err)
	}
	o := outcome(resp.Msg.GetSandboxes(), resp.Msg.GetFailures())
	o.Reclaimed, o.BytesFreed = resp.Msg.GetReclaimed(), resp.Msg.GetBytesFreed()
	return o, nil
}

// ResumeTask resumes every sandbox of the task (with all of labels, when
// given); each continues with the lifetime it had left at the pause.
func (c *Client) ResumeTask(ctx context.Context, taskID string, labels map[string]string) (*BatchOutcome, error) {
	if taskID == "" {
		return nil, invalid("task_id", "is required; pass the task ID the sandboxes were created with")
	}
	return c.ResumeSandboxes(ctx, Selector{TaskID: taskID, Labels: labels}, 0)
}

// ResumeSandboxes resumes every sandbox sel matches; timeout is as in
// ResumeSandbox.
func (c *Client) ResumeSandboxes(ctx context.Context, sel Selector, timeout time.Duration) (*BatchOutcome, error) {
	if err := sel.check(); err != nil {
		return nil, err
	}
	secs, err := resumeSeconds(timeout)
	if err != nil {
		return nil, err
	}
	resp, err := c.sandboxes.ResumeSandboxes(ctx, connect.NewRequest(&opendsecv1.ResumeSandboxesRequest{Selector: sel.proto(), TimeoutSeconds: secs}))
	if err != nil {
		return nil, convertError(err)
	}
	return outcome(resp.Msg.GetSandboxes(), resp.Msg.GetFailures()), nil
}
