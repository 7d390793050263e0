package image

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Format is how a layer is kept in the store.
type Format string

const (
	// FormatAuto picks EROFS when this process can make and mount it, else
	// FormatDir.
	FormatAuto Format = ""
	// FormatEROFS keeps a layer as an EROFS image file mounted read-only.
	FormatEROFS Format = "erofs"
	// FormatDir keeps a layer as a plain directory: the fallback where EROFS
	// is unavailable (not root, no erofs driver, no mkfs.erofs).
	FormatDir Format = "dir"
)

// Option changes how Open sets a store up.
type Option func(*Store)

// WithMountDir sets the node-local directory where EROFS layers are
// mounted. It must not be on a file system shared with other nodes. The
// default is /run/opendsec/image-mounts/<hash of the store path>.
func WithMountDir(dir string) Option { return func(s *Store) { s.mountDir = dir } }

// WithFormat sets the format of newly imported layers. FormatEROFS fails
// Open when EROFS cannot be used; FormatDir forces the fallback.
func WithFormat(f Format) Option { return func(s *Store) { s.format = f } }

// WithImportDir restricts archive imports (oci-layout:PATH,
// docker-archive:PATH) to absolute paths under dir, without symlinks below
// it. A node serving the API sets it; the local CLI, run by the host's
// administrator, does not.
func WithImportDir(dir string) Option {
	return func(s *Store) { s.importDir = filepath.Clean(dir) }
}

// Store is an image store in one directory. It is safe for concurrent use by
// goroutines and by several processes (on one or several nodes) sharing the
// directory.
type Store struct {
	dir      string
	mountDir string
	format   Format
	// importDir, when set, is the only place archive imports read from.
	importDir string
	// canMount reports whether EROFS layers can be mounted here.
	canMount bool
}

// Open opens (creating if needed) the store in dir, decides the layer format
// (see WithFormat) and removes what crashed imports left behind.
func Open(dir string, opts ...Option) (*Store, error) {
	if dir == "" {
		return nil, errdefs.Invalid("data_dir", "image store directory is empty; pass a directory")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("image store path: %w", err)
	}
	s := &Store{dir: abs}
	for _, o := range opts {
		o(s)
	}
	switch s.format {
	case FormatAuto, FormatEROFS, FormatDir:
	default:
		return nil, errdefs.Invalid("image_format", "%q is not a layer format; use erofs, dir or leave it empty for automatic", s.format)
	}
	if s.mountDir == "" {
		sum := sha256.Sum256([]byte(abs))
		s.mountDir = filepath.Join("/run/opendsec/image-mounts", fmt.Sprintf("%x", sum[:6]))
	}
	if s.mountDir, err = filepath.Abs(s.mountDir); err != nil {
		return nil, fmt.Errorf("image mount dir: %w", err)
	}
	for _, d := range []string{s.dir, s.path("layers"), s.path("manifests"), s.path("refs"), s.path("holds"), s.path("tmp"), s.path("buildcache")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("create image store: %w", err)
		}
	}
	if err := s.cleanTmp(); err != nil {
		return nil, err
	}
	if s.importDir != "" {
		if !filepath.IsAbs(s.importDir) {
			return nil, errdefs.Invalid("node.import_dir", "%q must be an absolute path", s.importDir)
		}
		if err := os.MkdirAll(s.importDir, 0o755); err != nil {
			return nil, fmt.Errorf("create image import dir: %w", err)
		}
	}
	if s.format != FormatDir {
		perr := probeEROFS(s.path("tmp"))
		if perr == nil {
			perr = os.MkdirAll(filepath.Join(s.mountDir, "refs"), 0o755)
		}
		switch {
		case perr == nil:
			s.canMount = true
			s.format = FormatEROFS
		case s.format == FormatEROFS:
			return nil, fmt.Errorf("image store: erofs layers unavailable: %v: %w", perr, errdefs.ErrFailedPrecondition)
		default:
			s.format = FormatDir
		}
	}
	return s, nil
}

// Dir is the store's directory.
func (s *Store) Dir() string { return s.dir }

// Format is the format new layers are written in.
func (s *Store) Format() Format { return s.format }

func (s *Store) path(elem ...string) string {
	return filepath.Join(append([]string{s.dir}, elem...)...)
}

