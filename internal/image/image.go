// Package image is OpenDsec's minimal image store: root filesystems imported
// from a directory or a tarball, each kept as one immutable content directory
// named by the sha256 digest of its tree, and small ref files mapping image
// names ("root/py:3.11") to content. An image resolves to a runtime.Image
// whose single read-only layer is that content directory.
//
// Layout of a store directory:
//
//	lock                 flock(2) file serializing commits across processes
//	content/<hex>/       an image's root filesystem, never modified once committed
//	refs/<name>.json     name -> content (written with rename, so atomic)
//	holds/<hex>/<holder> content a running sandbox uses (see Hold, Release)
//	tmp/                 imports in progress, each guarded by its own flock
//
// Re-importing a name commits new content and swaps the ref; the old content
// stays on disk, so sandboxes started from it keep working. Prune removes
// content that no ref points to and no holder holds.
//
// The later layered store (EROFS layers, OCI import) replaces the internals
// behind the same methods: Get still returns a runtime.Image.
package image

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

// DefaultTag is the tag of a name given without one: "root/busybox" is
// "root/busybox:latest".
const DefaultTag = "latest"

// StoreDir is where the image store lives inside an OpenDsec data dir.
func StoreDir(dataDir string) string { return filepath.Join(dataDir, "images") }

// Config is an image's runtime defaults.
type Config struct {
	// Env holds "K=V" entries.
	Env        []string          `json:"env,omitempty"`
	Workdir    string            `json:"workdir,omitempty"`
	User       string            `json:"user,omitempty"`
	Entrypoint []string          `json:"entrypoint,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
}

// Image describes one imported image.
type Image struct {
	// Name is normalized, always with a tag ("root/busybox:latest").
	Name string `json:"name"`
	// ID is "sha256:<hex>", the digest of the root filesystem tree.
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
	// Size is the bytes of file content in the root filesystem.
	Size   int64  `json:"size"`
	Config Config `json:"config"`
}

// Progress reports an import's advance. Totals are 0 when unknown (tarballs).
type Progress struct {
	Files      int64
	Bytes      int64
	TotalFiles int64
	TotalBytes int64
	// Done is set on the last report of an import.
	Done bool
}

// ImportOption changes how an import runs.
type ImportOption func(*importOptions)

type importOptions struct {
	progress func(Progress)
}

// WithProgress calls fn as files are copied (throttled, and once with Done
// at the end). fn runs on the importing goroutine and must be quick.
func WithProgress(fn func(Progress)) ImportOption {
	return func(o *importOptions) { o.progress = fn }
}

var (
	nameRE   = regexp.MustCompile(`^[a-z0-9][a-z0-9._/-]*(:[a-zA-Z0-9._-]+)?$`)
	holderRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]*$`)
)

const maxNameLen = 200

// isRoot reports whether owners can be preserved on import.
var isRoot = os.Geteuid() == 0

// NormalizeName validates an image name and adds the default tag. Names are
// `[a-z0-9][a-z0-9._/-]*(:[a-zA-Z0-9._-]+)?`, with no empty, "." or ".."
// path components.
func NormalizeName(name string) (string, error) {
	if name == "" {
		return "", errdefs.Invalid("image", "name is empty; use a name like root/py:3.11")
	}
	if len(name) > maxNameLen {
		return "", errdefs.Invalid("image", "name is %d characters long; use at most %d", len(name), maxNameLen)
	}
	if !nameRE.MatchString(name) {
		return "", errdefs.Invalid("image", "name %q is not valid: use lowercase letters, digits, '.', '_', '-' and '/', then an optional :tag (e.g. root/py:3.11)", name)
	}
	repo, tag, ok := strings.Cut(name, ":")
	for _, c := range strings.Split(repo, "/") {
		if c == "" || c == "." || c == ".." {
			return "", errdefs.Invalid("image", "name %q has an empty, '.' or '..' path component; use a name like root/py:3.11", name)
		}
	}
	if !ok {
		tag = DefaultTag
	}
	return repo + ":" + tag, nil
}

