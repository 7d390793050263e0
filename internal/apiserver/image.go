package apiserver

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/errdefs"
)

var _ opendsecv1connect.ImageServiceHandler = (*Server)(nil)

// anyImageNode picks a healthy node for an image call: every node shares
// the image store, so any one of them serves it.
func (s *Server) anyImageNode(ctx context.Context) (nodev1connect.NodeImageServiceClient, error) {
	ready, err := s.healthyNodes(ctx)
	if err != nil {
		return nil, err
	}
	if len(ready) == 0 {
		return nil, errdefs.New(errdefs.ErrUnavailable, "no healthy node to serve the image store; check `opendsecctl node list`")
	}
	return ready[rand.IntN(len(ready))].Images(), nil
}

// ImportImage forwards the import to a node and relays its progress.
func (s *Server) ImportImage(ctx context.Context, req *connect.Request[v1.ImportImageRequest], stream *connect.ServerStream[v1.ImportImageResponse]) error {
	if req.Msg.GetRef() == "" {
		return errdefs.Invalid("ref", "is empty; give a registry reference like registry.example:5000/team/app:v1")
	}
	c, err := s.anyImageNode(ctx)
	if err != nil {
		return err
	}
	if err := checkImport(ctx, c, req.Msg); err != nil {
		return err
	}
	up, err := c.ImportImage(ctx, nodeImportRequest(ctx, req.Msg))
	if err != nil {
		return remoteErr(ctx, "import image", err)
	}
	defer up.Close()
	for up.Receive() {
		if err := stream.Send(up.Msg()); err != nil {
			return err
		}
	}
	if err := up.Err(); err != nil {
		return remoteErr(ctx, "import image", err)
	}
	return nil
}

