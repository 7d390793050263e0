package opendsectest

import (
	"context"
	"fmt"
	"maps"
	"regexp"
	"sort"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// snapshot is a fake snapshot: its record and the files of its source at
// the time it was taken.
type snapshot struct {
	msg   *opendsecv1.Snapshot
	files map[string][]byte
}

var snapshotNameRe = regexp.MustCompile(`^[A-Za-z0-9._-]{1,128}$`)

// snapshotService is the fake's SnapshotService: snapshots of its
// sandboxes (their files) that creates with spec.snapshot start from.
type snapshotService struct{ s *Server }

func (x snapshotService) CreateSnapshot(_ context.Context, req *connect.Request[opendsecv1.CreateSnapshotRequest]) (*connect.Response[opendsecv1.CreateSnapshotResponse], error) {
	s := x.s
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, ok := s.sandboxes[req.Msg.GetSandboxId()]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("sandbox_id: sandbox %s not found", req.Msg.GetSandboxId()))
	}
	name := req.Msg.GetName()
	if name == "" {
		name = sb.GetId() + "-" + time.Now().UTC().Format("20060102t150405.000")
	}
	if !snapshotNameRe.MatchString(name) {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("name: %q is not a snapshot name: use 1 to 128 characters of [A-Za-z0-9._-]", name))
	}
	for _, sn := range s.snapshots {
		if sn.msg.GetName() == name {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("name: you already have a snapshot named %q", name))
		}
	}
	s.seq++
	id := fmt.Sprintf("n001sn%014d", s.seq)
	msg := &opendsecv1.Snapshot{
		Id: id, Name: name, NodeId: "n001", SourceSandboxId: sb.GetId(), Backend: sb.GetSpec().GetBackend(),
		Image: "snapshot/" + id, Spec: proto.Clone(sb.GetSpec()).(*opendsecv1.SandboxSpec), CreatedAt: timestamppb.Now(),
	}
	files := map[string][]byte{}
	for p, b := range s.files[sb.GetId()] {
		files[p] = append([]byte(nil), b...)
		msg.SizeBytes += int64(len(b))
	}
	s.snapshots[id] = &snapshot{msg: msg, files: files}
	return connect.NewResponse(&opendsecv1.CreateSnapshotResponse{Snapshot: proto.Clone(msg).(*opendsecv1.Snapshot)}), nil
}

func (x snapshotService) GetSnapshot(_ context.Context, req *connect.Request[opendsecv1.GetSnapshotRequest]) (*connect.Response[opendsecv1.GetSnapshotResponse], error) {
	s := x.s
	s.mu.Lock()
	defer s.mu.Unlock()
	sn, ok := s.snapshots[req.Msg.GetId()]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("id: snapshot %s not found", req.Msg.GetId()))
	}
	return connect.NewResponse(&opendsecv1.GetSnapshotResponse{Snapshot: proto.Clone(sn.msg).(*opendsecv1.Snapshot)}), nil
}

func (x snapshotService) ListSnapshots(context.Context, *connect.Request[opendsecv1.ListSnapshotsRequest]) (*connect.Response[opendsecv1.ListSnapshotsResponse], error) {
	s := x.s
	s.mu.Lock()
	defer s.mu.Unlock()
	out := &opendsecv1.ListSnapshotsResponse{}
	for _, sn := range s.snapshots {
		out.Snapshots = append(out.Snapshots, proto.Clone(sn.msg).(*opendsecv1.Snapshot))
	}
	sort.Slice(out.Snapshots, func(i, j int) bool { return out.Snapshots[i].GetId() < out.Snapshots[j].GetId() })
	return connect.NewResponse(out), nil
}

func (x snapshotService) DeleteSnapshot(_ context.Context, req *connect.Request[opendsecv1.DeleteSnapshotRequest]) (*connect.Response[opendsecv1.DeleteSnapshotResponse], error) {
	s := x.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.snapshots[req.Msg.GetId()]; !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("id: snapshot %s not found", req.Msg.GetId()))
	}
	delete(s.snapshots, req.Msg.GetId())
	return connect.NewResponse(&opendsecv1.DeleteSnapshotResponse{}), nil
}

// fromSnapshot resolves a spec naming a snapshot: the snapshot's image and
// its source's spec under the caller's fields (a simplification of the
// real rules: cpu, memory, env, labels, user, workdir), and the files the
// new sandbox starts with. A spec without a snapshot comes back as is.
func (s *Server) fromSnapshot(spec *opendsecv1.SandboxSpec) (*opendsecv1.SandboxSpec, map[string][]byte, error) {
	if spec.GetSnapshot() == "" {
		return spec, nil, nil
	}
	if spec.GetImage() != "" {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("snapshot: is set together with image %q; give either image or snapshot, not both", spec.GetImage()))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sn, ok := s.snapshots[spec.GetSnapshot()]
	if !ok {
		return nil, nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("snapshot: snapshot %s not found", spec.GetSnapshot()))
	}
	out := proto.Clone(spec).(*opendsecv1.SandboxSpec)
	src := sn.msg.GetSpec()
	out.Image = sn.msg.GetImage()
	if out.Cpu == 0 {
		out.Cpu = src.GetCpu()
	}
	if out.MemoryMb == nil && src.MemoryMb != nil {
		out.MemoryMb = proto.Int64(src.GetMemoryMb())
	}
	if out.User == "" {
		out.User = src.GetUser()
	}
	if out.Workdir == "" {
		out.Workdir = src.GetWorkdir()
	}
	env, labels := maps.Clone(src.GetEnv()), maps.Clone(src.GetLabels())
	if env == nil {
		env = map[string]string{}
	}
	if labels == nil {
		labels = map[string]string{}
	}
	maps.Copy(env, out.GetEnv())
	maps.Copy(labels, out.GetLabels())
	out.Env, out.Labels = env, labels
	return out, sn.files, nil
}
