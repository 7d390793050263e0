package apiserver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/placement"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// CreateSandbox validates the spec, places it and creates it on the first
// candidate node that admits it.
//
// Idempotency: request_id goes to the node, which returns the sandbox it
// already made for that key. Nodes do not share keys, so a retry that
// placement sends to a different node than the first attempt (possible only
// with several nodes whose load changed in between) can make a second
// sandbox; the apiserver only moves to another node when one definitely
// refused (resource_exhausted), never after an ambiguous failure.
func (s *Server) CreateSandbox(ctx context.Context, req *connect.Request[v1.CreateSandboxRequest]) (*connect.Response[v1.CreateSandboxResponse], error) {
	if err := sandboxspec.CheckRequestID("request_id", req.Msg.GetRequestId(), sandboxspec.MaxRequestIDLen); err != nil {
		return nil, err
	}
	ctx, raw, err := s.resolveSnapshot(ctx, req.Msg.GetSpec())
	if err != nil {
		return nil, err
	}
	spec, err := normalizeSpec(raw)
	if err != nil {
		return nil, err
	}
	if err := checkNetworkPolicy(ctx, spec.GetNetwork()); err != nil {
		return nil, err
	}
	sb, err := s.create(ctx, spec, req.Msg.GetRequestId(), req.Msg.GetSkipWarmPool())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.CreateSandboxResponse{Sandbox: sb}), nil
}

// placementNodes turns the watcher's view into placement's nodes, leaving
// out those the node directory cannot route to.
func placementNodes(view []*watcherv1.NodeStatus, routable func(nodeID string) bool) []placement.Node {
	out := make([]placement.Node, 0, len(view))
	for _, st := range view {
		info := st.GetInfo()
		if info == nil || !routable(st.GetNodeId()) {
			continue
		}
		out = append(out, placement.Node{
			ID:             st.GetNodeId(),
			Healthy:        st.GetHealthy(),
			Backends:       info.GetBackends(),
			DefaultBackend: info.GetDefaultBackend(),
			Total:          placement.Resources{CPU: info.GetTotal().GetCpu(), MemoryMB: info.GetTotal().GetMemoryMb(), Sandboxes: info.GetTotal().GetSandboxes()},
			Used:           placementResources(info.GetUsed()),
			UsedSeq:        info.GetUsedSeq(),
		})
	}
	return out
}

func placementResources(c *nodev1.Capacity) placement.Resources {
	return placement.Resources{CPU: c.GetCpu(), MemoryMB: c.GetMemoryMb(), Sandboxes: c.GetSandboxes()}
}

func placementRequest(spec *v1.SandboxSpec) placement.Request {
	return placement.Request{Backend: spec.GetBackend(), CPU: spec.GetCpu(), MemoryMB: spec.GetMemoryMb()}
}

// candidates returns the nodes to try for spec.
func (s *Server) candidates(ctx context.Context, spec *v1.SandboxSpec) ([]string, error) {
	view, err := s.nodeView(ctx)
	if err != nil {
		return nil, err
	}
	routable := func(nodeID string) bool {
		_, err := s.nodes.Get(ctx, nodeID)
		return err == nil
	}
	cands, err := s.placer.Candidates(placementNodes(view, routable), placementRequest(spec))
	if pin := pinnedNode(ctx); pin != "" && err == nil {
		if !slices.Contains(cands, pin) {
			return nil, errdefs.New(errdefs.ErrUnavailable, "snapshot %s can only be restored on node %s, which cannot take the sandbox now; retry later", spec.GetSnapshot(), pin)
		}
		cands = []string{pin}
	}
	return cands, err
}

// create places and creates one sandbox from a normalized spec.
// skipPool makes the sandbox from scratch even when the node's warm pool
// holds a matching one.
func (s *Server) create(ctx context.Context, spec *v1.SandboxSpec, requestID string, skipPool bool) (*v1.Sandbox, error) {
	cands, err := s.candidates(ctx, spec)
	if err != nil {
		return nil, err // already says what to change; no prefix
	}
	var refused []string
	var lastErr error
	for _, nodeID := range cands {
		n, err := s.nodes.Get(ctx, nodeID)
		if err != nil {
			return nil, fmt.Errorf("create sandbox: %w", err)
		}
		id := sandboxid.New(nodeID)
		r := s.placer.Reserve(nodeID, placementRequest(spec))
		resp, err := n.Node().CreateSandbox(ctx, connect.NewRequest(nodeCreateRequest(id, spec, requestID, skipPool)))
		if err == nil {
			r.Done(placementResources(resp.Msg.GetUsed()), resp.Msg.GetUsedSeq())
			return publicSandbox(resp.Msg.GetSandbox()), nil
		}
		r.Release()
		if ctx.Err() != nil {
			// The node may still finish the create after we gave up.
			// With a request_id the caller's retry gets that very sandbox
			// (stopping it here would race with the retry and hand it a
			// dead one); without one nobody can ever claim it: stop it so
			// nothing is left half-made.
			if requestID == "" {
				s.stopAbandoned(ctx, n, id)
			}
			return nil, fmt.Errorf("create sandbox: %w", context.Cause(ctx))
		}
		err = remoteErr(ctx, "create sandbox on node "+nodeID, err)
		switch {
		case errors.Is(err, errdefs.ErrResourceExhausted):
			refused = append(refused, nodeID)
			lastErr = err
			continue
		case errors.Is(err, errdefs.ErrNotFound) && spec.GetSnapshot() != "":
			return nil, err // the snapshot went away meanwhile; the node named it
		case errors.Is(err, errdefs.ErrNotFound):
			// The node does not have the image.
			msg := strings.TrimPrefix(strings.TrimPrefix(err.Error(), "image: "), "image ")
			return nil, errdefs.Invalid("image", "%s", msg)
		}
		return nil, err
	}
	return nil, errdefs.New(errdefs.ErrResourceExhausted, "every candidate node refused (%s): %s", strings.Join(refused, ", "), lastErr)
}

