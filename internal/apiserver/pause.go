package apiserver

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

var errPauseTODO = connect.NewError(connect.CodeUnimplemented, errors.New("pause is not implemented yet"))

func (s *Server) PauseSandbox(ctx context.Context, req *connect.Request[v1.PauseSandboxRequest]) (*connect.Response[v1.PauseSandboxResponse], error) {
	return nil, errPauseTODO
}

func (s *Server) ResumeSandbox(ctx context.Context, req *connect.Request[v1.ResumeSandboxRequest]) (*connect.Response[v1.ResumeSandboxResponse], error) {
	return nil, errPauseTODO
}

func (s *Server) GetSandboxMetrics(ctx context.Context, req *connect.Request[v1.GetSandboxMetricsRequest]) (*connect.Response[v1.GetSandboxMetricsResponse], error) {
	return nil, errPauseTODO
}

func (s *Server) PauseSandboxes(ctx context.Context, req *connect.Request[v1.PauseSandboxesRequest]) (*connect.Response[v1.PauseSandboxesResponse], error) {
	return nil, errPauseTODO
}

func (s *Server) ResumeSandboxes(ctx context.Context, req *connect.Request[v1.ResumeSandboxesRequest]) (*connect.Response[v1.ResumeSandboxesResponse], error) {
	return nil, errPauseTODO
}
