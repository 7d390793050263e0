package node

import (
	"context"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/httpserver"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
	"github.com/kernflux/opendsec/internal/version"
)

// Handler serves NodeService (opts carry the authentication interceptor)
// and an unauthenticated GET /metrics. The agent proxy is served separately (AgentProxy) so the caller wraps it
// in its own authentication middleware.
func (n *Node) Handler(opts ...connect.HandlerOption) http.Handler {
	mux := http.NewServeMux()
	opts = append(opts, connect.WithInterceptors(errdefs.Interceptor()), connect.WithCompressMinBytes(httpserver.CompressMinBytes))
	path, h := nodev1connect.NewNodeServiceHandler(&service{n: n}, opts...)
	mux.Handle(path, h)
	mux.Handle("GET /metrics", n.MetricsHandler())
	return mux
}

type service struct {
	n *Node
}

var _ nodev1connect.NodeServiceHandler = (*service)(nil)

// toProto is the sandbox's view in the node's own message (node.v1); the
// apiserver maps it to the public one.
func (n *Node) toProto(sb *sandbox) *nodev1.Sandbox {
	n.mu.Lock()
	rec := sb.rec
	n.mu.Unlock()
	st := nodev1.SandboxState_SANDBOX_STATE_RUNNING
	switch rec.State {
	case stateCreating:
		st = nodev1.SandboxState_SANDBOX_STATE_CREATING
	case stateStopping:
		st = nodev1.SandboxState_SANDBOX_STATE_STOPPING
	case statePaused:
		st = nodev1.SandboxState_SANDBOX_STATE_PAUSED
	}
	if sb.died.Load() {
		st = nodev1.SandboxState_SANDBOX_STATE_FAILED
	}
	reason, _ := sb.reason.Load().(string)
	return &nodev1.Sandbox{
		Id:               rec.ID,
		NodeId:           n.cfg.ID,
		Spec:             specpb.ToNode(rec.Spec),
		State:            st,
		CreatedAt:        timestamppb.New(rec.CreatedAt),
		ExpiresAt:        timestamppb.New(rec.ExpiresAt),
		LastActivityAt:   timestamppb.New(time.Unix(0, sb.lastActivity.Load())),
		Reason:           reason,
		FromWarmPool:     rec.FromPool,
		Owner:            rec.Owner,
		Project:          rec.Project,
		Backend:          rec.Backend,
		PausedFilesystem: rec.State == statePaused && rec.PausedFilesystem,
		ParentId:         rec.ParentID,
	}
}

func (s *service) CreateSandbox(ctx context.Context, req *connect.Request[nodev1.CreateSandboxRequest]) (*connect.Response[nodev1.CreateSandboxResponse], error) {
	spec, err := specpb.FromNode(req.Msg.GetSpec())
	if err != nil {
		return nil, err
	}
	owner, project := ownerOf(ctx)
	rec, err := s.n.Create(ctx, CreateRequest{
		ID:        req.Msg.GetSandboxId(),
		RequestID: req.Msg.GetRequestId(),
		Spec:      spec,
		SkipPool:  req.Msg.GetSkipWarmPool(),
		Owner:     owner,
		Project:   project,
	})
	if err != nil {
		return nil, err
	}
	if !callerOf(ctx).owns(rec) {
		// A retry's request_id names another caller's sandbox.
		return nil, errdefs.New(errdefs.ErrAlreadyExists,
			"request_id %q was used by another caller; choose a new one", req.Msg.GetRequestId())
	}
	// A deduplicated retry returns the first sandbox, and a warm-pool one
	// keeps its own ID: both may differ from the ID asked for.
	sb, err := s.n.get(rec.ID)
	if err != nil {
		return nil, err
	}
	u := s.n.usage()
	return connect.NewResponse(&nodev1.CreateSandboxResponse{Sandbox: s.n.toProto(sb), Used: u.capacity(), UsedSeq: u.seq}), nil
}

func (s *service) GetSandbox(ctx context.Context, req *connect.Request[nodev1.GetSandboxRequest]) (*connect.Response[nodev1.GetSandboxResponse], error) {
	sb, _, err := s.n.getOrDeadFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.GetSandboxResponse{Sandbox: s.n.toProto(sb)}), nil
}