func (s *Store) refPath(name string) string {
	return s.path("refs", urlEscape(name)+".json")
}

// digestHex returns the hex part of a "sha256:<hex>" digest.
func digestHex(d string) (string, error) {
	h, ok := strings.CutPrefix(d, "sha256:")
	if !ok || len(h) != 64 || strings.Trim(h, "0123456789abcdef") != "" {
		return "", fmt.Errorf("digest %q is not sha256:<64 hex digits>: %w", d, errdefs.ErrInternal)
	}
	return h, nil
}

// layerInfo is layers/<hex>/layer.json.
type layerInfo struct {
	Digest string `json:"digest"`
	Format Format `json:"format"`
	// Size is the bytes of file content.
	Size int64 `json:"size"`
	// FileSize and FileDigest describe layer.erofs.
	FileSize   int64  `json:"file_size,omitempty"`
	FileDigest string `json:"file_digest,omitempty"`
	// TreeDigest is the tree digest of a plain directory layer whose
	// Digest is not one (a registry layer's diff_id), for Verify.
	TreeDigest string `json:"tree_digest,omitempty"`
}

func (s *Store) readLayer(digest string) (layerInfo, error) {
	h, err := digestHex(digest)
	if err != nil {
		return layerInfo{}, err
	}
	b, err := os.ReadFile(s.path("layers", h, "layer.json"))
	if err != nil {
		return layerInfo{}, err
	}
	var li layerInfo
	if err := json.Unmarshal(b, &li); err != nil {
		return layerInfo{}, fmt.Errorf("layer %s: %w", digest, errors.Join(errdefs.ErrInternal, err))
	}
	return li, nil
}

func (s *Store) hasLayer(digest string) bool {
	_, err := s.readLayer(digest)
	return err == nil
}

// stagedLayer is a layer built in tmp/, ready to be renamed into layers/.
type stagedLayer struct {
	dir  string // holds layer.json and layer.erofs or dir/
	info layerInfo
}

// stageLayer fills a fresh directory with fill, digests it (unless digest is
// already known, as for a verified OCI diff_id) and converts it to the
// store's format.
func (s *Store) stageLayer(ctx context.Context, st *staging, digest string, fill func(ctx context.Context, dir string) error) (stagedLayer, error) {
	sl, err := s.stageTree(ctx, st, digest, fill)
	if err != nil {
		return stagedLayer{}, err
	}
	if err := s.finishStaged(ctx, &sl); err != nil {
		return stagedLayer{}, err
	}
	return sl, nil
}

// stageTree fills a fresh directory in st with fill and digests it (unless
// digest is known); the layer stays a plain directory (sl.dir/dir) until
// finishStaged.
func (s *Store) stageTree(ctx context.Context, st *staging, digest string, fill func(ctx context.Context, dir string) error) (stagedLayer, error) {
	ldir, err := os.MkdirTemp(st.dir, "layer-")
	if err != nil {
		return stagedLayer{}, fmt.Errorf("stage layer: %w", err)
	}
	tree := filepath.Join(ldir, "dir")
	if err := os.Mkdir(tree, 0o755); err != nil {
		return stagedLayer{}, fmt.Errorf("stage layer: %w", err)
	}
	if err := fill(ctx, tree); err != nil {
		return stagedLayer{}, err
	}
	var size int64
	known := digest != ""
	if !known {
		if digest, size, err = digestTree(ctx, tree); err != nil {
			return stagedLayer{}, err
		}
	} else {
		size = treeSize(tree)
	}
	info := layerInfo{Digest: digest, Format: FormatDir, Size: size}
	if s.format != FormatEROFS && known {
		if info.TreeDigest, _, err = digestTree(ctx, tree); err != nil {
			return stagedLayer{}, err
		}
	}
	return stagedLayer{dir: ldir, info: info}, nil
}

// finishStaged converts a layer stageTree made to the store's format and
// writes its layer.json: it is then ready for commit.
func (s *Store) finishStaged(ctx context.Context, sl *stagedLayer) error {
	ldir, tree := sl.dir, filepath.Join(sl.dir, "dir")
	info := sl.info
	info.Format = s.format
	if s.format == FormatEROFS {
		img := filepath.Join(ldir, "layer.erofs")
		if err := mkfsEROFS(ctx, img, tree); err != nil {
			return fmt.Errorf("build erofs layer: %w", err)
		}
		var err error
		if info.FileDigest, info.FileSize, err = fileDigest(img); err != nil {
			return err
		}
		if err := removeTree(tree); err != nil {
			return fmt.Errorf("stage layer: %w", err)
		}
	}
	b, _ := json.MarshalIndent(info, "", "  ")
	if err := writeFileAtomic(filepath.Join(ldir, "layer.json"), b); err != nil {
		return err
	}
	sl.info = info
	return nil
}

