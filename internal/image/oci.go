package image

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/klauspost/compress/zstd"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// WithName stores a registry import under name instead of the name derived
// from the reference ("reg.example:5000/team/app:v1" -> "team/app:v1").
func WithName(name string) ImportOption {
	return func(o *importOptions) { o.name = name }
}

// WithRemoteOptions adds go-containerregistry options to a registry import
// (a transport, other credentials). By default credentials come from the
// Docker config (~/.docker/config.json) and credential helpers.
func WithRemoteOptions(opts ...remote.Option) ImportOption {
	return func(o *importOptions) { o.remote = append(o.remote, opts...) }
}

// Platform is what a registry import picks from a multi-arch index.
var Platform = v1.Platform{OS: "linux", Architecture: "amd64"}

// NameFromRef is the store name a registry reference is imported as by
// default: its repository path without the registry (and without Docker
// Hub's "library/"), with its tag, or "sha256-<12 hex>" for a digest.
func NameFromRef(ref string) (string, error) {
	r, err := name.ParseReference(ref)
	if err != nil {
		return "", errdefs.Invalid("ref", "%q is not an image reference: %v; use REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]", ref, err)
	}
	repo := strings.TrimPrefix(r.Context().RepositoryStr(), "library/")
	switch v := r.(type) {
	case name.Tag:
		return NormalizeName(repo + ":" + v.TagStr())
	case name.Digest:
		h := strings.TrimPrefix(v.DigestStr(), "sha256:")
		if len(h) > 12 {
			h = h[:12]
		}
		return NormalizeName(repo + ":sha256-" + h)
	}
	return NormalizeName(repo)
}

