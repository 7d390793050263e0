// Package image is OpenDsec's image store: content-addressed read-only
// layers, images as manifests (ordered layers plus config) named by
// name:tag, imports from a root filesystem directory, a tarball or an OCI
// registry, and the node-side mounts a sandbox's overlayfs root stacks.
//
// Layout of a store directory (shared by every node of a cluster):
//
//	lock                  flock(2) file serializing commits across processes
//	layers/<hex>/         one layer, named by the sha256 of its content (the
//	                      OCI diff_id, or the tree digest of a directory import)
//	  layer.json          format, sizes, digest of the EROFS file
//	  layer.erofs         the layer as an EROFS image (mounted read-only), or
//	  dir/                the layer as a plain directory (the fallback)
//	manifests/<hex>.json  an image: ordered layer digests and config; <hex> is
//	                      the image ID
//	refs/<name>.json      name -> image (written with rename, so atomic)
//	holds/<hex>/<holder>  images running sandboxes use (see Hold, Release)
//	tmp/                  imports in progress, each guarded by its own flock
//
// Layers use OverlayFS's own whiteout format (a 0/0 character device for a
// deleted path, the trusted.overlay.opaque xattr for a replaced directory),
// so a sandbox's root is overlayfs over the layers as they are.
//
// Mounts are node-local state kept in a mount directory (WithMountDir):
//
//	lock                  flock(2) file serializing mounts on this node
//	<hex>/                an EROFS layer mounted read-only
//	refs/<hex>/<holder>   holders using that mount; the last Release unmounts
//	                      (hard links of anchors/<hex>: no new inode per holder)
//	anchors/<hex>         the empty file every ref of layer <hex> is a link of
//
// Mounts are kernel state and outlive the process, so a restarted node finds
// them again by looking at the mount points.
package image

import (
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/kernflux/opendsec/internal/errdefs"
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
	Cmd        []string          `json:"cmd,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
	// StartCmd is a shell command run when a sandbox of the image starts
	// (E2B templates' start command); ReadyCmd is run until it exits 0 to
	// say the started command is ready. Both are kept from a build.
	StartCmd string `json:"start_cmd,omitempty"`
	ReadyCmd string `json:"ready_cmd,omitempty"`
	// ExposedPorts are the ports EXPOSE named ("8080/tcp"), for people.
	ExposedPorts []string `json:"exposed_ports,omitempty"`
}

// Image describes one imported image.
type Image struct {
	// Name is normalized, always with a tag ("root/busybox:latest").
	Name string `json:"name"`
	// ID is "sha256:<hex>", the digest of the image's manifest (its layers
	// and config): the same layers and config give the same ID.
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
	// Size is the bytes of file content in all layers.
	Size int64 `json:"size"`
	// Layers are the layers bottom first, as in OCI.
	Layers []Layer `json:"layers"`
	Config Config  `json:"config"`
	// Source is where the image came from: a registry reference with its
	// manifest digest, "dir:<path>" or "tar:<path>".
	Source string `json:"source,omitempty"`
}

// Layer is one read-only layer of an image.
type Layer struct {
	// Digest is "sha256:<hex>" of the layer's content: the OCI diff_id (the
	// uncompressed tar) for registry layers, the tree digest for directories.
	Digest string `json:"digest"`
	// Size is the bytes of file content in the layer.
	Size int64 `json:"size"`
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
	name     string
	remote   []remote.Option
	merge    bool
	insecure bool
	// internalRegistry: the caller is an admin, so a registry import may
	// connect to internal addresses (WithInternalRegistry).
	internalRegistry bool
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

func urlEscape(s string) string { return url.PathEscape(s) }

func urlUnescape(s string) (string, error) { return url.PathUnescape(s) }

func cloneConfig(c Config) Config {
	out := Config{
		Env:        slices.Clone(c.Env),
		Workdir:    c.Workdir,
		User:       c.User,
		Entrypoint: slices.Clone(c.Entrypoint),
		Cmd:        slices.Clone(c.Cmd),
		StartCmd:   c.StartCmd,
		ReadyCmd:   c.ReadyCmd,

		ExposedPorts: slices.Clone(c.ExposedPorts),
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