// manifest is manifests/<hex>.json; <hex> is the sha256 of these bytes.
type manifest struct {
	Version int     `json:"version"`
	Layers  []Layer `json:"layers"`
	Config  Config  `json:"config"`
}

const manifestVersion = 1

func encodeManifest(layers []Layer, cfg Config) ([]byte, string) {
	b, _ := json.Marshal(manifest{Version: manifestVersion, Layers: layers, Config: cfg})
	return b, fmt.Sprintf("sha256:%x", sha256.Sum256(b))
}

func (s *Store) readManifest(id string) (manifest, error) {
	h, err := digestHex(id)
	if err != nil {
		return manifest{}, err
	}
	b, err := os.ReadFile(s.path("manifests", h+".json"))
	if err != nil {
		return manifest{}, err
	}
	var m manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return manifest{}, fmt.Errorf("image manifest %s: %w", id, errors.Join(errdefs.ErrInternal, err))
	}
	return m, nil
}

// commit moves staged layers into layers/ (a layer another importer
// committed first is kept and ours dropped: one copy of each), writes the
// manifest and points name at it, all under the store lock so Prune never
// sees a layer without its manifest. Layers in want that were not staged
// must already be in the store.
func (s *Store) commit(ctx context.Context, name string, cfg Config, source string, want []Layer, staged []stagedLayer) (Image, error) {
	for _, sl := range staged {
		if err := syncFS(sl.dir); err != nil {
			return Image{}, err
		}
	}
	unlock, err := s.lock(ctx)
	if err != nil {
		return Image{}, err
	}
	defer unlock()
	for _, sl := range staged {
		h, err := digestHex(sl.info.Digest)
		if err != nil {
			return Image{}, err
		}
		dst := s.path("layers", h)
		if s.hasLayer(sl.info.Digest) {
			continue
		}
		_ = removeTree(dst) // a half-removed layer from a crashed prune
		if err := os.Rename(sl.dir, dst); err != nil {
			return Image{}, fmt.Errorf("commit layer %s: %w", sl.info.Digest, err)
		}
	}
	if err := syncDir(s.path("layers")); err != nil {
		return Image{}, err
	}
	var size int64
	for _, l := range want {
		if !s.hasLayer(l.Digest) {
			return Image{}, fmt.Errorf("layer %s was removed while importing (a concurrent prune); import again: %w", l.Digest, errdefs.ErrUnavailable)
		}
		size += l.Size
	}
	b, id := encodeManifest(want, cfg)
	h, _ := digestHex(id)
	if err := writeFileAtomic(s.path("manifests", h+".json"), b); err != nil {
		return Image{}, err
	}
	img := Image{Name: name, ID: id, Created: time.Now().UTC(), Size: size, Layers: slices.Clone(want), Config: cloneConfig(cfg), Source: source}
	if err := s.writeRef(img); err != nil {
		return Image{}, err
	}
	return img, nil
}

// ImportDir copies the root filesystem at src into the store as a
// one-layer image called name, preserving modes, owners (when root),
// symlinks, hard links, fifos, xattrs where the filesystem allows and times.
// Device files and sockets are skipped. An existing name is replaced
// atomically; its old layers stay valid for sandboxes that use them.
func (s *Store) ImportDir(ctx context.Context, name, src string, cfg Config, opts ...ImportOption) (Image, error) {
	if src == "" {
		return Image{}, errdefs.Invalid("rootfs", "path is empty; pass the root filesystem directory")
	}
	root, err := filepath.EvalSymlinks(src)
	if err == nil {
		root, err = filepath.Abs(root)
	}
	if err != nil {
		return Image{}, errdefs.Invalid("rootfs", "%s: %v; pass an existing root filesystem directory", src, err)
	}
	fi, err := os.Stat(root)
	if err != nil {
		return Image{}, errdefs.Invalid("rootfs", "%s: %v", src, err)
	}
	if !fi.IsDir() {
		return Image{}, errdefs.Invalid("rootfs", "%s is not a directory; for a tarball use a tar import", src)
	}
	if inside(root, s.dir) || inside(s.dir, root) {
		return Image{}, errdefs.Invalid("rootfs", "%s overlaps the image store %s; import from elsewhere", src, s.dir)
	}
	return s.importOne(ctx, name, cfg, "dir:"+root, opts, func(ctx context.Context, dst string, p *progress) error {
		return copyTree(ctx, root, dst, p)
	})
}