// Import pulls the image ref from an OCI or Docker registry (linux/amd64
// from a multi-arch index), or reads it from a local archive
// ("oci-layout:PATH[:TAG|@DIGEST]", "docker-archive:PATH[:REF]"), and
// stores it as a layered image. Layers already
// in the store are not fetched again. Each layer is verified against its
// digest and its diff_id; tar entries that could escape the layer are
// refused; device files are skipped; whiteouts become OverlayFS whiteouts.
// On any error the store is unchanged.
func (s *Store) Import(ctx context.Context, ref string, opts ...ImportOption) (Image, error) {
	var o importOptions
	for _, opt := range opts {
		opt(&o)
	}
	if isArchiveRef(ref) { // oci-layout: and docker-archive: (archive.go)
		return s.importArchive(ctx, ref, o)
	}
	var nopts []name.Option
	if o.insecure {
		nopts = append(nopts, name.Insecure)
	}
	r, err := name.ParseReference(ref, nopts...)
	if err != nil {
		return Image{}, errdefs.Invalid("ref", "%q is not an image reference: %v; use REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]", ref, err)
	}
	storeName := o.name
	if storeName == "" {
		if storeName, err = NameFromRef(ref); err != nil {
			return Image{}, err
		}
	}
	if storeName, err = NormalizeName(storeName); err != nil {
		return Image{}, err
	}
	start := time.Now()
	ropts := []remote.Option{
		remote.WithContext(ctx),
		remote.WithPlatform(Platform),
		remote.WithAuthFromKeychain(authn.DefaultKeychain),
	}
	if guardRegistry(o.internalRegistry) {
		ropts = append(ropts, remote.WithTransport(publicOnlyTransport()))
	}
	ropts = append(ropts, o.remote...)
	img, err := remote.Image(r, ropts...)
	if err != nil {
		return Image{}, registryError(ctx, r, err)
	}
	digest, err := img.Digest()
	if err != nil {
		return Image{}, registryError(ctx, r, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return Image{}, registryError(ctx, r, err)
	}
	rls, err := img.Layers()
	if err != nil {
		return Image{}, registryError(ctx, r, err)
	}
	layers := make([]importLayer, len(rls))
	for i, l := range rls {
		layers[i] = importLayer{Layer: l, open: l.Compressed}
		if i < len(cf.RootFS.DiffIDs) {
			layers[i].diffID = cf.RootFS.DiffIDs[i].String()
		}
		if n, err := l.Size(); err == nil {
			layers[i].size = n
		}
	}
	source := r.Context().Name() + "@" + digest.String()
	return s.importLayers(ctx, ref, storeName, source, "image", start, cf, layers, o, func(_ importLayer, err error) error {
		return registryError(ctx, r, err)
	})
}

// importLayers checks an image's platform and config, stores the layers
// the store lacks and commits the image as name: what registry (Import) and
// archive imports share. layers[i] goes with cf.RootFS.DiffIDs[i]; damaged
// names what is damaged when their counts differ; layerErr says why layer l
// could not be stored. On any error the store is unchanged.
func (s *Store) importLayers(ctx context.Context, ref, name, source, damaged string, start time.Time, cf *v1.ConfigFile, layers []importLayer, o importOptions, layerErr func(l importLayer, err error) error) (Image, error) {
	if cf.OS != "" && (cf.OS != Platform.OS || (cf.Architecture != "" && cf.Architecture != Platform.Architecture)) {
		return Image{}, errdefs.New(errdefs.ErrFailedPrecondition, "image %s is %s/%s; only %s/%s runs here", ref, cf.OS, cf.Architecture, Platform.OS, Platform.Architecture)
	}
	if len(layers) == 0 {
		return Image{}, errdefs.Invalid("ref", "image %s has no layers; nothing to run", ref)
	}
	if len(cf.RootFS.DiffIDs) != len(layers) {
		return Image{}, errdefs.Invalid("ref", "image %s lists %d layers but its config has %d diff_ids; the %s is damaged", ref, len(layers), len(cf.RootFS.DiffIDs), damaged)
	}
	cfg := Config{
		Env:        cf.Config.Env,
		Workdir:    cf.Config.WorkingDir,
		User:       cf.Config.User,
		Entrypoint: cf.Config.Entrypoint,
		Cmd:        cf.Config.Cmd,
		Labels:     cf.Config.Labels,
	}
	if err := validateConfig(cfg); err != nil {
		return Image{}, fmt.Errorf("image %s config: %w", ref, err)
	}

	p := &progress{fn: o.progress}
	var fetch []int
	for i, l := range layers {
		if s.hasLayer(l.diffID) {
			continue
		}
		fetch = append(fetch, i)
		p.totalBytes += l.size
	}
	st, err := s.newStaging()
	if err != nil {
		return Image{}, err
	}
	defer st.cleanup()
	var staged []stagedLayer
	for _, i := range fetch {
		l := layers[i]
		sl, err := s.stageLayer(ctx, st, l.diffID, func(ctx context.Context, dir string) error {
			return fetchLayer(ctx, l, l.diffID, dir, p)
		})
		if err != nil {
			if ctx.Err() != nil {
				return Image{}, context.Cause(ctx)
			}
			return Image{}, fmt.Errorf("layer %d of %d (%s): %w", i+1, len(layers), l.diffID, layerErr(l, err))
		}
		staged = append(staged, sl)
	}
	p.done()
	want := make([]Layer, len(layers))
	for i, l := range layers {
		want[i] = Layer{Digest: l.diffID}
		for _, sl := range staged {
			if sl.info.Digest == l.diffID {
				want[i].Size = sl.info.Size
			}
		}
		if li, err := s.readLayer(l.diffID); err == nil {
			want[i].Size = li.Size
		}
	}
	out, err := s.commit(ctx, name, cfg, source, want, staged)
	if err != nil {
		return Image{}, err
	}
	if o.merge {
		if out, err = s.commitMerged(ctx, name, cfg, source, want); err != nil {
			return Image{}, fmt.Errorf("merge layers of %s: %w", name, err)
		}
	}
	log.G(ctx).Info("image imported", "image", name, "source", source, "id", out.ID, "layers", len(layers), "fetched", len(fetch), "bytes", p.bytes, "format", s.format, "duration", time.Since(start).Round(time.Millisecond))
	return out, nil
}

// countingReader reports compressed bytes read to the progress.
type countingReader struct {
	r io.Reader
	p *progress
}

func (c *countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.p.add(0, int64(n))
	return n, err
}

// fetchLayer downloads one layer, decompresses it (gzip, zstd or none,
// found by its magic bytes rather than trusting the media type), unpacks it
// into dir and checks both digests: the blob's (go-containerregistry
// verifies it at EOF) and the uncompressed tar's against diffID.
func fetchLayer(ctx context.Context, l v1.Layer, diffID, dir string, p *progress) error {
	rc, err := l.Compressed()
	if err != nil {
		return err
	}
	defer rc.Close()
	br := bufio.NewReaderSize(&countingReader{r: rc, p: p}, 1<<20)
	magic, err := br.Peek(4)
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("read layer: %w", err)
	}
	var r io.Reader = br
	switch {
	case len(magic) == 0:
		return errdefs.Invalid("ref", "layer %s is 0 bytes; the image is damaged", diffID)
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		gz, err := gzip.NewReader(br)
		if err != nil {
			return errdefs.Invalid("ref", "layer %s: bad gzip data: %v", diffID, err)
		}
		defer gz.Close()
		r = gz
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br)
		if err != nil {
			return errdefs.Invalid("ref", "layer %s: bad zstd data: %v", diffID, err)
		}
		defer zr.Close()
		r = zr
	}
	h := sha256.New()
	tr := io.TeeReader(r, h)
	files := &progress{} // p counts compressed bytes, so only files from here
	err = extractTar(ctx, tr, dir, files, true)
	p.add(files.files, 0)
	if err != nil {
		return err
	}
	// The tar's end marker may be followed by padding; the diff_id covers it.
	if _, err := io.Copy(h, r); err != nil {
		return fmt.Errorf("read layer: %w", err)
	}
	if _, err := io.Copy(io.Discard, br); err != nil { // lets the blob digest be checked
		return fmt.Errorf("read layer: %w", err)
	}
	if err := rc.Close(); err != nil {
		return fmt.Errorf("read layer: %w", err)
	}
	if got := fmt.Sprintf("sha256:%x", h.Sum(nil)); got != diffID {
		return errdefs.Invalid("ref", "layer content has digest %s but the image config says %s; the image is damaged or was tampered with", got, diffID)
	}
	return nil
}

