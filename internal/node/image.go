package node

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// ImageHandler serves NodeImageService over the node's image store (the
// Config.Images of an *image.Store; every call is unimplemented with any
// other resolver). opts carry the authentication interceptor.
func (n *Node) ImageHandler(opts ...connect.HandlerOption) (string, http.Handler) {
	store, _ := n.cfg.Images.(*image.Store)
	opts = append(opts, connect.WithInterceptors(errdefs.Interceptor()))
	return nodev1connect.NewNodeImageServiceHandler(&imageService{n: n, store: store}, opts...)
}

type imageService struct {
	n     *Node
	store *image.Store // nil when the node's images are not an *image.Store
}

// errNoStore answers every call of a node without an image store.
var errNoStore = errdefs.New(errdefs.ErrUnimplemented, "this node has no image store to manage")

var _ nodev1connect.NodeImageServiceHandler = (*imageService)(nil)

// importProgressEvery throttles progress messages of ImportImage.
const importProgressEvery = 200 * time.Millisecond

func (s *imageService) ImportImage(ctx context.Context, req *connect.Request[opendsecv1.ImportImageRequest], stream *connect.ServerStream[opendsecv1.ImportImageResponse]) error {
	if s.store == nil {
		return errNoStore
	}
	m := req.Msg
	if m.GetRef() == "" {
		return errdefs.Invalid("ref", "is empty; give a registry reference like registry.example:5000/team/app:v1")
	}
	if err := notSnapshotName("name", m.GetName()); err != nil {
		return err
	}
	opts := []image.ImportOption{}
	if m.GetName() != "" {
		opts = append(opts, image.WithName(m.GetName()))
	}
	if m.GetMergeLayers() {
		opts = append(opts, image.WithMergeLayers())
	}
	if m.GetInsecure() {
		opts = append(opts, image.WithInsecure())
	}
	if callerIsAdmin(ctx) {
		opts = append(opts, image.WithInternalRegistry())
	}
	var last time.Time
	var sendErr error
	opts = append(opts, image.WithProgress(func(p image.Progress) {
		if sendErr != nil || (!p.Done && time.Since(last) < importProgressEvery) {
			return
		}
		last = time.Now()
		sendErr = stream.Send(&opendsecv1.ImportImageResponse{Event: &opendsecv1.ImportImageResponse_Progress{Progress: &opendsecv1.ImportProgress{
			Files: p.Files, Bytes: p.Bytes, TotalFiles: p.TotalFiles, TotalBytes: p.TotalBytes,
		}}})
	}))
	img, err := s.store.Import(ctx, m.GetRef(), opts...)
	if err != nil {
		return err
	}
	if sendErr != nil {
		return sendErr
	}
	return stream.Send(&opendsecv1.ImportImageResponse{Event: &opendsecv1.ImportImageResponse_Image{Image: ImageToProto(img)}})
}

func (s *imageService) ListImages(ctx context.Context, _ *connect.Request[opendsecv1.ListImagesRequest]) (*connect.Response[opendsecv1.ListImagesResponse], error) {
	if s.store == nil {
		return nil, errNoStore
	}
	imgs, err := s.store.List(ctx)
	if err != nil {
		return nil, err
	}
	out := &opendsecv1.ListImagesResponse{}
	admin := callerIsAdmin(ctx)
	for _, im := range imgs {
		// Snapshots' images are listed as snapshots, to their owners;
		// admins see them here too (snapshot/<id>).
		if !admin && strings.HasPrefix(im.Name, sandboxspec.SnapshotImagePrefix) {
			continue
		}
		out.Images = append(out.Images, ImageToProto(im))
	}
	return connect.NewResponse(out), nil
}

func (s *imageService) GetImage(ctx context.Context, req *connect.Request[opendsecv1.GetImageRequest]) (*connect.Response[opendsecv1.GetImageResponse], error) {
	if s.store == nil {
		return nil, errNoStore
	}
	img, err := s.store.Inspect(ctx, req.Msg.GetName())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&opendsecv1.GetImageResponse{Image: ImageToProto(img)}), nil
}

func (s *imageService) TagImage(ctx context.Context, req *connect.Request[opendsecv1.TagImageRequest]) (*connect.Response[opendsecv1.TagImageResponse], error) {
	if s.store == nil {
		return nil, errNoStore
	}
	if err := notSnapshotName("target", req.Msg.GetTarget()); err != nil {
		return nil, err
	}
	img, err := s.store.Tag(ctx, req.Msg.GetSource(), req.Msg.GetTarget())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&opendsecv1.TagImageResponse{Image: ImageToProto(img)}), nil
}