func validateConfig(cfg Config) error {
	for _, e := range cfg.Env {
		k, _, ok := strings.Cut(e, "=")
		if !ok || k == "" {
			return errdefs.Invalid("env", "entry %q is not K=V; write it as NAME=value", e)
		}
	}
	if cfg.Workdir != "" && !filepath.IsAbs(cfg.Workdir) {
		return errdefs.Invalid("workdir", "%q is relative; use an absolute path such as /home/user", cfg.Workdir)
	}
	if strings.ContainsAny(cfg.User, " \t\n") {
		return errdefs.Invalid("user", "%q contains whitespace; use a user name or uid[:gid]", cfg.User)
	}
	return nil
}

// Store is an image store in one directory. It is safe for concurrent use by
// goroutines and by several processes sharing the directory.
type Store struct {
	dir string
}

// Open opens (creating if needed) the store in dir and removes what crashed
// imports left behind.
func Open(dir string) (*Store, error) {
	if dir == "" {
		return nil, errdefs.Invalid("data_dir", "image store directory is empty; pass a directory")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("image store path: %w", err)
	}
	s := &Store{dir: abs}
	for _, d := range []string{s.dir, s.path("content"), s.path("refs"), s.path("holds"), s.path("tmp")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("create image store: %w", err)
		}
	}
	if err := s.cleanTmp(); err != nil {
		return nil, err
	}
	return s, nil
}

// Dir is the store's directory.
func (s *Store) Dir() string { return s.dir }

func (s *Store) path(elem ...string) string {
	return filepath.Join(append([]string{s.dir}, elem...)...)
}

func (s *Store) refPath(name string) string {
	return s.path("refs", url.PathEscape(name)+".json")
}

func contentHex(id string) (string, error) {
	h, ok := strings.CutPrefix(id, "sha256:")
	if !ok || len(h) != 64 {
		return "", fmt.Errorf("image id %q: %w", id, errdefs.ErrInternal)
	}
	if _, err := hex.DecodeString(h); err != nil {
		return "", fmt.Errorf("image id %q: %w", id, errdefs.ErrInternal)
	}
	return h, nil
}

func (s *Store) contentDir(id string) (string, error) {
	h, err := contentHex(id)
	if err != nil {
		return "", err
	}
	return s.path("content", h), nil
}

// ImportDir copies the root filesystem at src into the store as name,
// preserving modes, owners (when root), symlinks, hard links, fifos, xattrs
// where the filesystem allows and times. Device files and sockets are
// skipped. An existing name is replaced atomically; its old content stays
// valid for sandboxes that use it.
func (s *Store) ImportDir(ctx context.Context, name, src string, cfg Config, opts ...ImportOption) (Image, error) {
	if src == "" {
		return Image{}, errdefs.Invalid("rootfs", "path is empty; pass the root filesystem directory")
	}
	root, err := filepath.EvalSymlinks(src)
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
	return s.importWith(ctx, name, cfg, opts, func(ctx context.Context, dst string, p *progress) error {
		return copyTree(ctx, root, dst, p)
	})
}

// ImportTar extracts a plain or gzip-compressed tarball of a root filesystem
// into the store as name. Entries with ".." components or absolute paths,
// and entries that would be written through a symlink, are refused and the
// store is left unchanged.
func (s *Store) ImportTar(ctx context.Context, name, tarPath string, cfg Config, opts ...ImportOption) (Image, error) {
	if tarPath == "" {
		return Image{}, errdefs.Invalid("tar", "path is empty; pass a .tar or .tar.gz of a root filesystem")
	}
	return s.importWith(ctx, name, cfg, opts, func(ctx context.Context, dst string, p *progress) error {
		return extractTarFile(ctx, tarPath, dst, p)
	})
}