// registryError categorizes an error from talking to a registry.
func registryError(ctx context.Context, r name.Reference, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	var fe *errdefs.FieldError
	if errors.As(err, &fe) {
		return err
	}
	if errors.Is(err, errInternalAddr) {
		return errdefs.New(errdefs.ErrPermissionDenied, "registry %s: %w", r.Context().RegistryStr(), errInternalAddr)
	}
	var te *transport.Error
	if errors.As(err, &te) {
		switch te.StatusCode {
		case http.StatusNotFound:
			return errdefs.New(errdefs.ErrNotFound, "image %s not found in registry %s (unknown repository, tag or digest): %w", r, r.Context().RegistryStr(), err)
		case http.StatusUnauthorized:
			return errdefs.New(errdefs.ErrUnauthenticated, "registry %s refused the credentials for %s (log in with docker login or set credentials in ~/.docker/config.json): %w", r.Context().RegistryStr(), r, err)
		case http.StatusForbidden:
			return errdefs.New(errdefs.ErrPermissionDenied, "registry %s denied access to %s: %w", r.Context().RegistryStr(), r, err)
		}
		for _, d := range te.Errors {
			if d.Code == transport.ManifestUnknownErrorCode || d.Code == transport.NameUnknownErrorCode || d.Code == transport.BlobUnknownErrorCode {
				return errdefs.New(errdefs.ErrNotFound, "image %s not found in registry %s: %w", r, r.Context().RegistryStr(), err)
			}
		}
		return errdefs.New(errdefs.ErrUnavailable, "registry %s: %w", r.Context().RegistryStr(), err)
	}
	var ne net.Error
	var oe *net.OpError
	if errors.As(err, &oe) || errors.As(err, &ne) {
		return errdefs.New(errdefs.ErrUnavailable, "registry %s is unreachable: %w; check the address and that it is up", r.Context().RegistryStr(), err)
	}
	if errors.Is(err, io.ErrUnexpectedEOF) || strings.Contains(err.Error(), "unexpected EOF") {
		return errdefs.New(errdefs.ErrUnavailable, "registry %s: download of %s cut short (truncated layer): %w", r.Context().RegistryStr(), r, err)
	}
	if strings.Contains(err.Error(), "digest") {
		return errdefs.Invalid("ref", "%s: %v (the registry served content that does not match its digest)", r, err)
	}
	return fmt.Errorf("pull %s: %w", r, err)
}
