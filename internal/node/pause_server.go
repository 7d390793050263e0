package node

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

var errPauseTODO = connect.NewError(connect.CodeUnimplemented, errors.New("pause is not implemented yet"))

func (s *service) PauseSandbox(ctx context.Context, req *connect.Request[nodev1.PauseSandboxRequest]) (*connect.Response[nodev1.PauseSandboxResponse], error) {
	return nil, errPauseTODO
}

func (s *service) ResumeSandbox(ctx context.Context, req *connect.Request[nodev1.ResumeSandboxRequest]) (*connect.Response[nodev1.ResumeSandboxResponse], error) {
	return nil, errPauseTODO
}

func (s *service) GetSandboxMetrics(ctx context.Context, req *connect.Request[nodev1.GetSandboxMetricsRequest]) (*connect.Response[nodev1.GetSandboxMetricsResponse], error) {
	return nil, errPauseTODO
}

func (s *service) PauseSandboxes(ctx context.Context, req *connect.Request[opendsecv1.PauseSandboxesRequest]) (*connect.Response[opendsecv1.PauseSandboxesResponse], error) {
	return nil, errPauseTODO
}

func (s *service) ResumeSandboxes(ctx context.Context, req *connect.Request[opendsecv1.ResumeSandboxesRequest]) (*connect.Response[opendsecv1.ResumeSandboxesResponse], error) {
	return nil, errPauseTODO
}
