package apiserver

import (
	"context"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// ForkSandbox asks the source's node for count new sandboxes from it (the
// forks live on the source's node). The node checks that the caller owns
// the source (another principal's sandbox is not_found) and makes all of
// them or none.
func (s *Server) ForkSandbox(ctx context.Context, req *connect.Request[v1.ForkSandboxRequest]) (*connect.Response[v1.ForkSandboxResponse], error) {
	m := req.Msg
	if c := m.GetCount(); c < 1 || c > sandboxspec.MaxForkCount {
		return nil, errdefs.Invalid("count", "is %d; give 1..%d forks", c, sandboxspec.MaxForkCount)
	}
	if err := sandboxspec.CheckRequestID("request_id", m.GetRequestId(), sandboxspec.MaxRequestIDLen); err != nil {
		return nil, err
	}
	if t := m.GetTimeoutSeconds(); t < 0 || t > sandboxspec.MaxTimeoutSec {
		return nil, errdefs.Invalid("timeout_seconds", "is %d; give 1..%d seconds, or 0 for the source's lifetime", t, sandboxspec.MaxTimeoutSec)
	}
	n, err := s.nodeFor(ctx, "sandbox_id", m.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if t := m.GetTargetNode(); t != "" && t != n.ID() {
		return nil, errdefs.New(errdefs.ErrUnimplemented, "fork to another node is not supported yet; leave target_node empty")
	}
	resp, err := n.Node().ForkSandbox(ctx, connect.NewRequest(nodeForkRequest(m)))
	if err != nil {
		return nil, remoteErr(ctx, "fork sandbox", err)
	}
	return connect.NewResponse(publicForks(resp.Msg)), nil
}
