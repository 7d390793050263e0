package image

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// DefaultMergeThreshold is the size under which a layer counts as small when
// merging consecutive layers (WithMergeLayers, ComposeRequest.MergeLayers).
const DefaultMergeThreshold = 16 << 20

// WithMergeLayers merges runs of consecutive layers smaller than
// DefaultMergeThreshold into one layer after a registry import, so a
// sandbox's overlay stacks fewer layers. The unmerged layers stay in the
// store until GC.
func WithMergeLayers() ImportOption {
	return func(o *importOptions) { o.merge = true }
}

// WithInsecure lets a registry import use plain HTTP (and unverified TLS)
// for a registry that is not on loopback.
func WithInsecure() ImportOption {
	return func(o *importOptions) { o.insecure = true }
}

// ComposeLayer is one extra layer of Compose: a layer already in the store
// (Digest), or the layers of another image that are not already in the
// stack below it (Image), e.g. the top layer of an image made by PackDiff
// from the same base.
type ComposeLayer struct {
	Digest string
	Image  string
}

// ComposeRequest describes a new image made from existing layers.
type ComposeRequest struct {
	// Base is the image whose layers and config the new image starts from.
	Base string
	// Layers are stacked on Base's layers in order (the last on top).
	Layers []ComposeLayer
	// Name of the new image; an existing name is replaced atomically.
	Name string
	// Config, when set, overrides Base's config field by field: non-empty
	// fields replace, Env and Labels merge by key (Config's win).
	Config *Config
	// MergeLayers merges runs of small consecutive layers into one new
	// layer (the only case where Compose writes layer bytes).
	MergeLayers bool
}

// Compose makes a new image from Base plus extra layers. The manifest only
// references layers: no layer bytes are copied unless MergeLayers is set.
// On any error the store is unchanged.
func (s *Store) Compose(ctx context.Context, req ComposeRequest) (Image, error) {
	name, err := NormalizeName(req.Name)
	if err != nil {
		return Image{}, errdefs.Invalid("name", "%s", strings.TrimPrefix(err.Error(), "image: "))
	}
	if req.Base == "" {
		return Image{}, errdefs.Invalid("base", "is empty; give the image to start from, e.g. root/busybox")
	}
	base, err := s.Inspect(ctx, req.Base)
	if err != nil {
		return Image{}, fmt.Errorf("base: %w", err)
	}
	layers := slices.Clone(base.Layers)
	for i, cl := range req.Layers {
		field := fmt.Sprintf("layers[%d]", i)
		switch {
		case cl.Digest != "" && cl.Image != "":
			return Image{}, errdefs.Invalid(field, "gives both a digest and an image; give one")
		case cl.Digest != "":
			if _, err := digestHex(cl.Digest); err != nil {
				return Image{}, errdefs.Invalid(field+".digest", "%q is not sha256:<64 hex digits>; copy a digest from `opendsecctl image inspect`", cl.Digest)
			}
			li, err := s.readLayer(cl.Digest)
			if err != nil {
				return Image{}, errdefs.New(errdefs.ErrNotFound, "%s.digest: layer %s is not in the store; list layers with `opendsecctl image inspect NAME`", field, cl.Digest)
			}
			layers = append(layers, Layer{Digest: li.Digest, Size: li.Size})
		case cl.Image != "":
			other, err := s.Inspect(ctx, cl.Image)
			if err != nil {
				return Image{}, fmt.Errorf("%s.image: %w", field, err)
			}
			layers = append(layers, layersAbove(layers, other.Layers)...)
		default:
			return Image{}, errdefs.Invalid(field, "is empty; give a layer digest or an image name")
		}
	}
	cfg := base.Config
	if req.Config != nil {
		cfg = overlayConfig(base.Config, *req.Config)
	}
	if err := validateConfig(cfg); err != nil {
		return Image{}, fmt.Errorf("config: %w", err)
	}
	source := "compose:" + base.Name
	if req.MergeLayers {
		return s.commitMerged(ctx, name, cfg, source, layers)
	}
	img, err := s.commit(ctx, name, cfg, source, layers, nil)
	if err != nil {
		return Image{}, err
	}
	log.G(ctx).Info("image composed", "image", name, "id", img.ID, "base", base.Name, "layers", len(layers))
	return img, nil
}