// ImportTar extracts a plain or gzip-compressed tarball of a root filesystem
// into the store as a one-layer image called name. Entries with ".."
// components or absolute paths, and entries that would be written through a
// symlink, are refused and the store is left unchanged.
func (s *Store) ImportTar(ctx context.Context, name, tarPath string, cfg Config, opts ...ImportOption) (Image, error) {
	if tarPath == "" {
		return Image{}, errdefs.Invalid("tar", "path is empty; pass a .tar or .tar.gz of a root filesystem")
	}
	src := tarPath
	if abs, err := filepath.Abs(tarPath); err == nil {
		src = abs
	}
	return s.importOne(ctx, name, cfg, "tar:"+src, opts, func(ctx context.Context, dst string, p *progress) error {
		return extractTarFile(ctx, tarPath, dst, p)
	})
}

func (s *Store) importOne(ctx context.Context, name string, cfg Config, source string, opts []ImportOption, fill func(context.Context, string, *progress) error) (Image, error) {
	name, err := NormalizeName(name)
	if err != nil {
		return Image{}, err
	}
	if err := validateConfig(cfg); err != nil {
		return Image{}, err
	}
	var o importOptions
	for _, opt := range opts {
		opt(&o)
	}
	st, err := s.newStaging()
	if err != nil {
		return Image{}, err
	}
	defer st.cleanup()
	start := time.Now()
	p := &progress{fn: o.progress}
	sl, err := s.stageLayer(ctx, st, "", func(ctx context.Context, dir string) error { return fill(ctx, dir, p) })
	if err != nil {
		return Image{}, err
	}
	p.done()
	img, err := s.commit(ctx, name, cfg, source, []Layer{{Digest: sl.info.Digest, Size: sl.info.Size}}, []stagedLayer{sl})
	if err != nil {
		return Image{}, err
	}
	log.G(ctx).Info("image imported", "image", name, "id", img.ID, "size", img.Size, "files", p.files, "format", s.format, "duration", time.Since(start).Round(time.Millisecond))
	return img, nil
}

type refFile struct {
	Version int `json:"version"`
	Image
}

// refVersion 1 was the single-directory store of issue 2.
const refVersion = 2

func (s *Store) writeRef(img Image) error {
	b, err := json.MarshalIndent(refFile{Version: refVersion, Image: img}, "", "  ")
	if err != nil {
		return fmt.Errorf("encode image ref: %w", err)
	}
	return writeFileAtomic(s.refPath(img.Name), b)
}

func writeFileAtomic(path string, b []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), ".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if _, err := f.Write(b); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	return syncDir(filepath.Dir(path))
}

func (s *Store) readRef(name string) (Image, error) {
	b, err := os.ReadFile(s.refPath(name))
	if err != nil {
		return Image{}, err
	}
	var r refFile
	if err := json.Unmarshal(b, &r); err != nil {
		return Image{}, fmt.Errorf("image ref %s: %w", name, errors.Join(errdefs.ErrInternal, err))
	}
	if r.Version != refVersion {
		return Image{}, errdefs.New(errdefs.ErrFailedPrecondition,
			"image %s was written by another store layout (version %d, this build reads %d); import it again", name, r.Version, refVersion)
	}
	return r.Image, nil
}

// Inspect returns the image called name.
func (s *Store) Inspect(ctx context.Context, name string) (Image, error) {
	n, err := NormalizeName(name)
	if err != nil {
		return Image{}, err
	}
	img, err := s.readRef(n)
	if errors.Is(err, fs.ErrNotExist) {
		return Image{}, s.notFound(ctx, name)
	}
	return img, err
}

