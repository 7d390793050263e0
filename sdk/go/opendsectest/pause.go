package opendsectest

import (
	"context"
	"fmt"
	"slices"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

const (
	running = opendsecv1.SandboxState_SANDBOX_STATE_RUNNING
	paused  = opendsecv1.SandboxState_SANDBOX_STATE_PAUSED
)

// setState moves a sandbox to st (idempotent) and returns a copy.
func (s *Server) setState(id string, st opendsecv1.SandboxState) (*opendsecv1.Sandbox, error) {
	sb, err := s.sandbox(id)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sb.State = st
	if st == running {
		sb.PausedFilesystem = false
	}
	return proto.Clone(sb).(*opendsecv1.Sandbox), nil
}

// setFilesystemPaused marks a paused sandbox paused keeping only its files.
func (s *Server) setFilesystemPaused(id string) (*opendsecv1.Sandbox, error) {
	sb, err := s.sandbox(id)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sb.PausedFilesystem = true
	return proto.Clone(sb).(*opendsecv1.Sandbox), nil
}

// fakeReclaimBytes is what a PauseSandbox with reclaim reports freed.
const fakeReclaimBytes = 1<<20 - 64<<10

func (h sandboxService) PauseSandbox(ctx context.Context, req *connect.Request[opendsecv1.PauseSandboxRequest]) (*connect.Response[opendsecv1.PauseSandboxResponse], error) {
	sb, err := h.s.setState(req.Msg.GetId(), paused)
	if err != nil {
		return nil, err
	}
	if req.Msg.GetFilesystemOnly() {
		if sb, err = h.s.setFilesystemPaused(req.Msg.GetId()); err != nil {
			return nil, err
		}
	}
	var freed int64
	if req.Msg.GetReclaim() {
		freed = fakeReclaimBytes
	}
	return connect.NewResponse(&opendsecv1.PauseSandboxResponse{Sandbox: sb, BytesFreed: freed}), nil
}

func (h sandboxService) ResumeSandbox(ctx context.Context, req *connect.Request[opendsecv1.ResumeSandboxRequest]) (*connect.Response[opendsecv1.ResumeSandboxResponse], error) {
	sb, err := h.s.setState(req.Msg.GetId(), running)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&opendsecv1.ResumeSandboxResponse{Sandbox: sb}), nil
}

// GetSandboxMetrics answers fixed numbers: 1 core, 10% used, 1 MiB of 512.
func (h sandboxService) GetSandboxMetrics(ctx context.Context, req *connect.Request[opendsecv1.GetSandboxMetricsRequest]) (*connect.Response[opendsecv1.GetSandboxMetricsResponse], error) {
	sb, err := h.s.sandbox(req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	h.s.mu.Lock()
	st := sb.GetState()
	h.s.mu.Unlock()
	return connect.NewResponse(&opendsecv1.GetSandboxMetricsResponse{Metrics: &opendsecv1.SandboxMetrics{
		Timestamp: timestamppb.Now(), CpuCount: 1, CpuUsedPct: 10, MemUsedBytes: 1 << 20, MemTotalBytes: 512 << 20,
		Pids: 1, PidsLimit: 1024, State: st,
	}}), nil
}

func (s *Server) matching(sel *opendsecv1.SandboxSelector) []string {
	var ids []string
	for _, sb := range s.Sandboxes() {
		spec := sb.GetSpec()
		if t := sel.GetTaskId(); t != "" && spec.GetTaskId() != t {
			continue
		}
		if len(sel.GetIds()) > 0 && !slices.Contains(sel.GetIds(), sb.GetId()) {
			continue
		}
		ok := true
		for k, v := range sel.GetLabels() {
			if got, has := spec.GetLabels()[k]; !has || got != v {
				ok = false
			}
		}
		if ok {
			ids = append(ids, sb.GetId())
		}
	}
	return ids
}

func (h sandboxService) PauseSandboxes(ctx context.Context, req *connect.Request[opendsecv1.PauseSandboxesRequest]) (*connect.Response[opendsecv1.PauseSandboxesResponse], error) {
	out := &opendsecv1.PauseSandboxesResponse{}
	ids := h.s.matching(req.Msg.GetSelector())
	if sel := req.Msg.GetSelector(); len(ids) == 0 && len(sel.GetIds()) == 0 && sel.GetTaskId() != "" {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("no running or paused sandboxes of task %s (selector.task_id)", sel.GetTaskId()))
	}
	for _, id := range ids {
		if sb, err := h.s.setState(id, paused); err == nil {
			out.Sandboxes = append(out.Sandboxes, sb)
			if req.Msg.GetReclaim() {
				// As a node with swap: the fake's 1 MiB goes but 64 KiB.
				out.Reclaimed = append(out.Reclaimed, &opendsecv1.SandboxReclaim{SandboxId: id, BytesBefore: 1 << 20, BytesAfter: 64 << 10, BytesFreed: 1<<20 - 64<<10})
				out.BytesFreed += 1<<20 - 64<<10
			}
		}
	}
	return connect.NewResponse(out), nil
}

func (h sandboxService) ResumeSandboxes(ctx context.Context, req *connect.Request[opendsecv1.ResumeSandboxesRequest]) (*connect.Response[opendsecv1.ResumeSandboxesResponse], error) {
	out := &opendsecv1.ResumeSandboxesResponse{}
	for _, id := range h.s.matching(req.Msg.GetSelector()) {
		if sb, err := h.s.setState(id, running); err == nil {
			out.Sandboxes = append(out.Sandboxes, sb)
		}
	}
	return connect.NewResponse(out), nil
}