func (s *Server) stopAbandoned(ctx context.Context, n *nodeclient.Client, id string) {
	go func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		resp, err := n.Node().StopSandbox(sctx, connect.NewRequest(nodeStopRequest(id)))
		if err == nil {
			s.placer.Observe(n.ID(), placementResources(resp.Msg.GetUsed()), resp.Msg.GetUsedSeq())
		}
		if err != nil && connect.CodeOf(err) != connect.CodeNotFound {
			log.G(ctx).Warn("stop abandoned sandbox", log.SandboxID(id), log.Err(err))
		}
	}()
}

// BatchCreateSandboxes creates count sandboxes with bounded concurrency,
// streaming each result (or per-item error) as it is ready. Item i carries
// the request ID "<request_id>-<i>", so the same request again (after a lost
// stream, a client timeout or an apiserver restart) returns the sandboxes
// already made and makes only the missing ones. When the caller goes away,
// no new creates start; sandboxes whose result could not be delivered are
// stopped when the batch has no request_id (nobody could claim them), and
// kept for the retry when it has one.
func (s *Server) BatchCreateSandboxes(ctx context.Context, req *connect.Request[v1.BatchCreateSandboxesRequest], stream *connect.ServerStream[v1.BatchCreateSandboxesResponse]) error {
	count := req.Msg.GetCount()
	if count < 1 || count > MaxBatch {
		return errdefs.Invalid("count", "%d must be between 1 and %d", count, MaxBatch)
	}
	if err := sandboxspec.CheckRequestID("request_id", req.Msg.GetRequestId(), sandboxspec.MaxRequestIDLen); err != nil {
		return err
	}
	ctx, raw, err := s.resolveSnapshot(ctx, req.Msg.GetSpec())
	if err != nil {
		return err
	}
	spec, err := normalizeSpec(raw)
	if err != nil {
		return err
	}
	if err := checkNetworkPolicy(ctx, spec.GetNetwork()); err != nil {
		return err
	}
	// Requests no node could ever satisfy fail as a whole, up front.
	if _, err := s.candidates(ctx, spec); err != nil && errors.Is(err, errdefs.ErrInvalidArgument) {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	var (
		next    atomic.Int32
		sendMu  sync.Mutex
		sendErr error // guarded by sendMu
		wg      sync.WaitGroup
	)
	rid := req.Msg.GetRequestId()
	for range min(int(count), s.cfg.BatchConcurrency) {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= count || ctx.Err() != nil {
					return
				}
				itemRID := ""
				if rid != "" {
					itemRID = fmt.Sprintf("%s-%d", rid, i)
				}
				sb, err := s.create(ctx, spec, itemRID, req.Msg.GetSkipWarmPool())
				resp := &v1.BatchCreateSandboxesResponse{Index: i, Sandbox: sb}
				if err != nil {
					resp.ErrorCode = errdefs.Code(err).String()
					resp.ErrorMessage = err.Error()
				}
				sendMu.Lock()
				if sendErr == nil {
					sendErr = stream.Send(resp)
					if sendErr != nil {
						cancel()
					}
				}
				undelivered := sendErr != nil
				sendMu.Unlock()
				// A result that could not be delivered is the caller's
				// on a retry with the same request_id; without one it is
				// stopped.
				if undelivered && sb != nil && rid == "" {
					if n, err := s.nodes.Get(context.WithoutCancel(ctx), sb.GetNodeId()); err == nil {
						s.stopAbandoned(ctx, n, sb.GetId())
					}
				}
			}
		})
	}
	wg.Wait()
	if sendErr != nil {
		return sendErr
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return nil
}