func (s *imageService) RemoveImage(ctx context.Context, req *connect.Request[opendsecv1.RemoveImageRequest]) (*connect.Response[opendsecv1.RemoveImageResponse], error) {
	if s.store == nil {
		return nil, errNoStore
	}
	if err := s.store.Remove(ctx, req.Msg.GetName()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&opendsecv1.RemoveImageResponse{}), nil
}

func (s *imageService) ComposeImage(ctx context.Context, req *connect.Request[opendsecv1.ComposeImageRequest]) (*connect.Response[opendsecv1.ComposeImageResponse], error) {
	if s.store == nil {
		return nil, errNoStore
	}
	m := req.Msg
	if err := notSnapshotName("name", m.GetName()); err != nil {
		return nil, err
	}
	cr := image.ComposeRequest{Base: m.GetBase(), Name: m.GetName(), MergeLayers: m.GetMergeLayers()}
	for _, l := range m.GetLayers() {
		cr.Layers = append(cr.Layers, image.ComposeLayer{Digest: l.GetDigest(), Image: l.GetImage()})
	}
	if c := m.GetConfig(); c != nil {
		cfg := configFromProto(c)
		cr.Config = &cfg
	}
	img, err := s.store.Compose(ctx, cr)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&opendsecv1.ComposeImageResponse{Image: ImageToProto(img)}), nil
}

func (s *imageService) GarbageCollect(ctx context.Context, _ *connect.Request[opendsecv1.GarbageCollectRequest]) (*connect.Response[opendsecv1.GarbageCollectResponse], error) {
	if s.store == nil {
		return nil, errNoStore
	}
	res, err := s.store.GC(ctx)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&opendsecv1.GarbageCollectResponse{RemovedLayers: res.Removed, RemovedBytes: res.Bytes}), nil
}

func (s *imageService) VerifyImages(ctx context.Context, _ *connect.Request[opendsecv1.VerifyImagesRequest]) (*connect.Response[opendsecv1.VerifyImagesResponse], error) {
	if s.store == nil {
		return nil, errNoStore
	}
	res, err := s.store.Verify(ctx)
	if err != nil {
		return nil, err
	}
	out := &opendsecv1.VerifyImagesResponse{Checked: int32(res.Checked)}
	for _, c := range res.Corrupt {
		out.Corrupt = append(out.Corrupt, &opendsecv1.CorruptLayer{Digest: c.Digest, Reason: c.Reason})
	}
	return connect.NewResponse(out), nil
}

func (s *imageService) PackDiff(ctx context.Context, req *connect.Request[opendsecv1.PackDiffRequest]) (*connect.Response[opendsecv1.PackDiffResponse], error) {
	if s.store == nil {
		return nil, errNoStore
	}
	if err := notSnapshotName("name", req.Msg.GetName()); err != nil {
		return nil, err
	}
	if id := req.Msg.GetSandboxId(); id != "" {
		if err := s.n.checkOwner(ctx, id); err != nil {
			return nil, err
		}
	}
	img, err := s.n.PackDiff(ctx, s.store, req.Msg.GetSandboxId(), req.Msg.GetName(), req.Msg.GetScrubPaths())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&opendsecv1.PackDiffResponse{Image: ImageToProto(img)}), nil
}

// PackDiff saves the writable layer of sandbox id (running, or stopped but
// not yet deleted) as a new layer on top of its image: a new image called
// name in store. scrubPaths are left out of the new layer. A running
// sandbox is frozen meanwhile, so shutdown waits for a PackDiff in flight
// (up to its deadline; a node that dies before the thaw thaws it at the
// next start).
func (n *Node) PackDiff(ctx context.Context, store *image.Store, id, name string, scrubPaths []string) (image.Image, error) {
	end, err := n.begin("pack diff of sandbox " + id)
	if err != nil {
		return image.Image{}, err
	}
	defer end()
	return n.packDiff(ctx, store, id, name, scrubPaths)
}