// layersAbove returns the layers of other after the longest prefix it shares
// with stack: the layers other adds to what stack already has.
func layersAbove(stack, other []Layer) []Layer {
	i := 0
	for i < len(stack) && i < len(other) && stack[i].Digest == other[i].Digest {
		i++
	}
	return slices.Clone(other[i:])
}

func overlayConfig(base, over Config) Config {
	out := cloneConfig(base)
	if len(over.Env) > 0 {
		keys := map[string]int{}
		for i, e := range out.Env {
			k, _, _ := strings.Cut(e, "=")
			keys[k] = i
		}
		for _, e := range over.Env {
			k, _, _ := strings.Cut(e, "=")
			if i, ok := keys[k]; ok {
				out.Env[i] = e
			} else {
				keys[k] = len(out.Env)
				out.Env = append(out.Env, e)
			}
		}
	}
	if over.Workdir != "" {
		out.Workdir = over.Workdir
	}
	if over.User != "" {
		out.User = over.User
	}
	if len(over.Entrypoint) > 0 {
		out.Entrypoint = slices.Clone(over.Entrypoint)
	}
	if len(over.Cmd) > 0 {
		out.Cmd = slices.Clone(over.Cmd)
	}
	for k, v := range over.Labels {
		if out.Labels == nil {
			out.Labels = map[string]string{}
		}
		out.Labels[k] = v
	}
	return out
}

// Tag gives the image source a second name target (replacing what target
// named). Only a ref is written.
func (s *Store) Tag(ctx context.Context, source, target string) (Image, error) {
	if source == "" {
		return Image{}, errdefs.Invalid("source", "is empty; give an existing image name")
	}
	tn, err := NormalizeName(target)
	if err != nil {
		return Image{}, errdefs.Invalid("target", "%s", strings.TrimPrefix(err.Error(), "image: "))
	}
	sn, err := NormalizeName(source)
	if err != nil {
		return Image{}, errdefs.Invalid("source", "%s", strings.TrimPrefix(err.Error(), "image: "))
	}
	unlock, err := s.lock(ctx)
	if err != nil {
		return Image{}, err
	}
	defer unlock()
	img, err := s.readRef(sn)
	if errors.Is(err, fs.ErrNotExist) {
		return Image{}, fmt.Errorf("source: %w", s.notFound(ctx, source))
	} else if err != nil {
		return Image{}, err
	}
	for _, l := range img.Layers {
		if !s.hasLayer(l.Digest) {
			return Image{}, errdefs.New(errdefs.ErrFailedPrecondition, "image %s lacks layer %s; run `opendsecctl image verify`", sn, l.Digest)
		}
	}
	img.Name = tn
	img.Created = time.Now().UTC()
	if err := s.writeRef(img); err != nil {
		return Image{}, err
	}
	return img, nil
}

// GC removes layers and manifests no image name refers to and no holder
// (a sandbox on any node sharing the store) holds. It is Prune.
func (s *Store) GC(ctx context.Context) (PruneResult, error) { return s.Prune(ctx) }

// CorruptLayer is a layer Verify found damaged.
type CorruptLayer struct {
	Digest string
	Reason string
}

// VerifyResult is what Verify found.
type VerifyResult struct {
	// Checked counts the layers re-hashed.
	Checked int
	Corrupt []CorruptLayer
}

