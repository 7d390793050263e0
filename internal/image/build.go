package image

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Build is one image build in progress (internal/imagebuild drives it):
// the layers its steps made, staged in the store's tmp/ as plain
// directories so that the build's sandboxes can stack them, and the cache
// entries they answer. Nothing of it is in the store until Commit, which
// adds every staged layer, the cache entries, the manifest and the name at
// once; Close without Commit leaves the store as it was.
type Build struct {
	s      *Store
	st     *staging
	holder string
	staged map[string]*stagedLayer // by digest
	order  []string
	cache  map[string]cacheEntry // new entries, by key digest
}

// cacheEntry is buildcache/<hex of sha256(key)>.json: what a build step
// with that key made. An empty Layer.Digest is a step that changed no file.
type cacheEntry struct {
	Key   string `json:"key"`
	Layer Layer  `json:"layer"`
}

// NewBuild starts a build on the store.
func (s *Store) NewBuild() (*Build, error) {
	st, err := s.newStaging()
	if err != nil {
		return nil, err
	}
	return &Build{s: s, st: st, holder: "build-" + randomID(), staged: map[string]*stagedLayer{}, cache: map[string]cacheEntry{}}, nil
}

// Close removes what the build staged and unmounts the store layers it
// mounted for reading. After Commit it only releases the mounts.
func (b *Build) Close(ctx context.Context) {
	if err := b.s.releaseMounts(context.WithoutCancel(ctx), b.holder); err != nil {
		log.G(ctx).Warn("release build layer mounts", log.Err(err))
	}
	b.st.cleanup()
}

// Dir is a scratch directory of the build, removed by Close.
func (b *Build) Dir() string { return b.st.dir }

// AddLayer stages a new layer whose content fill writes into an empty
// directory. A fill that leaves the directory empty adds no layer: ok is
// false.
func (b *Build) AddLayer(ctx context.Context, fill func(ctx context.Context, dir string) error) (l Layer, ok bool, err error) {
	sl, err := b.s.stageTree(ctx, b.st, "", fill)
	if err != nil {
		if sl.dir != "" {
			_ = removeTree(sl.dir)
		}
		return Layer{}, false, err
	}
	ents, err := os.ReadDir(filepath.Join(sl.dir, "dir"))
	if err != nil {
		return Layer{}, false, fmt.Errorf("stage layer: %w", err)
	}
	if len(ents) == 0 {
		_ = removeTree(sl.dir)
		return Layer{}, false, nil
	}
	l = Layer{Digest: sl.info.Digest, Size: sl.info.Size}
	if _, dup := b.staged[l.Digest]; dup || b.s.hasLayer(l.Digest) {
		_ = removeTree(sl.dir) // the same content is already there
		return l, true, nil
	}
	b.staged[l.Digest] = &sl
	b.order = append(b.order, l.Digest)
	return l, true, nil
}

// AddUpper stages a build sandbox's overlayfs upper directory as a layer
// (whiteouts and opaque directories kept, unless bottom: the layer is then
// an image's lowest), leaving out skip (slash paths relative to the root,
// e.g. ".opendsec").
func (b *Build) AddUpper(ctx context.Context, upper string, bottom bool, skip []string) (Layer, bool, error) {
	return b.AddLayer(ctx, func(ctx context.Context, dst string) error {
		if err := applyLayer(ctx, upper, dst, bottom, skip); err != nil {
			return fmt.Errorf("pack build step: %w", err)
		}
		pruneEmptyParents(dst, skip)
		return nil
	})
}

// Rootfs describes layers (bottom first) for a build sandbox's backend,
// with the build as the mounter: staged layers are their directories, store
// layers are mounted for the sandbox as any image's.
func (b *Build) Rootfs(name string, layers []Layer) (runtime.Rootfs, error) {
	out := make([]runtime.Layer, len(layers))
	for i, l := range layers {
		var rl runtime.Layer
		if sl, ok := b.staged[l.Digest]; ok {
			rl = runtime.Layer{Digest: l.Digest, Format: runtime.LayerDir, Path: filepath.Join(sl.dir, "dir"), Size: sl.info.Size}
		} else {
			li, err := b.s.readLayer(l.Digest)
			if err != nil {
				return runtime.Rootfs{}, fmt.Errorf("build layer %s: %w", l.Digest, errors.Join(errdefs.ErrUnavailable, err))
			}
			h, _ := digestHex(li.Digest)
			rl = runtime.Layer{Digest: li.Digest, Format: runtime.LayerDir, Path: b.s.path("layers", h, "dir"), Size: li.Size}
			if li.Format == FormatEROFS {
				rl.Format, rl.Path, rl.Size = runtime.LayerEROFS, b.s.path("layers", h, "layer.erofs"), li.FileSize
			}
		}
		out[len(out)-1-i] = rl
	}
	return runtime.Rootfs{Image: name, Layers: out, Mounter: b}, nil
}