func (s *Store) notFound(ctx context.Context, name string) error {
	avail := "none yet"
	if imgs, err := s.List(ctx); err == nil && len(imgs) > 0 {
		names := make([]string, len(imgs))
		for i, im := range imgs {
			names[i] = im.Name
		}
		avail = strings.Join(names, ", ")
	}
	return errdefs.New(errdefs.ErrNotFound,
		"image %q not found (available: %s); import it with `opendsec image import REF` (a registry) or `opendsec image import-rootfs --name NAME --rootfs DIR`, or build the base images with deploy/images/build.sh",
		name, avail)
}

// ImageID returns the ID (content digest) name refers to now, without
// mounting or holding anything: a node's warm pool compares it with the ID
// its prestarted sandboxes were made from.
func (s *Store) ImageID(ctx context.Context, name string) (string, error) {
	n, err := NormalizeName(name)
	if err != nil {
		return "", err
	}
	img, err := s.readRef(n)
	if errors.Is(err, fs.ErrNotExist) {
		return "", s.notFound(ctx, name)
	} else if err != nil {
		return "", err
	}
	return img.ID, nil
}

// Get resolves name to its layer descriptors and config. Its layers are
// guaranteed to exist only until the name is re-imported or removed and the
// store pruned; a sandbox uses Hold instead.
func (s *Store) Get(ctx context.Context, name string) (runtime.Image, error) {
	img, err := s.Inspect(ctx, name)
	if err != nil {
		return runtime.Image{}, err
	}
	return s.runtimeImage(img)
}

// runtimeImage describes img's layers, topmost first, for a backend: each
// EROFS file or directory in the store, with the store as the mounter of
// the ones a backend wants as directories. Nothing is mounted.
func (s *Store) runtimeImage(img Image) (runtime.Image, error) {
	layers := make([]runtime.Layer, len(img.Layers))
	for i, l := range img.Layers {
		li, err := s.readLayer(l.Digest)
		if err != nil {
			return runtime.Image{}, fmt.Errorf("image %s: layer %s: %w", img.Name, l.Digest, errors.Join(errdefs.ErrInternal, err))
		}
		h, _ := digestHex(li.Digest)
		rl := runtime.Layer{Digest: li.Digest, Format: runtime.LayerDir, Path: s.path("layers", h, "dir"), Size: li.Size}
		if li.Format == FormatEROFS {
			rl.Format, rl.Path, rl.Size = runtime.LayerEROFS, s.path("layers", h, "layer.erofs"), li.FileSize
		}
		layers[len(layers)-1-i] = rl
	}
	return runtime.Image{
		Rootfs: runtime.Rootfs{
			Image:   img.Name,
			ImageID: img.ID,
			Layers:  layers,
			Mounter: s,
		},
		Env:     slices.Clone(img.Config.Env),
		Workdir: img.Config.Workdir,
		User:    img.Config.User,
	}, nil
}

// MountLayers returns a directory for each of layers (in the order given),
// mounting EROFS layers on this node as needed (runtime.LayerMounter).
// With holder set, the mounts are recorded for holder and stay until
// Release(holder); an empty holder mounts without a record (tests, tools).
func (s *Store) MountLayers(ctx context.Context, holder string, layers []runtime.Layer) ([]string, error) {
	if holder != "" && !holderRE.MatchString(holder) {
		return nil, errdefs.Invalid("holder", "%q is not valid; use letters, digits, '.', '_' and '-'", holder)
	}
	ls := make([]Layer, len(layers))
	for i, l := range layers {
		ls[i] = Layer{Digest: l.Digest}
	}
	return s.layerDirs(ctx, ls, holder)
}

// List returns every image, sorted by name.
func (s *Store) List(ctx context.Context) ([]Image, error) {
	ents, err := os.ReadDir(s.path("refs"))
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	var out []Image
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		name, err := urlUnescape(strings.TrimSuffix(e.Name(), ".json"))
		if err != nil {
			continue
		}
		img, err := s.readRef(name)
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed while listing
		}
		if errors.Is(err, errdefs.ErrFailedPrecondition) {
			log.G(ctx).Warn("skipping image of another store layout", "image", name)
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, img)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Remove deletes the name. Its layers stay until Prune, so running
// sandboxes are not affected.
func (s *Store) Remove(ctx context.Context, name string) error {
	n, err := NormalizeName(name)
	if err != nil {
		return err
	}
	unlock, err := s.lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	if err := os.Remove(s.refPath(n)); errors.Is(err, fs.ErrNotExist) {
		return s.notFound(ctx, name)
	} else if err != nil {
		return fmt.Errorf("remove image %s: %w", n, err)
	}
	if err := s.removeFiles(n); err != nil {
		return err
	}
	return syncDir(s.path("refs"))
}