// Verify re-hashes every layer in the store against its recorded digest
// (the EROFS file's, or the tree digest of a plain directory layer) and
// checks that every image's layers exist. It changes nothing.
func (s *Store) Verify(ctx context.Context) (VerifyResult, error) {
	var res VerifyResult
	ents, err := os.ReadDir(s.path("layers"))
	if err != nil {
		return res, fmt.Errorf("verify images: %w", err)
	}
	for _, e := range ents {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		d := "sha256:" + e.Name()
		if _, err := digestHex(d); err != nil {
			continue
		}
		res.Checked++
		if reason := s.verifyLayer(ctx, d); reason != "" {
			res.Corrupt = append(res.Corrupt, CorruptLayer{Digest: d, Reason: reason})
		}
	}
	imgs, err := s.List(ctx)
	if err != nil {
		return res, err
	}
	for _, im := range imgs {
		for _, l := range im.Layers {
			if _, err := os.Stat(s.path("layers", strings.TrimPrefix(l.Digest, "sha256:"))); err != nil {
				res.Corrupt = append(res.Corrupt, CorruptLayer{Digest: l.Digest, Reason: "missing (image " + im.Name + " uses it)"})
			}
		}
	}
	return res, nil
}

func (s *Store) verifyLayer(ctx context.Context, d string) string {
	li, err := s.readLayer(d)
	if err != nil {
		return "unreadable layer.json: " + err.Error()
	}
	if li.Digest != d {
		return fmt.Sprintf("layer.json names %s", li.Digest)
	}
	h, _ := digestHex(d)
	switch li.Format {
	case FormatEROFS:
		got, n, err := fileDigest(s.path("layers", h, "layer.erofs"))
		if err != nil {
			return err.Error()
		}
		if got != li.FileDigest || n != li.FileSize {
			return fmt.Sprintf("layer.erofs hashes to %s (%d bytes), recorded %s (%d bytes)", got, n, li.FileDigest, li.FileSize)
		}
	default:
		want := li.TreeDigest
		if want == "" {
			want = li.Digest
		}
		got, _, err := digestTree(ctx, s.path("layers", h, "dir"))
		if err != nil {
			return err.Error()
		}
		if got != want {
			return fmt.Sprintf("directory hashes to %s, recorded %s", got, want)
		}
	}
	return ""
}

// commitMerged merges runs of small consecutive layers of want into one
// new layer each, then commits the image.
func (s *Store) commitMerged(ctx context.Context, name string, cfg Config, source string, want []Layer) (Image, error) {
	var runs [][2]int // [start, end) of runs of >= 2 small layers
	for i := 0; i < len(want); {
		j := i
		for j < len(want) && want[j].Size < DefaultMergeThreshold {
			j++
		}
		if j-i >= 2 {
			runs = append(runs, [2]int{i, j})
		}
		if j == i {
			j++
		}
		i = j
	}
	if len(runs) == 0 {
		return s.commit(ctx, name, cfg, source, want, nil)
	}
	st, err := s.newStaging()
	if err != nil {
		return Image{}, err
	}
	defer st.cleanup()
	holder := "merge-" + randomID()
	defer func() { _ = s.releaseMounts(context.WithoutCancel(ctx), holder) }()
	var out []Layer
	var staged []stagedLayer
	prev := 0
	for _, r := range runs {
		out = append(out, want[prev:r[0]]...)
		dirs, err := s.layerDirs(ctx, want[r[0]:r[1]], holder)
		if err != nil {
			return Image{}, fmt.Errorf("merge layers: %w", err)
		}
		sl, err := s.stageLayer(ctx, st, "", func(ctx context.Context, dst string) error {
			for _, d := range dirs {
				if err := applyLayer(ctx, d, dst, r[0] == 0, nil); err != nil {
					return fmt.Errorf("merge layers: %w", err)
				}
			}
			return nil
		})
		if err != nil {
			return Image{}, err
		}
		staged = append(staged, sl)
		out = append(out, Layer{Digest: sl.info.Digest, Size: sl.info.Size})
		prev = r[1]
	}
	out = append(out, want[prev:]...)
	img, err := s.commit(ctx, name, cfg, source, out, staged)
	if err != nil {
		return Image{}, err
	}
	log.G(ctx).Info("image layers merged", "image", name, "id", img.ID, "layers_before", len(want), "layers_after", len(out))
	return img, nil
}