func (s *service) ListSandboxes(ctx context.Context, req *connect.Request[nodev1.ListSandboxesRequest]) (*connect.Response[nodev1.ListSandboxesResponse], error) {
	var out []*nodev1.Sandbox
	c := callerOf(ctx)
	for _, sb := range s.n.List(ctx) {
		if pb := s.n.toProto(sb); c.owns(&record{Owner: pb.GetOwner(), Project: pb.GetProject()}) {
			out = append(out, pb)
		}
	}
	return connect.NewResponse(&nodev1.ListSandboxesResponse{Sandboxes: out}), nil
}

func (s *service) StopSandbox(ctx context.Context, req *connect.Request[nodev1.StopSandboxRequest]) (*connect.Response[nodev1.StopSandboxResponse], error) {
	if err := s.n.checkOwner(ctx, req.Msg.GetSandboxId()); err != nil {
		return nil, err
	}
	if err := s.n.Stop(ctx, req.Msg.GetSandboxId(), "stopped by caller"); err != nil {
		return nil, err
	}
	u := s.n.usage()
	return connect.NewResponse(&nodev1.StopSandboxResponse{Used: u.capacity(), UsedSeq: u.seq}), nil
}

func (s *service) SetTimeout(ctx context.Context, req *connect.Request[nodev1.SetTimeoutRequest]) (*connect.Response[nodev1.SetTimeoutResponse], error) {
	if err := s.n.checkOwner(ctx, req.Msg.GetSandboxId()); err != nil {
		return nil, err
	}
	if _, err := s.n.SetTimeout(ctx, req.Msg.GetSandboxId(), req.Msg.GetTimeoutSeconds()); err != nil {
		return nil, err
	}
	sb, err := s.n.get(req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.SetTimeoutResponse{Sandbox: s.n.toProto(sb)}), nil
}

func (s *service) SetNetwork(ctx context.Context, req *connect.Request[nodev1.SetNetworkRequest]) (*connect.Response[nodev1.SetNetworkResponse], error) {
	if err := s.n.checkOwner(ctx, req.Msg.GetSandboxId()); err != nil {
		return nil, err
	}
	rules := specpb.RulesFromNode(req.Msg.GetNetwork())
	if rules == nil {
		rules = &netpolicy.Rules{}
	}
	if _, err := s.n.SetNetwork(ctx, req.Msg.GetSandboxId(), *rules); err != nil {
		return nil, err
	}
	sb, err := s.n.get(req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.SetNetworkResponse{Sandbox: s.n.toProto(sb)}), nil
}

// liveCounts counts the sandboxes c may see that are neither stopped nor
// failed, by backend (the spec's, else the node's default) and by task,
// as the watcher did from ListSandboxes: one pass under n.mu, without
// building each sandbox's proto.
func (n *Node) liveCounts(c caller) (byBackend, byTask map[string]int64) {
	byBackend, byTask = map[string]int64{}, map[string]int64{}
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, sb := range n.sandboxes {
		rec := sb.rec
		if sb.died.Load() || !c.owns(rec) {
			continue // failed (ListSandboxes never shows one stopped: it leaves the table)
		}
		backend := rec.Spec.Backend
		if backend == "" {
			backend = n.cfg.DefaultBackend
		}
		byBackend[backend]++
		if rec.Spec.TaskID != "" {
			byTask[rec.Spec.TaskID]++
		}
	}
	return byBackend, byTask
}

func (u usageReading) capacity() *nodev1.Capacity {
	return &nodev1.Capacity{Cpu: u.cpu, MemoryMb: u.memMB, Sandboxes: int64(u.count)}
}

