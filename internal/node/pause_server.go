package node

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

func (s *service) PauseSandbox(ctx context.Context, req *connect.Request[nodev1.PauseSandboxRequest]) (*connect.Response[nodev1.PauseSandboxResponse], error) {
	var rs *runtime.ReclaimStats
	sb, err := s.lifecycle(ctx, req.Msg.GetSandboxId(), func(id string) error {
		var err error
		if req.Msg.GetFilesystemOnly() {
			if req.Msg.GetReclaim() {
				return errdefs.Invalid("reclaim", "a filesystem-only pause (filesystem_only) frees all of the sandbox's memory already; drop reclaim")
			}
			_, err := s.n.PauseFilesystem(ctx, id)
			return err
		}
		_, rs, err = s.n.PauseReclaim(ctx, id, req.Msg.GetReclaim())
		return err
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.PauseSandboxResponse{Sandbox: sb, BytesFreed: rs.Freed()}), nil
}

func (s *service) ResumeSandbox(ctx context.Context, req *connect.Request[nodev1.ResumeSandboxRequest]) (*connect.Response[nodev1.ResumeSandboxResponse], error) {
	sb, err := s.lifecycle(ctx, req.Msg.GetSandboxId(), func(id string) error {
		_, err := s.n.Resume(ctx, id, req.Msg.GetTimeoutSeconds())
		return err
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.ResumeSandboxResponse{Sandbox: sb}), nil
}

// lifecycle runs op on the sandbox, if the caller owns it, and returns its
// new view.
func (s *service) lifecycle(ctx context.Context, id string, op func(string) error) (*nodev1.Sandbox, error) {
	if err := s.n.checkOwner(ctx, id); err != nil {
		return nil, err
	}
	if err := op(id); err != nil {
		return nil, err
	}
	sb, err := s.n.get(id)
	if err != nil {
		return nil, err
	}
	return s.n.toProto(sb), nil
}

func (s *service) GetSandboxMetrics(ctx context.Context, req *connect.Request[nodev1.GetSandboxMetricsRequest]) (*connect.Response[nodev1.GetSandboxMetricsResponse], error) {
	if err := s.n.checkOwner(ctx, req.Msg.GetSandboxId()); err != nil {
		return nil, err
	}
	m, err := s.n.Metrics(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.GetSandboxMetricsResponse{Metrics: metricsToProto(m)}), nil
}

func metricsToProto(m Metrics) *nodev1.SandboxMetrics {
	st := nodev1.SandboxState_SANDBOX_STATE_RUNNING
	if m.State == statePaused {
		st = nodev1.SandboxState_SANDBOX_STATE_PAUSED
	}
	return &nodev1.SandboxMetrics{
		Timestamp:      timestamppb.New(m.Time),
		CpuCount:       m.CPUCount,
		CpuUsedPct:     m.CPUUsedPct,
		CpuUsageNs:     m.CPUNanos,
		MemUsedBytes:   m.MemoryBytes,
		MemTotalBytes:  m.MemoryLimitBytes,
		MemCacheBytes:  m.MemoryCacheBytes,
		Pids:           m.Pids,
		PidsLimit:      m.PidsLimit,
		DiskUsedBytes:  m.DiskUsedBytes,
		DiskTotalBytes: m.DiskTotalBytes,
		State:          st,
	}
}

func selectorFromProto(s *nodev1.SandboxSelector) Selector {
	return Selector{Labels: s.GetLabels(), TaskID: s.GetTaskId(), IDs: s.GetIds()}
}

func (s *service) batchResults(rs []BatchResult) ([]*nodev1.Sandbox, []*nodev1.BatchFailure) {
	var ok []*nodev1.Sandbox
	var failed []*nodev1.BatchFailure
	for _, r := range rs {
		if r.Err != nil {
			failed = append(failed, &nodev1.BatchFailure{SandboxId: r.ID, ErrorCode: errdefs.Code(r.Err).String(), ErrorMessage: r.Err.Error()})
			continue
		}
		if sb, err := s.n.get(r.ID); err == nil {
			ok = append(ok, s.n.toProto(sb))
		}
	}
	return ok, failed
}

func (s *service) PauseSandboxes(ctx context.Context, req *connect.Request[nodev1.PauseSandboxesRequest]) (*connect.Response[nodev1.PauseSandboxesResponse], error) {
	rs, err := s.n.PauseMatching(ctx, ownedBy(ctx, selectorFromProto(req.Msg.GetSelector())), req.Msg.GetReclaim())
	if err != nil {
		return nil, err
	}
	ok, failed := s.batchResults(rs)
	out := &nodev1.PauseSandboxesResponse{Sandboxes: ok, Failures: failed}
	for _, r := range rs {
		if r.Err != nil || r.Reclaim == nil {
			continue
		}
		out.Reclaimed = append(out.Reclaimed, &nodev1.SandboxReclaim{SandboxId: r.ID, BytesBefore: r.Reclaim.Before,
			BytesAfter: r.Reclaim.After, BytesFreed: r.Reclaim.Freed(), Note: r.Reclaim.Note})
		out.BytesFreed += r.Reclaim.Freed()
	}
	return connect.NewResponse(out), nil
}

func (s *service) ResumeSandboxes(ctx context.Context, req *connect.Request[nodev1.ResumeSandboxesRequest]) (*connect.Response[nodev1.ResumeSandboxesResponse], error) {
	rs, err := s.n.ResumeMatching(ctx, ownedBy(ctx, selectorFromProto(req.Msg.GetSelector())), req.Msg.GetTimeoutSeconds())
	if err != nil {
		return nil, err
	}
	ok, failed := s.batchResults(rs)
	return connect.NewResponse(&nodev1.ResumeSandboxesResponse{Sandboxes: ok, Failures: failed}), nil
}