func (s *Store) importWith(ctx context.Context, name string, cfg Config, opts []ImportOption, fill func(context.Context, string, *progress) error) (Image, error) {
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
	if err := fill(ctx, st.dir, p); err != nil {
		return Image{}, err
	}
	p.done()
	id, size, err := digestTree(ctx, st.dir)
	if err != nil {
		return Image{}, err
	}
	if err := syncFS(st.dir); err != nil {
		return Image{}, err
	}

	unlock, err := s.lock(ctx)
	if err != nil {
		return Image{}, err
	}
	defer unlock()
	cdir, err := s.contentDir(id)
	if err != nil {
		return Image{}, err
	}
	if _, err := os.Lstat(cdir); errors.Is(err, fs.ErrNotExist) {
		if err := os.Rename(st.dir, cdir); err != nil {
			return Image{}, fmt.Errorf("commit image content: %w", err)
		}
	} else if err != nil {
		return Image{}, fmt.Errorf("image content: %w", err)
	}
	img := Image{Name: name, ID: id, Created: time.Now().UTC(), Size: size, Config: cloneConfig(cfg)}
	if err := s.writeRef(img); err != nil {
		return Image{}, err
	}
	log.G(ctx).Info("image imported", "image", name, "id", id, "size", size, "files", p.files, "duration", time.Since(start).Round(time.Millisecond))
	return img, nil
}

type refFile struct {
	Version int `json:"version"`
	Image
}

const refVersion = 1

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
		return Image{}, fmt.Errorf("image ref %s has version %d, this build reads %d: %w", name, r.Version, refVersion, errdefs.ErrFailedPrecondition)
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
		"image %q not found (available: %s); build the base images with deploy/images/build.sh or import a root filesystem with `opendsec image import-rootfs --name NAME --rootfs DIR`",
		name, avail)
}

// Get resolves name to the runtime image a backend mounts. Its layers are
// guaranteed to exist only until the name is re-imported or removed and the
// store pruned; a sandbox that outlives that uses Hold instead.
func (s *Store) Get(ctx context.Context, name string) (runtime.Image, error) {
	img, err := s.Inspect(ctx, name)
	if err != nil {
		return runtime.Image{}, err
	}
	return s.runtimeImage(img)
}

func (s *Store) runtimeImage(img Image) (runtime.Image, error) {
	cdir, err := s.contentDir(img.ID)
	if err != nil {
		return runtime.Image{}, err
	}
	if _, err := os.Stat(cdir); err != nil {
		return runtime.Image{}, fmt.Errorf("image %s content %s: %w", img.Name, img.ID, errors.Join(errdefs.ErrInternal, err))
	}
	return runtime.Image{
		Name:    img.Name,
		Layers:  []string{cdir},
		Env:     slices.Clone(img.Config.Env),
		Workdir: img.Config.Workdir,
		User:    img.Config.User,
	}, nil
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
		name, err := url.PathUnescape(strings.TrimSuffix(e.Name(), ".json"))
		if err != nil {
			continue
		}
		img, err := s.readRef(name)
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed while listing
		}
		if err != nil {
			return nil, err
		}
		out = append(out, img)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Remove deletes the name. Its content stays until Prune, so running
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
	return syncDir(s.path("refs"))
}

// Hold resolves name like Get and records that holder (e.g. a sandbox ID)
// uses its content, so Prune keeps that content until Release(holder), even
// after the name is re-imported or removed.
func (s *Store) Hold(ctx context.Context, name, holder string) (runtime.Image, error) {
	if !holderRE.MatchString(holder) || len(holder) > 200 {
		return runtime.Image{}, errdefs.Invalid("holder", "%q is not valid; use letters, digits, '.', '_' and '-'", holder)
	}
	n, err := NormalizeName(name)
	if err != nil {
		return runtime.Image{}, err
	}
	unlock, err := s.lock(ctx)
	if err != nil {
		return runtime.Image{}, err
	}
	defer unlock()
	img, err := s.readRef(n)
	if errors.Is(err, fs.ErrNotExist) {
		return runtime.Image{}, s.notFound(ctx, name)
	} else if err != nil {
		return runtime.Image{}, err
	}
	h, err := contentHex(img.ID)
	if err != nil {
		return runtime.Image{}, err
	}
	hdir := s.path("holds", h)
	if err := os.MkdirAll(hdir, 0o755); err != nil {
		return runtime.Image{}, fmt.Errorf("hold image: %w", err)
	}
	if err := writeFileAtomic(filepath.Join(hdir, holder), []byte(img.Name+"\n")); err != nil {
		return runtime.Image{}, fmt.Errorf("hold image: %w", err)
	}
	return s.runtimeImage(img)
}

