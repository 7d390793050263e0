package apiserver

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// PauseSandbox asks the owning node to freeze the sandbox (and, with
// reclaim, to push its memory out).
func (s *Server) PauseSandbox(ctx context.Context, req *connect.Request[v1.PauseSandboxRequest]) (*connect.Response[v1.PauseSandboxResponse], error) {
	n, err := s.nodeFor(ctx, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	resp, err := n.Node().PauseSandbox(ctx, connect.NewRequest(nodePauseRequest(req.Msg)))
	if err != nil {
		return nil, remoteErr(ctx, "pause sandbox", err)
	}
	return connect.NewResponse(&v1.PauseSandboxResponse{Sandbox: publicSandbox(resp.Msg.GetSandbox()), BytesFreed: resp.Msg.GetBytesFreed()}), nil
}

// ResumeSandbox asks the owning node to thaw the sandbox.
func (s *Server) ResumeSandbox(ctx context.Context, req *connect.Request[v1.ResumeSandboxRequest]) (*connect.Response[v1.ResumeSandboxResponse], error) {
	n, err := s.nodeFor(ctx, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	if err := checkResumeTimeout(req.Msg.GetTimeoutSeconds()); err != nil {
		return nil, err
	}
	resp, err := n.Node().ResumeSandbox(ctx, connect.NewRequest(nodeResumeRequest(req.Msg)))
	if err != nil {
		return nil, remoteErr(ctx, "resume sandbox", err)
	}
	return connect.NewResponse(&v1.ResumeSandboxResponse{Sandbox: publicSandbox(resp.Msg.GetSandbox())}), nil
}

// checkResumeTimeout allows 0 (keep the lifetime left at the pause).
func checkResumeTimeout(sec int64) error {
	if sec == 0 {
		return nil
	}
	return checkTimeout("timeout_seconds", sec)
}

// GetSandboxMetrics asks the owning node for the sandbox's resource use.
func (s *Server) GetSandboxMetrics(ctx context.Context, req *connect.Request[v1.GetSandboxMetricsRequest]) (*connect.Response[v1.GetSandboxMetricsResponse], error) {
	n, err := s.nodeFor(ctx, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	resp, err := n.Node().GetSandboxMetrics(ctx, connect.NewRequest(nodeMetricsRequest(req.Msg)))
	if err != nil {
		return nil, remoteErr(ctx, "get sandbox metrics", err)
	}
	return connect.NewResponse(&v1.GetSandboxMetricsResponse{Metrics: publicMetrics(resp.Msg.GetMetrics())}), nil
}

// PauseSandboxes pauses every matching sandbox on every node at once; with
// reclaim each node then pushes their memory out, and the answer lists what
// each sandbox freed and the sum over every node. A task_id or labels that
// match no sandbox anywhere is not_found (not an empty success: a typo in a
// task name must not look like a paused task).
func (s *Server) PauseSandboxes(ctx context.Context, req *connect.Request[v1.PauseSandboxesRequest]) (*connect.Response[v1.PauseSandboxesResponse], error) {
	sel := req.Msg.GetSelector()
	reclaim := req.Msg.GetReclaim()
	var (
		mu        sync.Mutex
		reclaimed []*v1.SandboxReclaim
		freed     int64
	)
	d := s.cfg.BatchNodeTimeout
	if reclaim {
		d = max(d, s.cfg.ReclaimNodeTimeout)
	}
	ok, failed, err := s.fanOut(ctx, sel, "pause sandboxes", d, func(ctx context.Context, n *nodeclient.Client, sel *v1.SandboxSelector) ([]*v1.Sandbox, []*v1.BatchFailure, error) {
		resp, err := n.Node().PauseSandboxes(ctx, connect.NewRequest(nodePauseBatchRequest(sel, reclaim)))
		if err != nil {
			return nil, nil, err
		}
		mu.Lock()
		reclaimed = append(reclaimed, publicReclaims(resp.Msg.GetReclaimed())...)
		freed += resp.Msg.GetBytesFreed()
		mu.Unlock()
		return publicSandboxes(resp.Msg.GetSandboxes()), publicFailures(resp.Msg.GetFailures()), nil
	})
	if err != nil {
		return nil, err
	}
	if err := matchedNothing(sel, ok, failed); err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.PauseSandboxesResponse{Sandboxes: ok, Failures: failed, Reclaimed: reclaimed, BytesFreed: freed}), nil
}

// ResumeSandboxes resumes every matching sandbox on every node at once; a
// task_id or labels that match nothing anywhere is not_found.
func (s *Server) ResumeSandboxes(ctx context.Context, req *connect.Request[v1.ResumeSandboxesRequest]) (*connect.Response[v1.ResumeSandboxesResponse], error) {
	if err := checkResumeTimeout(req.Msg.GetTimeoutSeconds()); err != nil {
		return nil, err
	}
	sel := req.Msg.GetSelector()
	timeout := req.Msg.GetTimeoutSeconds()
	ok, failed, err := s.fanOut(ctx, sel, "resume sandboxes", s.cfg.BatchNodeTimeout, func(ctx context.Context, n *nodeclient.Client, sel *v1.SandboxSelector) ([]*v1.Sandbox, []*v1.BatchFailure, error) {
		resp, err := n.Node().ResumeSandboxes(ctx, connect.NewRequest(nodeResumeBatchRequest(sel, timeout)))
		if err != nil {
			return nil, nil, err
		}
		return publicSandboxes(resp.Msg.GetSandboxes()), publicFailures(resp.Msg.GetFailures()), nil
	})
	if err != nil {
		return nil, err
	}
	if err := matchedNothing(sel, ok, failed); err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.ResumeSandboxesResponse{Sandboxes: ok, Failures: failed}), nil
}

// matchedNothing is the not_found of a batch by task_id or labels that no
// node matched (and none failed: an unreachable node may hold them). A
// batch by ids already names each missing id in its failures.
func matchedNothing(sel *v1.SandboxSelector, ok []*v1.Sandbox, failed []*v1.BatchFailure) error {
	if len(ok) > 0 || len(failed) > 0 || len(sel.GetIds()) > 0 {
		return nil
	}
	var what string
	switch {
	case sel.GetTaskId() != "" && len(sel.GetLabels()) > 0:
		what = fmt.Sprintf("of task %s with labels %s", sel.GetTaskId(), labelList(sel.GetLabels()))
	case sel.GetTaskId() != "":
		what = "of task " + sel.GetTaskId()
	default:
		what = "with labels " + labelList(sel.GetLabels())
	}
	return errdefs.New(errdefs.ErrNotFound, "no running or paused sandboxes %s (selector.task_id / selector.labels); list them with `opendsecctl task list` or ListSandboxes", what)
}

type batchCall func(ctx context.Context, n *nodeclient.Client, sel *v1.SandboxSelector) ([]*v1.Sandbox, []*v1.BatchFailure, error)

// fanOut runs call on every configured node, all at once, healthy or not
// in the watcher's view. With ids, only their owning nodes are asked, each
// with its own ids; an id of an unknown node is a per-sandbox not_found
// failure. A node that fails as a whole (unreachable, say, or silent for
// longer than d, Config.BatchNodeTimeout or ReclaimNodeTimeout) is one failure with an empty
// sandbox_id and a message naming the node.
func (s *Server) fanOut(ctx context.Context, sel *v1.SandboxSelector, what string, d time.Duration, call batchCall) ([]*v1.Sandbox, []*v1.BatchFailure, error) {
	if len(sel.GetLabels()) == 0 && sel.GetTaskId() == "" && len(sel.GetIds()) == 0 {
		return nil, nil, errdefs.Invalid("selector", "is empty; give labels, task_id or ids (an empty selector would match every sandbox)")
	}
	var failed []*v1.BatchFailure
	type target struct {
		n   *nodeclient.Client
		sel *v1.SandboxSelector
	}
	targets := map[string]*target{} // by node ID
	if ids := sel.GetIds(); len(ids) > 0 {
		for i, id := range ids {
			n, err := s.nodeFor(ctx, fmt.Sprintf("selector.ids[%d]", i), id)
			if errdefs.IsInvalidArgument(err) {
				return nil, nil, err
			}
			if err != nil {
				failed = append(failed, &v1.BatchFailure{SandboxId: id, ErrorCode: errdefs.Code(err).String(), ErrorMessage: err.Error()})
				continue
			}
			t, ok := targets[n.ID()]
			if !ok {
				t = &target{n: n, sel: &v1.SandboxSelector{Labels: sel.GetLabels(), TaskId: sel.GetTaskId()}}
				targets[n.ID()] = t
			}
			t.sel.Ids = append(t.sel.Ids, id)
		}
	} else {
		// Every configured node, whatever the watcher thinks of it: a node
		// that is briefly unhealthy (preempted, overloaded) may still hold
		// matching sandboxes, and one that cannot be reached must show up
		// as a failure, not be skipped.
		nodes, err := s.nodes.List(ctx)
		if err != nil {
			return nil, nil, err
		}
		for _, n := range nodes {
			targets[n.ID()] = &target{n: n, sel: sel}
		}
	}
	var (
		mu  sync.Mutex
		out []*v1.Sandbox
		wg  sync.WaitGroup
	)
	for _, t := range targets {
		n, nsel := t.n, t.sel
		wg.Go(func() {
			nctx, cancel := context.WithTimeoutCause(ctx, d, errdefs.New(errdefs.ErrDeadlineExceeded,
				"no answer within %s; its sandboxes may or may not have changed, so check them or retry the batch", d))
			defer cancel()
			ok, bad, err := call(nctx, n, nsel)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				err = remoteErr(nctx, what, err)
				log.G(ctx).Warn(what+" on node", log.NodeID(n.ID()), log.Err(err))
				failed = append(failed, &v1.BatchFailure{ErrorCode: errdefs.Code(err).String(), ErrorMessage: fmt.Sprintf("node %s: %v", n.ID(), err)})
				return
			}
			out = append(out, ok...)
			failed = append(failed, bad...)
		})
	}
	wg.Wait()
	return out, failed, nil
}

// labelList is "k1=v1,k2=v2", sorted.
func labelList(m map[string]string) string {
	kv := make([]string, 0, len(m))
	for k, v := range m {
		kv = append(kv, k+"="+v)
	}
	sort.Strings(kv)
	return strings.Join(kv, ",")
}