// MountLayers implements runtime.LayerMounter for Rootfs: the directory of
// each layer, staged or in the store (mounted for holder).
func (b *Build) MountLayers(ctx context.Context, holder string, layers []runtime.Layer) ([]string, error) {
	dirs := make([]string, len(layers))
	var fromStore []runtime.Layer
	var at []int
	for i, l := range layers {
		if sl, ok := b.staged[l.Digest]; ok {
			dirs[i] = filepath.Join(sl.dir, "dir")
			continue
		}
		fromStore = append(fromStore, l)
		at = append(at, i)
	}
	if len(fromStore) > 0 {
		sd, err := b.s.MountLayers(ctx, holder, fromStore)
		if err != nil {
			return nil, err
		}
		for j, i := range at {
			dirs[i] = sd[j]
		}
	}
	return dirs, nil
}

// Dirs returns the directories of layers (bottom first), topmost first, for
// reading on the host; store layers are mounted for the build until Close.
func (b *Build) Dirs(ctx context.Context, layers []Layer) ([]string, error) {
	rfs, err := b.Rootfs("", layers)
	if err != nil {
		return nil, err
	}
	if len(rfs.Layers) == 0 {
		return nil, nil
	}
	return b.MountLayers(ctx, b.holder, rfs.Layers)
}

// BaseImage resolves name for a build's FROM: its layers and config.
func (b *Build) BaseImage(ctx context.Context, name string) (Image, error) {
	return b.s.Inspect(ctx, name)
}

// CacheKey digests a build step's identity: the layers under it, what it
// does and the content it reads.
func CacheKey(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		fmt.Fprintf(h, "%d:%s;", len(p), p)
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

func cacheFile(key string) string {
	sum := sha256.Sum256([]byte(key))
	return fmt.Sprintf("%x.json", sum)
}

// Cached looks key up: the layer a step with that key made (ok false when
// it changed nothing), found false when no usable entry exists (never
// built, or its layer was garbage-collected since).
func (b *Build) Cached(key string) (l Layer, ok, found bool) {
	e, in := b.cache[key]
	if !in {
		raw, err := os.ReadFile(b.s.path("buildcache", cacheFile(key)))
		if err != nil {
			return Layer{}, false, false
		}
		if json.Unmarshal(raw, &e) != nil || e.Key != key {
			return Layer{}, false, false
		}
	}
	if e.Layer.Digest == "" {
		return Layer{}, false, true
	}
	if _, staged := b.staged[e.Layer.Digest]; !staged && !b.s.hasLayer(e.Layer.Digest) {
		return Layer{}, false, false
	}
	return e.Layer, true, true
}

// Remember records that the step with key made l (nothing when ok is
// false); Commit writes it to the store's build cache.
func (b *Build) Remember(key string, l Layer, ok bool) {
	if !ok {
		l = Layer{}
	}
	b.cache[key] = cacheEntry{Key: key, Layer: l}
}

// Commit puts every layer the build staged into the store (those of every
// stage, so the next build finds them in the cache), writes the cache
// entries, and names the image of layers (bottom first) and cfg.
func (b *Build) Commit(ctx context.Context, name string, layers []Layer, cfg Config, source string) (Image, error) {
	name, err := NormalizeName(name)
	if err != nil {
		return Image{}, errdefs.Invalid("name", "%s", errdefs.PublicMessage(err))
	}
	if err := validateConfig(cfg); err != nil {
		return Image{}, err
	}
	t := time.Now()
	staged := make([]stagedLayer, 0, len(b.order))
	for _, d := range b.order {
		sl := b.staged[d]
		if err := b.s.finishStaged(ctx, sl); err != nil {
			return Image{}, err
		}
		staged = append(staged, *sl)
	}
	img, err := b.s.commit(ctx, name, cfg, source, slices.Clone(layers), staged)
	if err != nil {
		return Image{}, err
	}
	b.staged, b.order = map[string]*stagedLayer{}, nil
	for _, e := range b.cache {
		raw, _ := json.Marshal(e)
		if err := writeFileAtomic(b.s.path("buildcache", cacheFile(e.Key)), raw); err != nil {
			log.G(ctx).Warn("write build cache entry", log.Err(err))
		}
	}
	log.G(ctx).Info("image built", "image", name, "id", img.ID, "layers", len(layers), "new_layers", len(staged), "commit_ms", time.Since(t).Milliseconds())
	return img, nil
}

// LayerDigests lists the digests of the layers in the store, sorted: a
// test compares it before and after a build that must change nothing.
func (s *Store) LayerDigests() ([]string, error) {
	ents, err := os.ReadDir(s.path("layers"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("list layers: %w", err)
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() && len(e.Name()) == 64 {
			out = append(out, "sha256:"+e.Name())
		}
	}
	slices.Sort(out)
	return out, nil
}

// ExtractTar unpacks a plain or gzip tar stream into dir with the checks of
// a tarball import: entries with "..", absolute paths or paths through a
// symlink are refused; device files are skipped.
func ExtractTar(ctx context.Context, r io.Reader, dir string) error {
	return extractTar(ctx, r, dir, &progress{}, false)
}