// Release drops every hold of holder. Releasing an unknown holder succeeds.
func (s *Store) Release(ctx context.Context, holder string) error {
	if !holderRE.MatchString(holder) {
		return errdefs.Invalid("holder", "%q is not valid; use letters, digits, '.', '_' and '-'", holder)
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

// PruneResult says what Prune removed.
type PruneResult struct {
	Removed []string // image IDs
	Bytes   int64
}

// Prune removes content no ref points to and no holder holds, and what
// crashed imports left in tmp/.
func (s *Store) Prune(ctx context.Context) (PruneResult, error) {
	unlock, err := s.lock(ctx)
	if err != nil {
		return PruneResult{}, err
	}
	defer unlock()
	keep := map[string]bool{}
	imgs, err := s.List(ctx)
	if err != nil {
		return PruneResult{}, err
	}
	for _, im := range imgs {
		if h, err := contentHex(im.ID); err == nil {
			keep[h] = true
		}
	}
	holds, err := os.ReadDir(s.path("holds"))
	if err != nil {
		return PruneResult{}, fmt.Errorf("prune images: %w", err)
	}
	for _, e := range holds {
		if hs, err := os.ReadDir(s.path("holds", e.Name())); err == nil && len(hs) > 0 {
			keep[e.Name()] = true
		}
	}
	ents, err := os.ReadDir(s.path("content"))
	if err != nil {
		return PruneResult{}, fmt.Errorf("prune images: %w", err)
	}
	var res PruneResult
	for _, e := range ents {
		if keep[e.Name()] {
			continue
		}
		if err := ctx.Err(); err != nil {
			return res, err
		}
		dir := s.path("content", e.Name())
		size := treeSize(dir)
		if err := removeTree(dir); err != nil {
			return res, fmt.Errorf("prune image content %s: %w", e.Name(), err)
		}
		res.Removed = append(res.Removed, "sha256:"+e.Name())
		res.Bytes += size
	}
	if err := s.cleanTmp(); err != nil {
		return res, err
	}
	return res, nil
}

func cloneConfig(c Config) Config {
	out := Config{
		Env:        slices.Clone(c.Env),
		Workdir:    c.Workdir,
		User:       c.User,
		Entrypoint: slices.Clone(c.Entrypoint),
	}
	if c.Labels != nil {
		out.Labels = make(map[string]string, len(c.Labels))
		for k, v := range c.Labels {
			out.Labels[k] = v
		}
	}
	return out
}

// inside reports whether path is dir or below it.
func inside(path, dir string) bool {
	rel, err := filepath.Rel(dir, path)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

func randomID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// progress throttles Progress reports.
type progress struct {
	fn                      func(Progress)
	files, bytes            int64
	totalFiles, totalBytes  int64
	lastFiles, lastReported int64
}

func (p *progress) add(files, bytes int64) {
	p.files += files
	p.bytes += bytes
	if p.fn == nil {
		return
	}
	if p.files-p.lastFiles >= 256 || p.bytes-p.lastReported >= 8<<20 {
		p.lastFiles, p.lastReported = p.files, p.bytes
		p.fn(Progress{Files: p.files, Bytes: p.bytes, TotalFiles: p.totalFiles, TotalBytes: p.totalBytes})
	}
}

func (p *progress) done() {
	if p.fn != nil {
		p.fn(Progress{Files: p.files, Bytes: p.bytes, TotalFiles: p.totalFiles, TotalBytes: p.totalBytes, Done: true})
	}
}