// GetSandbox asks the owning node.
func (s *Server) GetSandbox(ctx context.Context, req *connect.Request[v1.GetSandboxRequest]) (*connect.Response[v1.GetSandboxResponse], error) {
	n, err := s.nodeFor(ctx, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	resp, err := n.Node().GetSandbox(ctx, connect.NewRequest(nodeGetRequest(req.Msg.GetId())))
	if err != nil {
		return nil, remoteErr(ctx, "get sandbox", err)
	}
	return connect.NewResponse(&v1.GetSandboxResponse{Sandbox: publicSandbox(resp.Msg.GetSandbox())}), nil
}

// StopSandbox asks the owning node to stop and delete the sandbox.
func (s *Server) StopSandbox(ctx context.Context, req *connect.Request[v1.StopSandboxRequest]) (*connect.Response[v1.StopSandboxResponse], error) {
	n, err := s.nodeFor(ctx, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	resp, err := n.Node().StopSandbox(ctx, connect.NewRequest(nodeStopRequest(req.Msg.GetId())))
	if err != nil {
		return nil, remoteErr(ctx, "stop sandbox", err)
	}
	// Placement counts the stop now, not once the watcher has seen it.
	s.placer.Observe(n.ID(), placementResources(resp.Msg.GetUsed()), resp.Msg.GetUsedSeq())
	return connect.NewResponse(&v1.StopSandboxResponse{}), nil
}

// SetTimeout moves the sandbox's end of life to timeout_seconds from now.
func (s *Server) SetTimeout(ctx context.Context, req *connect.Request[v1.SetTimeoutRequest]) (*connect.Response[v1.SetTimeoutResponse], error) {
	n, err := s.nodeFor(ctx, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	if err := checkTimeout("timeout_seconds", req.Msg.GetTimeoutSeconds()); err != nil {
		return nil, err
	}
	resp, err := n.Node().SetTimeout(ctx, connect.NewRequest(nodeSetTimeoutRequest(req.Msg)))
	if err != nil {
		return nil, remoteErr(ctx, "set timeout", err)
	}
	return connect.NewResponse(&v1.SetTimeoutResponse{Sandbox: publicSandbox(resp.Msg.GetSandbox())}), nil
}

// SetNetwork replaces a running sandbox's network policy. The node checks
// the rules (it knows its rule sets); bad rules change nothing.
func (s *Server) SetNetwork(ctx context.Context, req *connect.Request[v1.SetNetworkRequest]) (*connect.Response[v1.SetNetworkResponse], error) {
	n, err := s.nodeFor(ctx, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	if err := checkNetworkPolicy(ctx, req.Msg.GetNetwork()); err != nil {
		return nil, err
	}
	resp, err := n.Node().SetNetwork(ctx, connect.NewRequest(nodeSetNetworkRequest(req.Msg)))
	if err != nil {
		return nil, remoteErr(ctx, "set network", err)
	}
	return connect.NewResponse(&v1.SetNetworkResponse{Sandbox: publicSandbox(resp.Msg.GetSandbox())}), nil
}

// ListSandboxes asks every healthy node and filters. A node that fails to
// answer is left out (and logged) rather than failing the whole list.
func (s *Server) ListSandboxes(ctx context.Context, req *connect.Request[v1.ListSandboxesRequest]) (*connect.Response[v1.ListSandboxesResponse], error) {
	nodes, err := s.healthyNodes(ctx)
	if err != nil {
		return nil, err
	}
	f := req.Msg
	var (
		mu  sync.Mutex
		out []*v1.Sandbox
	)
	onEach(nodes, func(n liveNode) {
		resp, err := n.Node().ListSandboxes(ctx, connect.NewRequest(nodeListRequest()))
		if err != nil {
			log.G(ctx).Warn("list sandboxes on node", log.NodeID(n.ID()), log.Err(err))
			return
		}
		defBackend := n.status.GetInfo().GetDefaultBackend()
		mu.Lock()
		defer mu.Unlock()
		for _, sb := range publicSandboxes(resp.Msg.GetSandboxes()) {
			if matches(sb, f, defBackend) {
				out = append(out, sb)
			}
		}
	})
	slices.SortFunc(out, byCreated)
	return connect.NewResponse(&v1.ListSandboxesResponse{Sandboxes: out}), nil
}

func matches(sb *v1.Sandbox, f *v1.ListSandboxesRequest, defBackend string) bool {
	spec := sb.GetSpec()
	if f.GetTaskId() != "" && spec.GetTaskId() != f.GetTaskId() {
		return false
	}
	if f.GetBackend() != "" {
		b := spec.GetBackend()
		if b == "" {
			b = defBackend
		}
		if b != f.GetBackend() {
			return false
		}
	}
	for k, v := range f.GetLabels() {
		if got, ok := spec.GetLabels()[k]; !ok || got != v {
			return false
		}
	}
	return true
}
