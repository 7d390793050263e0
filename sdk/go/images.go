package opendsec

import (
	"context"
	"strings"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// Aliases of the image API messages.
type (
	// Image is an image in the shared store: ordered layers and a config.
	Image = opendsecv1.Image
	// ImportProgress is an import's advance (totals are 0 when unknown).
	ImportProgress = opendsecv1.ImportProgress
	// ComposeLayer is one extra layer of ComposeImage: a layer digest or
	// another image's layers above what the stack already has.
	ComposeLayer = opendsecv1.ComposeLayer
	// ImageConfig overrides a base image's config in ComposeImage.
	ImageConfig = opendsecv1.ImageConfig
	// GCResult says what GarbageCollectImages removed.
	GCResult = opendsecv1.GarbageCollectResponse
	// VerifyResult says which layers VerifyImages found damaged.
	VerifyResult = opendsecv1.VerifyImagesResponse
)

// ImportOptions changes ImportImage.
type ImportOptions struct {
	// Name stores the image under this name instead of REF's repository:tag.
	Name string
	// MergeLayers merges runs of small consecutive layers into one.
	MergeLayers bool
	// Insecure allows plain HTTP to a registry that is not on loopback.
	Insecure bool
	// Progress, when set, is called with each progress report.
	Progress func(*ImportProgress)
}

// ImportImage pulls ref from an OCI or Docker registry into the shared
// image store and returns the image once it is stored.
func (c *Client) ImportImage(ctx context.Context, ref string, opts *ImportOptions) (*Image, error) {
	if strings.TrimSpace(ref) == "" {
		return nil, invalid("ref", "is empty; give a registry reference like registry.example:5000/team/app:v1")
	}
	if opts == nil {
		opts = &ImportOptions{}
	}
	st, err := c.images.ImportImage(ctx, connect.NewRequest(&opendsecv1.ImportImageRequest{
		Ref: ref, Name: opts.Name, MergeLayers: opts.MergeLayers, Insecure: opts.Insecure,
	}))
	if err != nil {
		return nil, convertError(err)
	}
	defer st.Close()
	var img *Image
	for st.Receive() {
		switch e := st.Msg().GetEvent().(type) {
		case *opendsecv1.ImportImageResponse_Progress:
			if opts.Progress != nil {
				opts.Progress(e.Progress)
			}
		case *opendsecv1.ImportImageResponse_Image:
			img = e.Image
		}
	}
	if err := st.Err(); err != nil {
		return nil, convertError(err)
	}
	if img == nil {
		return nil, &Error{Code: CodeUnavailable, Message: "import stream ended without the image; try again"}
	}
	return img, nil
}

// ListImages returns every image in the store, sorted by name.
func (c *Client) ListImages(ctx context.Context) ([]*Image, error) {
	r, err := c.images.ListImages(ctx, connect.NewRequest(&opendsecv1.ListImagesRequest{}))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg.GetImages(), nil
}

// GetImage returns the image called name ("root/busybox" means
// "root/busybox:latest").
func (c *Client) GetImage(ctx context.Context, name string) (*Image, error) {
	r, err := c.images.GetImage(ctx, connect.NewRequest(&opendsecv1.GetImageRequest{Name: name}))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg.GetImage(), nil
}

// TagImage gives the image source a second name target; no layer is copied.
func (c *Client) TagImage(ctx context.Context, source, target string) (*Image, error) {
	r, err := c.images.TagImage(ctx, connect.NewRequest(&opendsecv1.TagImageRequest{Source: source, Target: target}))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg.GetImage(), nil
}

// RemoveImage removes a name. Its layers stay until GarbageCollectImages and
// are never removed while a sandbox uses them.
func (c *Client) RemoveImage(ctx context.Context, name string) error {
	_, err := c.images.RemoveImage(ctx, connect.NewRequest(&opendsecv1.RemoveImageRequest{Name: name}))
	return convertError(err)
}

// ComposeRequest describes ComposeImage.
type ComposeRequest struct {
	// Base is the image to start from.
	Base string
	// LayerDigests are stacked on Base's layers first, in order.
	LayerDigests []string
	// Images' layers (those above what the stack already has) are stacked
	// next, in order, e.g. the top layer of an image PackDiff made.
	Images []string
	// Name of the new image.
	Name string
	// Config, when set, overrides Base's config field by field.
	Config *ImageConfig
	// MergeLayers merges runs of small consecutive layers into one.
	MergeLayers bool
}

// ComposeImage makes a new image from a base plus extra layers without
// copying any layer.
func (c *Client) ComposeImage(ctx context.Context, req ComposeRequest) (*Image, error) {
	m := &opendsecv1.ComposeImageRequest{Base: req.Base, Name: req.Name, Config: req.Config, MergeLayers: req.MergeLayers}
	for _, d := range req.LayerDigests {
		m.Layers = append(m.Layers, &ComposeLayer{Source: &opendsecv1.ComposeLayer_Digest{Digest: d}})
	}
	for _, im := range req.Images {
		m.Layers = append(m.Layers, &ComposeLayer{Source: &opendsecv1.ComposeLayer_Image{Image: im}})
	}
	r, err := c.images.ComposeImage(ctx, connect.NewRequest(m))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg.GetImage(), nil
}

// GarbageCollectImages removes layers no image name refers to and no
// sandbox (on any node) holds.
func (c *Client) GarbageCollectImages(ctx context.Context) (*GCResult, error) {
	r, err := c.images.GarbageCollect(ctx, connect.NewRequest(&opendsecv1.GarbageCollectRequest{}))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg, nil
}

// VerifyImages re-hashes every layer against its digest.
func (c *Client) VerifyImages(ctx context.Context) (*VerifyResult, error) {
	r, err := c.images.VerifyImages(ctx, connect.NewRequest(&opendsecv1.VerifyImagesRequest{}))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg, nil
}

// PackDiff saves sandbox id's changes (its writable layer, minus
// scrubPaths) as a new layer on top of its image: a new image called name
// that new sandboxes start from.
func (c *Client) PackDiff(ctx context.Context, id, name string, scrubPaths ...string) (*Image, error) {
	if id == "" {
		return nil, invalid("sandbox_id", "is empty; give a sandbox ID")
	}
	r, err := c.images.PackDiff(ctx, connect.NewRequest(&opendsecv1.PackDiffRequest{SandboxId: id, Name: name, ScrubPaths: scrubPaths}))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg.GetImage(), nil
}