// Hold resolves name like Get and records that holder (e.g. a sandbox ID)
// uses it: Prune keeps its manifest and layers until Release(holder), even
// after the name is re-imported or removed. Layers a backend mounts for
// holder (MountLayers) stay mounted on this node until then.
func (s *Store) Hold(ctx context.Context, name, holder string) (runtime.Image, error) {
	if !holderRE.MatchString(holder) || len(holder) > 200 {
		return runtime.Image{}, errdefs.Invalid("holder", "%q is not valid; use letters, digits, '.', '_' and '-'", holder)
	}
	n, err := NormalizeName(name)
	if err != nil {
		return runtime.Image{}, err
	}
	img, err := func() (Image, error) {
		unlock, err := s.lock(ctx)
		if err != nil {
			return Image{}, err
		}
		defer unlock()
		img, err := s.readRef(n)
		if errors.Is(err, fs.ErrNotExist) {
			return Image{}, s.notFound(ctx, name)
		} else if err != nil {
			return Image{}, err
		}
		h, err := digestHex(img.ID)
		if err != nil {
			return Image{}, err
		}
		hdir := s.path("holds", h)
		if err := os.MkdirAll(hdir, 0o755); err != nil {
			return Image{}, fmt.Errorf("hold image: %w", err)
		}
		// Not synced (unlike the store's manifests and refs): a hold
		// only matters while its sandbox lives, and every sandbox of
		// this machine dies with a power loss (at its next start the node
		// removes the dead sandboxes and their holds). Other nodes see
		// it as soon as it is written (NFS flushes it at close). Its
		// existence is what counts; the content is for people.
		if err := s.writeHold(h, filepath.Join(hdir, holder), img.Name); err != nil {
			return Image{}, fmt.Errorf("hold image: %w", err)
		}
		return img, nil
	}()
	if err != nil {
		return runtime.Image{}, err
	}
	ri, err := s.runtimeImage(img)
	if err != nil {
		_ = s.Release(context.WithoutCancel(ctx), holder)
		return runtime.Image{}, err
	}
	return ri, nil
}

// writeHold makes the hold file p of image h (hex) as a hard link to the
// image's hold template, holdnames/<h> (made on the first hold, holding
// name): a new directory entry without a new inode. On file systems
// that scan recently freed inodes to allocate one (ext4 without a
// journal) a new inode per sandbox costs more than the rest of the hold,
// and the release then frees none. Where hard links fail, p is written.
// Called under the store lock.
func (s *Store) writeHold(h, p, name string) error {
	tmpl := s.path("holdnames", h)
	err := os.Link(tmpl, p)
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(s.path("holdnames"), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(tmpl, []byte(name+"\n"), 0o644); err != nil {
			return err
		}
		err = os.Link(tmpl, p)
	}
	switch {
	case err == nil, errors.Is(err, fs.ErrExist):
		return nil // held already: the hold is its existence
	default:
		return os.WriteFile(p, []byte(name+"\n"), 0o644)
	}
}

// Release drops every hold of holder and unmounts the layers no other
// holder on this node uses. Releasing an unknown holder succeeds.
func (s *Store) Release(ctx context.Context, holder string) error {
	if !holderRE.MatchString(holder) {
		return errdefs.Invalid("holder", "%q is not valid; use letters, digits, '.', '_' and '-'", holder)
	}
	if err := s.releaseMounts(ctx, holder); err != nil {
		return err
	}
	unlock, err := s.lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	ents, err := os.ReadDir(s.path("holds"))
	if err != nil {
		return fmt.Errorf("release image holds: %w", err)
	}
	for _, e := range ents {
		p := s.path("holds", e.Name(), holder)
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("release image hold: %w", err)
		}
		_ = os.Remove(s.path("holds", e.Name())) // only succeeds when empty
	}
	return nil
}

// pruneRemove deletes a doomed layer moved to the trash; a test replaces it
// to observe the deletion.
var pruneRemove = removeTree