// PackDiffRequest describes PackDiff.
type PackDiffRequest struct {
	// Holder is the sandbox whose held image the new layer goes on top of.
	Holder string
	// Upper is the sandbox's overlayfs upper directory.
	Upper string
	// Name of the new image.
	Name string
	// ScrubPaths are absolute paths left out of the new layer (the image's
	// own version, if any, shows through).
	ScrubPaths []string
}

// PackDiff turns a sandbox's writable layer into a new layer on top of the
// image the sandbox holds, and names the result. Overlayfs whiteouts and
// opaque directories are kept; overlayfs bookkeeping xattrs are dropped.
// On any error the store is unchanged.
func (s *Store) PackDiff(ctx context.Context, req PackDiffRequest) (Image, error) {
	name, err := NormalizeName(req.Name)
	if err != nil {
		return Image{}, errdefs.Invalid("name", "%s", strings.TrimPrefix(err.Error(), "image: "))
	}
	scrub := make([]string, 0, len(req.ScrubPaths))
	for i, p := range req.ScrubPaths {
		if !path.IsAbs(p) || path.Clean(p) == "/" || slices.Contains(strings.Split(p, "/"), "..") {
			return Image{}, errdefs.Invalid(fmt.Sprintf("scrub_paths[%d]", i), "%q must be an absolute path below / without '..', e.g. /root/.cache", p)
		}
		scrub = append(scrub, strings.TrimPrefix(path.Clean(p), "/"))
	}
	if !holderRE.MatchString(req.Holder) {
		return Image{}, errdefs.Invalid("sandbox_id", "%q is not valid", req.Holder)
	}
	base, err := s.heldImage(req.Holder)
	if err != nil {
		return Image{}, err
	}
	st, err := s.newStaging()
	if err != nil {
		return Image{}, err
	}
	defer st.cleanup()
	empty := true
	sl, err := s.stageLayer(ctx, st, "", func(ctx context.Context, dst string) error {
		// Scrubbed paths are left out during the copy: nothing in the
		// copy, which the sandbox controls, is ever resolved.
		if err := applyLayer(ctx, req.Upper, dst, false, scrub); err != nil {
			return fmt.Errorf("pack sandbox upper: %w", err)
		}
		ents, err := os.ReadDir(dst)
		empty = err == nil && len(ents) == 0
		return nil
	})
	if err != nil {
		return Image{}, err
	}
	want := slices.Clone(base.Layers)
	var staged []stagedLayer
	if !empty {
		want = append(want, Layer{Digest: sl.info.Digest, Size: sl.info.Size})
		staged = []stagedLayer{sl}
	}
	img, err := s.commit(ctx, name, base.Config, "sandbox:"+req.Holder, want, staged)
	if err != nil {
		return Image{}, err
	}
	log.G(ctx).Info("sandbox packed", "image", name, "id", img.ID, "sandbox.id", req.Holder, "layer", sl.info.Digest, "size", sl.info.Size)
	return img, nil
}

// heldImage returns the manifest holder holds (as recorded by Hold).
func (s *Store) heldImage(holder string) (manifest, error) {
	ents, err := os.ReadDir(s.path("holds"))
	if err != nil {
		return manifest{}, fmt.Errorf("find sandbox image: %w", err)
	}
	for _, e := range ents {
		if _, err := os.Stat(s.path("holds", e.Name(), holder)); err != nil {
			continue
		}
		m, err := s.readManifest("sha256:" + e.Name())
		if err != nil {
			return manifest{}, fmt.Errorf("sandbox %s image: %w", holder, err)
		}
		return m, nil
	}
	return manifest{}, errdefs.New(errdefs.ErrNotFound, "sandbox_id: sandbox %s holds no image in the store", holder)
}
