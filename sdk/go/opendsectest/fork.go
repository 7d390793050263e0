package opendsectest

import (
	"context"
	"fmt"
	"maps"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// ForkSandbox makes count copies of a running or paused sandbox with its
// files (memory_preserved false, like containers); idempotent on
// request_id.
func (h sandboxService) ForkSandbox(ctx context.Context, req *connect.Request[opendsecv1.ForkSandboxRequest]) (*connect.Response[opendsecv1.ForkSandboxResponse], error) {
	m := req.Msg
	if m.GetCount() < 1 || m.GetCount() > 64 {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("count: is %d; give 1..64 forks", m.GetCount()))
	}
	if m.GetTargetNode() != "" {
		return nil, connect.NewError(connect.CodeUnimplemented, fmt.Errorf("fork to another node is not supported yet; leave target_node empty"))
	}
	src, err := h.s.sandbox(m.GetSandboxId())
	if err != nil {
		return nil, err
	}
	s := h.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if st := src.GetState(); st != running && st != paused {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("sandbox_id: sandbox %s is %s; only a running or paused sandbox can be forked", src.GetId(), st))
	}
	resp := &opendsecv1.ForkSandboxResponse{SourceFrozenUs: 1000}
	for i := range int(m.GetCount()) {
		rid := ""
		if m.GetRequestId() != "" {
			rid = fmt.Sprintf("%s/fork-%d", m.GetRequestId(), i)
			if id, ok := s.byRequest[rid]; ok {
				if sb, ok := s.sandboxes[id]; ok {
					resp.Forks = append(resp.Forks, &opendsecv1.ForkResult{Sandbox: proto.Clone(sb).(*opendsecv1.Sandbox)})
					continue
				}
			}
		}
		s.seq++
		now := time.Now()
		sb := proto.Clone(src).(*opendsecv1.Sandbox)
		sb.Id = fmt.Sprintf("n001sb%04d", s.seq)
		sb.State, sb.ParentId, sb.FromWarmPool = running, src.GetId(), false
		sb.CreatedAt = timestamppb.New(now)
		timeout := sb.GetSpec().GetTimeoutSeconds()
		if t := m.GetTimeoutSeconds(); t > 0 {
			timeout = t
			sb.Spec.TimeoutSeconds = t
		}
		if timeout == 0 {
			timeout = 300
		}
		sb.ExpiresAt = timestamppb.New(now.Add(time.Duration(timeout) * time.Second))
		s.sandboxes[sb.Id] = sb
		if rid != "" {
			s.byRequest[rid] = sb.Id
		}
		s.files[sb.Id] = maps.Clone(s.files[src.GetId()])
		s.dirs[sb.Id] = maps.Clone(s.dirs[src.GetId()])
		resp.Forks = append(resp.Forks, &opendsecv1.ForkResult{Sandbox: proto.Clone(sb).(*opendsecv1.Sandbox)})
	}
	return connect.NewResponse(resp), nil
}