// packDiff is PackDiff inside an admitted operation (snapshots use it too).
func (n *Node) packDiff(ctx context.Context, store snapshotImages, id, name string, scrubPaths []string) (image.Image, error) {
	if id == "" {
		return image.Image{}, errdefs.Invalid("sandbox_id", "is empty; give a sandbox ID (list them with `opendsecctl sandbox list`)")
	}
	if _, err := image.NormalizeName(name); err != nil {
		msg := err.Error()
		if fe := (*errdefs.FieldError)(nil); errors.As(err, &fe) {
			msg = fe.Msg
		}
		return image.Image{}, errdefs.Invalid("name", "%s", msg)
	}
	rec, _, err := n.Get(ctx, id)
	if err != nil {
		return image.Image{}, err
	}
	if sb, err := n.get(id); err == nil {
		if err := waitStarted(ctx, sb); err != nil {
			return image.Image{}, err
		}
	}
	if rec.State == "creating" {
		return image.Image{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is still being created; pack it once it runs", id)
	}
	be, ok := n.cfg.Backends[rec.Backend]
	if !ok {
		return image.Image{}, errdefs.New(errdefs.ErrInternal, "sandbox %s: backend %q is not configured on this node", id, rec.Backend)
	}
	d, ok := be.(runtime.RootfsDiffer)
	if !ok {
		return image.Image{}, errdefs.New(errdefs.ErrUnimplemented, "the %s backend cannot pack a sandbox's changes into an image", rec.Backend)
	}
	var img image.Image
	err = d.DiffRootfs(ctx, id, func(ctx context.Context, diff runtime.RootfsDiff) error {
		if diff.Format != runtime.DiffOverlayDir {
			return errdefs.New(errdefs.ErrUnimplemented, "the %s backend hands out its changes as %q, which pack_diff cannot read yet", rec.Backend, diff.Format)
		}
		var err error
		img, err = store.PackDiff(ctx, image.PackDiffRequest{Holder: id, Upper: diff.Dir, Name: name, ScrubPaths: scrubPaths})
		return err
	})
	return img, err
}

// notSnapshotName refuses an image name in the snapshots' namespace
// (snapshot/...): only the node's snapshots write there.
func notSnapshotName(field, name string) error {
	if strings.HasPrefix(strings.TrimSpace(name), sandboxspec.SnapshotImagePrefix) {
		return errdefs.Invalid(field, "%q: names under %s are reserved for snapshots; pick another name, or take a snapshot with `opendsecctl sandbox snapshot`", name, sandboxspec.SnapshotImagePrefix)
	}
	return nil
}

// ImageToProto converts an image for the API.
func ImageToProto(im image.Image) *opendsecv1.Image {
	out := &opendsecv1.Image{
		Name:   im.Name,
		Id:     im.ID,
		Size:   im.Size,
		Source: im.Source,
		Config: &opendsecv1.ImageConfig{
			Env: im.Config.Env, Workdir: im.Config.Workdir, User: im.Config.User,
			Entrypoint: im.Config.Entrypoint, Cmd: im.Config.Cmd, Labels: im.Config.Labels,
			StartCmd: im.Config.StartCmd, ReadyCmd: im.Config.ReadyCmd, ExposedPorts: im.Config.ExposedPorts,
		},
	}
	if !im.Created.IsZero() {
		out.Created = timestamppb.New(im.Created)
	}
	for _, l := range im.Layers {
		out.Layers = append(out.Layers, &opendsecv1.ImageLayer{Digest: l.Digest, Size: l.Size})
	}
	return out
}

func configFromProto(c *opendsecv1.ImageConfig) image.Config {
	return image.Config{
		Env: c.GetEnv(), Workdir: c.GetWorkdir(), User: c.GetUser(),
		Entrypoint: c.GetEntrypoint(), Cmd: c.GetCmd(), Labels: c.GetLabels(),
		StartCmd: c.GetStartCmd(), ReadyCmd: c.GetReadyCmd(), ExposedPorts: c.GetExposedPorts(),
	}
}

// callerIsAdmin reports whether the import was asked for by an admin: the
// node was called with an admin token, or by a component on behalf of a
// caller whose forwarded, signed token (auth.OnBehalfHeader, verified with
// the public key) is an admin's. A component on its own behalf is not an
// admin; without verified claims (a node served without authentication)
// nobody is. The node's own DNS answer for the registry never decides this.
func callerIsAdmin(ctx context.Context) bool {
	c, ok := auth.FromContext(ctx)
	return ok && c.Scope == auth.ScopeAdmin
}
