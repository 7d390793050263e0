package apiserver

import (
	"context"
	"errors"
	"slices"
	"sync"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
)

var _ opendsecv1connect.SnapshotServiceHandler = (*Server)(nil)

// Snapshots: the record is on the node that ran the source (its ID starts
// with that node's), so a create goes to the source sandbox's node, get
// and delete to the node in the snapshot ID, and a list to every node.
// The node checks ownership on every call.

// CreateSnapshot asks the source sandbox's node to save it.
func (s *Server) CreateSnapshot(ctx context.Context, req *connect.Request[v1.CreateSnapshotRequest]) (*connect.Response[v1.CreateSnapshotResponse], error) {
	if name := req.Msg.GetName(); name != "" {
		if err := sandboxspec.CheckSnapshotName("name", name); err != nil {
			return nil, err
		}
	}
	n, err := s.nodeFor(ctx, "sandbox_id", req.Msg.GetSandboxId())
	if err != nil {
		return nil, namingSandbox(err)
	}
	resp, err := n.Snapshots().CreateSnapshot(ctx, connect.NewRequest(nodeCreateSnapshotRequest(req.Msg)))
	if err != nil {
		return nil, namingSandbox(remoteErr(ctx, "snapshot sandbox", err))
	}
	return connect.NewResponse(&v1.CreateSnapshotResponse{Snapshot: publicSnapshot(resp.Msg.GetSnapshot())}), nil
}

// getSnapshot asks the node in the snapshot's ID; field names the request
// field in errors.
func (s *Server) getSnapshot(ctx context.Context, field, id string) (*nodev1.Snapshot, error) {
	n, err := s.nodes.ForSnapshot(ctx, field, id)
	if err != nil {
		return nil, err
	}
	resp, err := n.Snapshots().GetSnapshot(ctx, connect.NewRequest(&nodev1.GetSnapshotRequest{Id: id}))
	if err != nil {
		err = remoteErr(ctx, "get snapshot", err)
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, errdefs.New(errdefs.ErrNotFound, "%s: snapshot %s not found (list yours with `opendsecctl snapshot list`)", field, id)
		}
		return nil, err
	}
	return resp.Msg.GetSnapshot(), nil
}

// GetSnapshot returns one of the caller's snapshots.
func (s *Server) GetSnapshot(ctx context.Context, req *connect.Request[v1.GetSnapshotRequest]) (*connect.Response[v1.GetSnapshotResponse], error) {
	snap, err := s.getSnapshot(ctx, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.GetSnapshotResponse{Snapshot: publicSnapshot(snap)}), nil
}

// DeleteSnapshot removes one of the caller's snapshots.
func (s *Server) DeleteSnapshot(ctx context.Context, req *connect.Request[v1.DeleteSnapshotRequest]) (*connect.Response[v1.DeleteSnapshotResponse], error) {
	n, err := s.nodes.ForSnapshot(ctx, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	if _, err := n.Snapshots().DeleteSnapshot(ctx, connect.NewRequest(&nodev1.DeleteSnapshotRequest{Id: req.Msg.GetId()})); err != nil {
		return nil, remoteErr(ctx, "delete snapshot", err)
	}
	return connect.NewResponse(&v1.DeleteSnapshotResponse{}), nil
}

// ListSnapshots asks every healthy node for the caller's snapshots and
// merges them, oldest first. A node that fails to answer is left out (and
// logged), as in ListSandboxes.
func (s *Server) ListSnapshots(ctx context.Context, _ *connect.Request[v1.ListSnapshotsRequest]) (*connect.Response[v1.ListSnapshotsResponse], error) {
	nodes, err := s.healthyNodes(ctx)
	if err != nil {
		return nil, err
	}
	var (
		mu  sync.Mutex
		out []*v1.Snapshot
	)
	onEach(nodes, func(n liveNode) {
		resp, err := n.Snapshots().ListSnapshots(ctx, connect.NewRequest(&nodev1.ListSnapshotsRequest{}))
		if err != nil {
			log.G(ctx).Warn("list snapshots on node", log.NodeID(n.ID()), log.Err(err))
			return
		}
		mu.Lock()
		defer mu.Unlock()
		for _, sn := range resp.Msg.GetSnapshots() {
			out = append(out, publicSnapshot(sn))
		}
	})
	slices.SortFunc(out, byCreated)
	return connect.NewResponse(&v1.ListSnapshotsResponse{Snapshots: out}), nil
}

// pinKey carries the node a create must be placed on (a snapshot only
// that node can restore) from resolveSnapshot to candidates.
type pinKey struct{}

// pinnedNode is the node a create in ctx must go to, if any.
func pinnedNode(ctx context.Context) string {
	id, _ := ctx.Value(pinKey{}).(string)
	return id
}

// resolveSnapshot turns a caller's spec naming a snapshot into one naming
// its image, with the snapshot's spec as the defaults of every unset field
// (sandboxspec.FromSnapshot), after the snapshot's node says the caller
// owns it (else not_found naming snapshot). A spec without a snapshot
// comes back unchanged. The returned context pins the placement to the
// snapshot's node when only that node can restore it (a backend
// snapshot: memory).
func (s *Server) resolveSnapshot(ctx context.Context, spec *v1.SandboxSpec) (context.Context, *v1.SandboxSpec, error) {
	if spec.GetSnapshot() == "" {
		return ctx, spec, nil
	}
	if spec.GetImage() != "" {
		return ctx, nil, sandboxspec.BothImageAndSnapshot(spec.GetImage())
	}
	snap, err := s.getSnapshot(ctx, "snapshot", spec.GetSnapshot())
	if err != nil {
		return ctx, nil, err
	}
	in, err := specpb.FromProto(spec)
	if err != nil {
		return ctx, nil, err
	}
	src, err := specpb.FromNode(snap.GetSpec())
	if err != nil {
		return ctx, nil, err
	}
	out, err := sandboxspec.FromSnapshot(in, src)
	if err != nil {
		return ctx, nil, err
	}
	if snap.GetMemory() || snap.GetImage() == "" {
		ctx = context.WithValue(ctx, pinKey{}, snap.GetNodeId())
	}
	return ctx, specpb.ToProto(out), nil
}