// PruneResult says what Prune removed.
type PruneResult struct {
	Removed []string // layer digests
	Bytes   int64    // bytes of file content in them
}

// Prune removes layers and manifests no image name refers to and no holder
// holds, unmounts their unused mounts on this node, and clears what crashed
// imports left in tmp/. Under the store lock doomed layers are only renamed
// into tmp/ (cheap); they are deleted after the lock is released, so
// imports and sandbox creates (Hold) do not wait for the deletion. A crash
// before the deletion leaves the trash to cleanTmp at the next Open or
// Prune.
func (s *Store) Prune(ctx context.Context) (PruneResult, error) {
	res, trash, err := s.pruneLocked(ctx)
	for _, dir := range trash {
		if rerr := pruneRemove(dir); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
			// The layer is already out of layers/; cleanTmp retries.
			log.G(ctx).Warn("delete pruned image layer", "dir", dir, "error", rerr)
		}
	}
	if err != nil {
		return res, err
	}
	if err := s.cleanTmp(); err != nil {
		return res, err
	}
	return res, nil
}

// pruneLocked, under the store lock, unmounts and renames into tmp/ every
// layer Prune removes, and returns the renamed directories.
func (s *Store) pruneLocked(ctx context.Context) (PruneResult, []string, error) {
	var trash []string
	unlock, err := s.lock(ctx)
	if err != nil {
		return PruneResult{}, nil, err
	}
	defer unlock()
	keepManifest := map[string]bool{}
	imgs, err := s.List(ctx)
	if err != nil {
		return PruneResult{}, trash, err
	}
	for _, im := range imgs {
		if h, err := digestHex(im.ID); err == nil {
			keepManifest[h] = true
		}
	}
	holds, err := os.ReadDir(s.path("holds"))
	if err != nil {
		return PruneResult{}, trash, fmt.Errorf("prune images: %w", err)
	}
	for _, e := range holds {
		if hs, err := os.ReadDir(s.path("holds", e.Name())); err == nil && len(hs) > 0 {
			keepManifest[e.Name()] = true
		}
	}
	keepLayer := map[string]bool{}
	for _, im := range imgs {
		for _, l := range im.Layers {
			if h, err := digestHex(l.Digest); err == nil {
				keepLayer[h] = true
			}
		}
	}
	mans, err := os.ReadDir(s.path("manifests"))
	if err != nil {
		return PruneResult{}, trash, fmt.Errorf("prune images: %w", err)
	}
	for _, e := range mans {
		h, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || strings.HasPrefix(h, ".") {
			continue
		}
		if !keepManifest[h] {
			if err := os.Remove(s.path("manifests", e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return PruneResult{}, trash, fmt.Errorf("prune manifest: %w", err)
			}
			// Its hold template (nothing holds it: not kept).
			if err := os.Remove(s.path("holdnames", h)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return PruneResult{}, trash, fmt.Errorf("prune hold template: %w", err)
			}
			continue
		}
		m, err := s.readManifest("sha256:" + h)
		if err != nil {
			return PruneResult{}, trash, fmt.Errorf("prune images: %w", err)
		}
		for _, l := range m.Layers {
			if lh, err := digestHex(l.Digest); err == nil {
				keepLayer[lh] = true
			}
		}
	}
	ents, err := os.ReadDir(s.path("layers"))
	if err != nil {
		return PruneResult{}, trash, fmt.Errorf("prune images: %w", err)
	}
	var res PruneResult
	for _, e := range ents {
		if keepLayer[e.Name()] {
			continue
		}
		if err := ctx.Err(); err != nil {
			return res, trash, err
		}
		info, _ := s.readLayer("sha256:" + e.Name())
		if err := s.unmountLayer(ctx, e.Name()); err != nil {
			return res, trash, err
		}
		// Rename first, so a crash mid-removal never leaves a half layer
		// under its digest.
		dir := s.path("tmp", "prune-"+randomID())
		if err := os.Rename(s.path("layers", e.Name()), dir); err != nil {
			return res, trash, fmt.Errorf("prune layer %s: %w", e.Name(), err)
		}
		trash = append(trash, dir)
		res.Removed = append(res.Removed, "sha256:"+e.Name())
		res.Bytes += info.Size
	}
	return res, trash, nil
}