// unary forwards one unary image call to any healthy node, after check
// (when set) allows it.
func unary[Req, Resp any](ctx context.Context, s *Server, what string, req *Req, check func(nodev1connect.NodeImageServiceClient) error, call func(nodev1connect.NodeImageServiceClient, context.Context, *connect.Request[Req]) (*connect.Response[Resp], error)) (*connect.Response[Resp], error) {
	c, err := s.anyImageNode(ctx)
	if err != nil {
		return nil, err
	}
	if check != nil {
		if err := check(c); err != nil {
			return nil, err
		}
	}
	resp, err := call(c, ctx, connect.NewRequest(req))
	if err != nil {
		return nil, remoteErr(ctx, what, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

func (s *Server) ListImages(ctx context.Context, req *connect.Request[v1.ListImagesRequest]) (*connect.Response[v1.ListImagesResponse], error) {
	return unary(ctx, s, "list images", req.Msg, nil, nodev1connect.NodeImageServiceClient.ListImages)
}

func (s *Server) GetImage(ctx context.Context, req *connect.Request[v1.GetImageRequest]) (*connect.Response[v1.GetImageResponse], error) {
	if req.Msg.GetName() == "" {
		return nil, errdefs.Invalid("name", "is empty; give an image name like root/busybox")
	}
	return unary(ctx, s, "get image", req.Msg, nil, nodev1connect.NodeImageServiceClient.GetImage)
}

// TagImage needs an admin token when the target names an image already.
func (s *Server) TagImage(ctx context.Context, req *connect.Request[v1.TagImageRequest]) (*connect.Response[v1.TagImageResponse], error) {
	check := func(c nodev1connect.NodeImageServiceClient) error {
		return requireAdminToReplace(ctx, c, "target", req.Msg.GetTarget())
	}
	return unary(ctx, s, "tag image", req.Msg, check, nodev1connect.NodeImageServiceClient.TagImage)
}

// RemoveImage needs an admin token.
func (s *Server) RemoveImage(ctx context.Context, req *connect.Request[v1.RemoveImageRequest]) (*connect.Response[v1.RemoveImageResponse], error) {
	if err := requireAdmin(ctx, "removing an image"); err != nil {
		return nil, err
	}
	if req.Msg.GetName() == "" {
		return nil, errdefs.Invalid("name", "is empty; give an image name like root/busybox")
	}
	return unary(ctx, s, "remove image", req.Msg, nil, nodev1connect.NodeImageServiceClient.RemoveImage)
}

// ComposeImage needs an admin token when the name names an image already.
func (s *Server) ComposeImage(ctx context.Context, req *connect.Request[v1.ComposeImageRequest]) (*connect.Response[v1.ComposeImageResponse], error) {
	check := func(c nodev1connect.NodeImageServiceClient) error {
		return requireAdminToReplace(ctx, c, "name", req.Msg.GetName())
	}
	return unary(ctx, s, "compose image", req.Msg, check, nodev1connect.NodeImageServiceClient.ComposeImage)
}

// GarbageCollect needs an admin token.
func (s *Server) GarbageCollect(ctx context.Context, req *connect.Request[v1.GarbageCollectRequest]) (*connect.Response[v1.GarbageCollectResponse], error) {
	if err := requireAdmin(ctx, "collecting image garbage"); err != nil {
		return nil, err
	}
	return unary(ctx, s, "collect image garbage", req.Msg, nil, nodev1connect.NodeImageServiceClient.GarbageCollect)
}

// VerifyImages needs an admin token: it re-reads the whole store.
func (s *Server) VerifyImages(ctx context.Context, req *connect.Request[v1.VerifyImagesRequest]) (*connect.Response[v1.VerifyImagesResponse], error) {
	if err := requireAdmin(ctx, "verifying the image store"); err != nil {
		return nil, err
	}
	return unary(ctx, s, "verify images", req.Msg, nil, nodev1connect.NodeImageServiceClient.VerifyImages)
}

// PackDiff goes to the node that runs the sandbox: its writable layer is
// on that node's disk. It needs an admin token when the name names an
// image already.
func (s *Server) PackDiff(ctx context.Context, req *connect.Request[v1.PackDiffRequest]) (*connect.Response[v1.PackDiffResponse], error) {
	n, err := s.nodeFor(ctx, "sandbox_id", req.Msg.GetSandboxId())
	if err != nil {
		return nil, namingSandbox(err)
	}
	c := n.Images()
	if err := requireAdminToReplace(ctx, c, "name", req.Msg.GetName()); err != nil {
		return nil, err
	}
	resp, err := c.PackDiff(ctx, connect.NewRequest(req.Msg))
	if err != nil {
		return nil, namingSandbox(remoteErr(ctx, "pack sandbox", err))
	}
	return connect.NewResponse(resp.Msg), nil
}

// namingSandbox makes a not-found error name the request field.
func namingSandbox(err error) error {
	if errors.Is(err, errdefs.ErrNotFound) && !strings.Contains(err.Error(), "sandbox_id") {
		return errdefs.WithPublic(err, "sandbox_id: %s", errdefs.PublicMessage(err))
	}
	return err
}

// UploadBuildContext relays a streamed build context to a healthy node,
// which bounds it (node.build.max_context_mb) and keeps it for the build:
// the ID it answers starts with that node's ID, so BuildImage finds it.
func (s *Server) UploadBuildContext(ctx context.Context, stream *connect.ClientStream[v1.UploadBuildContextRequest]) (*connect.Response[v1.UploadBuildContextResponse], error) {
	c, err := s.anyImageNode(ctx)
	if err != nil {
		return nil, err
	}
	up := c.UploadBuildContext(ctx)
	for stream.Receive() {
		if err := up.Send(stream.Msg()); err != nil {
			break // the node refused: CloseAndReceive says why
		}
	}
	if err := stream.Err(); err != nil {
		_, _ = up.CloseAndReceive()
		return nil, err
	}
	resp, err := up.CloseAndReceive()
	if err != nil {
		return nil, remoteErr(ctx, "upload build context", err)
	}
	return connect.NewResponse(resp.Msg), nil
}

// BuildImage goes to the node that holds the build context (any healthy
// node without one) and relays its steps and output. It needs an admin
// token when the name names an image already.
func (s *Server) BuildImage(ctx context.Context, req *connect.Request[v1.BuildImageRequest], stream *connect.ServerStream[v1.BuildImageResponse]) error {
	m := req.Msg
	if strings.TrimSpace(m.GetName()) == "" {
		return errdefs.Invalid("name", "is empty; name the image to build, e.g. team/app:v1")
	}
	var c nodev1connect.NodeImageServiceClient
	if id := m.GetContextId(); id != "" {
		n, err := s.nodeFor(ctx, "context_id", id)
		if err != nil {
			return err
		}
		c = n.Images()
	} else {
		var err error
		if c, err = s.anyImageNode(ctx); err != nil {
			return err
		}
	}
	if err := requireAdminToReplace(ctx, c, "name", m.GetName()); err != nil {
		return err
	}
	up, err := c.BuildImage(ctx, connect.NewRequest(m))
	if err != nil {
		return remoteErr(ctx, "build image", err)
	}
	defer up.Close()
	for up.Receive() {
		if err := stream.Send(up.Msg()); err != nil {
			return err
		}
	}
	if err := up.Err(); err != nil {
		return remoteErr(ctx, "build image", err)
	}
	return nil
}