func (s *service) Info(ctx context.Context, req *connect.Request[nodev1.InfoRequest]) (*connect.Response[nodev1.InfoResponse], error) {
	u := s.n.usage()
	resp := &nodev1.InfoResponse{
		NodeId:               s.n.cfg.ID,
		Backends:             backendNames(s.n.cfg.Backends),
		DefaultBackend:       s.n.cfg.DefaultBackend,
		Total:                &nodev1.Capacity{Cpu: s.n.cpuQuota(), MemoryMb: s.n.memQuota(), Sandboxes: s.n.cfg.MaxSandboxes},
		Used:                 u.capacity(),
		UsedSeq:              u.seq,
		Healthy:              true,
		Now:                  timestamppb.Now(),
		Version:              version.Version,
		Accelerator:          acceleratorProto(s.n.cfg.Accelerator),
		DefaultBackendReason: s.n.cfg.DefaultBackendReason,
		SandboxCounts:        true,
	}
	resp.SandboxesByBackend, resp.SandboxesByTask = s.n.liveCounts(callerOf(ctx))
	if c := s.n.cfg.CoreScheduling; c != nil {
		resp.CoreScheduling = &nodev1.CoreScheduling{Enabled: c.Enabled, Reason: c.Reason}
	}
	for _, name := range resp.Backends {
		info := s.n.cfg.Backends[name].Info()
		resp.BackendInfo = append(resp.BackendInfo, &nodev1.BackendInfo{Name: name, Version: info.Version, Detail: info.Detail})
	}
	return connect.NewResponse(resp), nil
}

func (s *service) ForkSandbox(ctx context.Context, req *connect.Request[nodev1.ForkSandboxRequest]) (*connect.Response[nodev1.ForkSandboxResponse], error) {
	if t := req.Msg.GetTargetNode(); t != "" && t != s.n.cfg.ID {
		return nil, errdefs.New(errdefs.ErrUnimplemented, "fork to another node is not supported yet; leave target_node empty")
	}
	// A sandbox the caller does not own is not found, like one that does
	// not exist; one that died lately goes on to Fork, which says so.
	src, _, err := s.n.getOrDeadFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox_id: sandbox %s not found (a stopped sandbox is gone); fork a running or paused sandbox", req.Msg.GetSandboxId())
	}
	out, err := s.n.Fork(ctx, ForkRequest{
		SourceID:   src.id, // a warm-pool sandbox's own ID
		Count:      int(req.Msg.GetCount()),
		RequestID:  req.Msg.GetRequestId(),
		TimeoutSec: req.Msg.GetTimeoutSeconds(),
	})
	if err != nil {
		return nil, err
	}
	resp := &nodev1.ForkSandboxResponse{SourceFrozenUs: out.SourceFrozen.Microseconds()}
	for _, f := range out.Forks {
		resp.Forks = append(resp.Forks, &nodev1.ForkResult{Sandbox: s.n.toProto(f.Sandbox), MemoryPreserved: f.MemoryPreserved})
	}
	return connect.NewResponse(resp), nil
}

// acceleratorProto is the accelerator decision for Info (nil if none).
func acceleratorProto(r *Accelerator) *nodev1.Accelerator {
	if r == nil {
		return nil
	}
	return &nodev1.Accelerator{
		Accel:             r.Accel,
		Kind:              r.Kind,
		Module:            r.Module,
		Reason:            r.Reason,
		ProbeInstructions: r.ProbeInstructions,
		ProbeDurationUs:   r.ProbeDuration.Microseconds(),
		DetectedAt:        timestamppb.New(r.DetectedAt),
	}
}

func (s *service) PrewarmSandboxes(ctx context.Context, req *connect.Request[nodev1.PrewarmSandboxesRequest]) (*connect.Response[nodev1.PrewarmSandboxesResponse], error) {
	if ttl := req.Msg.GetTtlSeconds(); ttl < 0 || ttl > int64(MaxPrewarmTTL/time.Second) {
		return nil, errdefs.Invalid("ttl_seconds", "%d must be between 0 (the pool's idle TTL) and %d seconds", ttl, int64(MaxPrewarmTTL/time.Second))
	}
	spec, err := specpb.FromNode(req.Msg.GetSpec())
	if err != nil {
		return nil, err
	}
	res, err := s.n.Prewarm(ctx, PrewarmRequest{
		Spec:  spec,
		Count: int(req.Msg.GetCount()),
		TTL:   time.Duration(req.Msg.GetTtlSeconds()) * time.Second,
		Wait:  req.Msg.GetWait(),
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.PrewarmSandboxesResponse{
		Held:       int32(res.Held),  //nolint:gosec // at most node.warm_pool.max_sandboxes
		Ready:      int32(res.Ready), //nolint:gosec // at most Held
		Reason:     res.Reason,
		TtlSeconds: int64(res.TTL / time.Second),
	}), nil
}
