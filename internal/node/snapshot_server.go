package node

import (
	"context"
	"net/http"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
)

// SnapshotHandler serves NodeSnapshotService (opts carry the
// authentication interceptor).
func (n *Node) SnapshotHandler(opts ...connect.HandlerOption) (string, http.Handler) {
	opts = append(opts, connect.WithInterceptors(errdefs.Interceptor()))
	return nodev1connect.NewNodeSnapshotServiceHandler(&snapshotService{n: n}, opts...)
}

type snapshotService struct{ n *Node }

var _ nodev1connect.NodeSnapshotServiceHandler = (*snapshotService)(nil)

// snapshotToProto is a snapshot in the node's message.
func (n *Node) snapshotToProto(r *snapshotRecord) *nodev1.Snapshot {
	return &nodev1.Snapshot{
		Id:              r.ID,
		Name:            r.Name,
		NodeId:          n.cfg.ID,
		SourceSandboxId: r.Source,
		Backend:         r.Backend,
		Image:           r.Image,
		ImageId:         r.ImageID,
		Spec:            specpb.ToNode(r.Spec),
		Memory:          r.Memory,
		SizeBytes:       r.SizeBytes,
		CreatedAt:       timestamppb.New(r.CreatedAt),
		Owner:           r.Owner,
		Project:         r.Project,
	}
}

func (s *snapshotService) CreateSnapshot(ctx context.Context, req *connect.Request[nodev1.CreateSnapshotRequest]) (*connect.Response[nodev1.CreateSnapshotResponse], error) {
	r, err := s.n.CreateSnapshot(ctx, req.Msg.GetSandboxId(), req.Msg.GetName())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.CreateSnapshotResponse{Snapshot: s.n.snapshotToProto(r)}), nil
}

func (s *snapshotService) GetSnapshot(ctx context.Context, req *connect.Request[nodev1.GetSnapshotRequest]) (*connect.Response[nodev1.GetSnapshotResponse], error) {
	r, err := s.n.GetSnapshot(ctx, req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.GetSnapshotResponse{Snapshot: s.n.snapshotToProto(r)}), nil
}

func (s *snapshotService) ListSnapshots(ctx context.Context, _ *connect.Request[nodev1.ListSnapshotsRequest]) (*connect.Response[nodev1.ListSnapshotsResponse], error) {
	out := &nodev1.ListSnapshotsResponse{}
	for _, r := range s.n.ListSnapshots(ctx) {
		out.Snapshots = append(out.Snapshots, s.n.snapshotToProto(r))
	}
	return connect.NewResponse(out), nil
}

func (s *snapshotService) DeleteSnapshot(ctx context.Context, req *connect.Request[nodev1.DeleteSnapshotRequest]) (*connect.Response[nodev1.DeleteSnapshotResponse], error) {
	if err := s.n.DeleteSnapshot(ctx, req.Msg.GetId()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.DeleteSnapshotResponse{}), nil
}
