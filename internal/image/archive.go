package image

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Reference schemes of local archives, accepted by Store.Import next to
// registry references.
const (
	// SchemeOCILayout names an OCI image layout directory:
	// "oci-layout:PATH", "oci-layout:PATH:TAG" (the
	// org.opencontainers.image.ref.name annotation) or
	// "oci-layout:PATH@sha256:DIGEST" (a manifest or index in index.json).
	SchemeOCILayout = "oci-layout:"
	// SchemeDockerArchive names a `docker save` tarball:
	// "docker-archive:PATH" (its only image) or "docker-archive:PATH:REF"
	// (the image saved as REF, e.g. team/app:v1).
	SchemeDockerArchive = "docker-archive:"
)

const refNameAnnotation = "org.opencontainers.image.ref.name"

// containerdNameAnnotation is what containerd's exporters set to the full
// image name next to refNameAnnotation.
const containerdNameAnnotation = "io.containerd.image.name"

// isArchiveRef reports whether ref names a local archive rather than a
// registry image.
func isArchiveRef(ref string) bool {
	return strings.HasPrefix(ref, SchemeOCILayout) || strings.HasPrefix(ref, SchemeDockerArchive)
}

// archiveImage is an image read from a local archive, ready to import.
type archiveImage struct {
	ref    string // as the caller wrote it, for messages
	name   string // the store name unless WithName says otherwise
	source string // Image.Source
	cf     *v1.ConfigFile
	layers []importLayer
}

// importLayer is one layer of an image being imported, from an archive or
// a registry.
type importLayer struct {
	v1.Layer
	diffID string
	// size is the stored bytes when known cheaply (0 otherwise).
	size int64
	// open returns the layer's bytes as stored (gzip, zstd or plain),
	// failing at EOF when they do not match the archive's digest for them.
	open func() (io.ReadCloser, error)
	// verify, when set, checks the stored bytes against their digest, to
	// name a damaged blob as the cause when unpacking it failed first.
	verify func() error
}

// Compressed returns the layer's stored bytes (fetchLayer reads them).
func (l importLayer) Compressed() (io.ReadCloser, error) { return l.open() }

// importArchive imports an "oci-layout:" or "docker-archive:" reference:
// the same layer handling as a registry import (whiteouts, hard links,
// devices skipped, escapes refused, every digest the archive records
// checked), and on any error the store is unchanged.
func (s *Store) importArchive(ctx context.Context, ref string, o importOptions) (Image, error) {
	var a archiveImage
	var err error
	spec := ref[strings.IndexByte(ref, ':')+1:]
	if err := s.checkImportPath(spec); err != nil {
		return Image{}, err
	}
	if spec, ok := strings.CutPrefix(ref, SchemeOCILayout); ok {
		a, err = readOCILayout(spec)
	} else if spec, ok := strings.CutPrefix(ref, SchemeDockerArchive); ok {
		a, err = readDockerArchive(spec)
	} else {
		err = errdefs.Invalid("ref", "%q is not an archive reference; use oci-layout:PATH[:TAG|@DIGEST] or docker-archive:PATH[:REF]", ref)
	}
	if err != nil {
		return Image{}, err
	}
	a.ref = ref
	if o.name != "" {
		a.name = o.name
	}
	if a.name == "" {
		return Image{}, errdefs.Invalid("name", "%s names no image (no tag in the archive); give one with --name (image.WithName), e.g. team/app:v1", ref)
	}
	if a.name, err = NormalizeName(a.name); err != nil {
		return Image{}, err
	}
	return s.importArchiveImage(ctx, a, o)
}

func (s *Store) importArchiveImage(ctx context.Context, a archiveImage, o importOptions) (Image, error) {
	return s.importLayers(ctx, a.ref, a.name, a.source, "archive", time.Now(), a.cf, a.layers, o, func(l importLayer, err error) error {
		if l.verify != nil {
			if verr := l.verify(); verr != nil {
				err = verr
			}
		}
		return archiveError(a.ref, err)
	})
}

// archiveError categorizes an error reading a local archive: errors that
// already say what is wrong pass through; the rest mean a damaged archive.
func archiveError(ref string, err error) error {
	var fe *errdefs.FieldError
	if errors.As(err, &fe) || errors.Is(err, errdefs.ErrFailedPrecondition) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if errors.Is(err, io.ErrUnexpectedEOF) || strings.Contains(err.Error(), "unexpected EOF") {
		return errdefs.Invalid("ref", "%s is truncated: %v", ref, err)
	}
	if errors.Is(err, fs.ErrNotExist) || strings.Contains(err.Error(), "not found in tar") {
		return errdefs.Invalid("ref", "%s is damaged (a file it lists is missing): %v", ref, err)
	}
	return errdefs.Invalid("ref", "%s is damaged: %v", ref, err)
}

// checkImportPath refuses an archive spec ("PATH[:TAG...]") whose path is
// not under the store's import directory (WithImportDir): a relative path,
// one outside it lexically, one with '.' or '..' elements, or one through
// a symlink below the import directory. The refusal is one message,
// whatever exists, so it reveals nothing about the host's files.
func (s *Store) checkImportPath(spec string) error {
	if s.importDir == "" {
		return nil
	}
	refuse := errdefs.Invalid("ref", "archive imports read only from under the import directory %s (config node.import_dir); copy the layout or tarball there and give its absolute path, e.g. oci-layout:%s/app:v1", s.importDir, s.importDir)
	rel, ok := strings.CutPrefix(spec, s.importDir+"/")
	if !ok || rel == "" {
		return refuse
	}
	parts := strings.Split(rel, "/")
	for _, p := range parts {
		if p == "" || p == "." || p == ".." {
			return refuse
		}
	}
	// The path ends where the tag starts (at a ':' or '@' that may also be
	// part of a name), so every prefix ending before one is checked too.
	isLink := func(p string) bool {
		fi, err := os.Lstat(p)
		return err == nil && fi.Mode()&fs.ModeSymlink != 0
	}
	cur := s.importDir
	for _, p := range parts {
		for i := 1; i < len(p); i++ {
			if (p[i] == ':' || p[i] == '@') && isLink(filepath.Join(cur, p[:i])) {
				return refuse
			}
		}
		cur = filepath.Join(cur, p)
		fi, err := os.Lstat(cur)
		if err != nil {
			break
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			return refuse
		}
	}
	return nil
}

// splitArchiveSpec splits "PATH[SEP...]" where PATH may itself contain the
// separators: the longest prefix that exists (checked by exists) is the
// path. Without any, the part before the first separator is reported.
func splitArchiveSpec(spec, seps string, exists func(string) bool) (path, rest string, ok bool) {
	if exists(spec) {
		return spec, "", true
	}
	for i := len(spec) - 1; i > 0; i-- {
		if strings.IndexByte(seps, spec[i]) >= 0 && exists(spec[:i]) {
			return spec[:i], spec[i:], true
		}
	}
	if i := strings.IndexAny(spec, seps); i > 0 {
		return spec[:i], spec[i:], false
	}
	return spec, "", false
}

func absPath(p string) string {
	if a, err := filepath.Abs(p); err == nil {
		return a
	}
	return p
}

// readOCILayout resolves "PATH[:TAG|@sha256:DIGEST]" in an OCI image
// layout to one linux/amd64 image.
func readOCILayout(spec string) (archiveImage, error) {
	const use = "use oci-layout:PATH[:TAG|@sha256:DIGEST] with PATH an OCI image layout directory (holding oci-layout and index.json)"
	if spec == "" {
		return archiveImage{}, errdefs.Invalid("ref", "oci-layout: has no path; %s", use)
	}
	isLayout := func(p string) bool {
		fi, err := os.Stat(filepath.Join(p, "index.json"))
		return err == nil && fi.Mode().IsRegular()
	}
	dir, sel, ok := splitArchiveSpec(spec, ":@", isLayout)
	if !ok {
		if fi, err := os.Stat(dir); err != nil {
			return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s: %v; %s", dir, err, use)
		} else if !fi.IsDir() {
			return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s is a file, not a directory; for a `docker save` tarball use docker-archive:%s", dir, dir)
		}
		return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s has no index.json; it is not an OCI image layout (%s)", dir, use)
	}
	var tag string
	var digest v1.Hash
	switch {
	case strings.HasPrefix(sel, "@"):
		h, err := v1.NewHash(sel[1:])
		if err != nil {
			return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s: %q is not a digest: %v; use @sha256:<64 hex digits>", dir, sel[1:], err)
		}
		digest = h
	case strings.HasPrefix(sel, ":"):
		tag = sel[1:]
		if tag == "" {
			return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s: the tag after ':' is empty; %s", dir, use)
		}
	}
	p, err := layout.FromPath(dir)
	if err != nil {
		return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s: %v", dir, err)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s: index.json is not valid: %v", dir, err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s: index.json is not valid: %v", dir, err)
	}
	if len(im.Manifests) == 0 {
		return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s holds no images (index.json lists no manifests)", dir)
	}
	var cands []v1.Descriptor
	for _, d := range im.Manifests {
		switch {
		case digest != v1.Hash{}:
			if d.Digest == digest {
				cands = append(cands, d)
			}
		case tag != "":
			if d.Annotations[refNameAnnotation] == tag || d.Annotations[containerdNameAnnotation] == tag {
				cands = append(cands, d)
			}
		default:
			cands = append(cands, d)
		}
	}
	if len(cands) > 1 {
		// Several platforms of one tag, as containerd exports them.
		var plat []v1.Descriptor
		for _, d := range cands {
			if d.Platform != nil && d.Platform.Satisfies(Platform) {
				plat = append(plat, d)
			}
		}
		if len(plat) > 0 {
			cands = plat
		}
	}
	switch {
	case len(cands) == 0 && digest != v1.Hash{}:
		return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s has no manifest %s in its index.json (it holds %s)", dir, digest, layoutContents(im))
	case len(cands) == 0:
		return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s has no image tagged %q (it holds %s)", dir, tag, layoutContents(im))
	case len(cands) > 1:
		return archiveImage{}, errdefs.Invalid("ref", "oci-layout %s holds %d images; pick one with oci-layout:%s:TAG or @sha256:DIGEST (it holds %s)", dir, len(cands), dir, layoutContents(im))
	}
	desc := cands[0]
	img, err := layoutImage(idx, desc, 0)
	if err != nil {
		return archiveImage{}, archiveError("oci-layout "+dir, err)
	}
	a, err := layoutArchiveImage(dir, img)
	if err != nil {
		return archiveImage{}, archiveError("oci-layout "+dir, err)
	}
	refName := desc.Annotations[refNameAnnotation]
	if n := desc.Annotations[containerdNameAnnotation]; n != "" {
		refName = n
	}
	a.name = layoutStoreName(dir, refName, tag)
	return a, nil
}

// layoutImage opens desc from idx, descending into nested indexes (a
// multi-arch image) to the linux/amd64 image.
func layoutImage(idx v1.ImageIndex, desc v1.Descriptor, depth int) (v1.Image, error) {
	if !desc.MediaType.IsIndex() {
		img, err := idx.Image(desc.Digest)
		if err != nil {
			return nil, err
		}
		got, err := img.Digest()
		if err != nil {
			return nil, err
		}
		if got != desc.Digest {
			return nil, errdefs.Invalid("ref", "manifest %s has digest %s; the layout is damaged or was tampered with", desc.Digest, got)
		}
		return img, nil
	}
	if depth > 4 {
		return nil, errdefs.Invalid("ref", "image indexes nest more than 4 deep at %s; the layout is damaged", desc.Digest)
	}
	child, err := idx.ImageIndex(desc.Digest)
	if err != nil {
		return nil, err
	}
	if got, err := child.Digest(); err != nil {
		return nil, err
	} else if got != desc.Digest {
		return nil, errdefs.Invalid("ref", "index %s has digest %s; the layout is damaged or was tampered with", desc.Digest, got)
	}
	im, err := child.IndexManifest()
	if err != nil {
		return nil, err
	}
	var plats []string
	for _, d := range im.Manifests {
		if d.Platform != nil && d.Platform.Satisfies(Platform) {
			return layoutImage(child, d, depth+1)
		}
		if d.Platform != nil {
			plats = append(plats, d.Platform.String())
		}
	}
	return nil, errdefs.New(errdefs.ErrFailedPrecondition, "index %s has no %s image (it has %s); only %s runs here", desc.Digest, Platform.String(), strings.Join(plats, ", "), Platform.String())
}

// layoutArchiveImage reads img's config and layers, checking the config
// against its digest; each layer's blob is checked as it is read.
func layoutArchiveImage(dir string, img v1.Image) (archiveImage, error) {
	m, err := img.Manifest()
	if err != nil {
		return archiveImage{}, err
	}
	cn, err := img.ConfigName()
	if err != nil {
		return archiveImage{}, err
	}
	if cn != m.Config.Digest {
		return archiveImage{}, errdefs.Invalid("ref", "config %s has digest %s; the layout is damaged or was tampered with", m.Config.Digest, cn)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return archiveImage{}, err
	}
	ls, err := img.Layers()
	if err != nil {
		return archiveImage{}, err
	}
	digest, err := img.Digest()
	if err != nil {
		return archiveImage{}, err
	}
	a := archiveImage{cf: cf, source: SchemeOCILayout + absPath(dir) + "@" + digest.String()}
	for i, l := range ls {
		if i >= len(cf.RootFS.DiffIDs) {
			break // reported by importArchiveImage
		}
		d, err := l.Digest()
		if err != nil {
			return archiveImage{}, err
		}
		size, err := l.Size()
		if err != nil {
			return archiveImage{}, err
		}
		open := func() (io.ReadCloser, error) {
			rc, err := l.Compressed()
			if err != nil {
				return nil, err
			}
			return &verifyingReader{rc: rc, h: sha256.New(), want: d, size: size}, nil
		}
		a.layers = append(a.layers, importLayer{
			Layer:  l,
			diffID: cf.RootFS.DiffIDs[i].String(),
			size:   size,
			open:   open,
			verify: func() error {
				rc, err := open()
				if err != nil {
					return err
				}
				defer rc.Close()
				_, err = io.Copy(io.Discard, rc)
				return err
			},
		})
	}
	return a, nil
}

// layoutStoreName is the default store name of a layout image: its ref
// name annotation when that is a full reference, else the layout
// directory's name with the tag.
func layoutStoreName(dir, refName, tag string) string {
	if refName != "" && strings.ContainsAny(refName, "/:") {
		if n, err := NameFromRef(refName); err == nil {
			return n
		}
	}
	if tag == "" {
		tag = refName
	}
	base := strings.ToLower(filepath.Base(absPath(dir)))
	if tag != "" {
		base += ":" + tag
	}
	if n, err := NormalizeName(base); err == nil {
		return n
	}
	return ""
}

// layoutContents lists index.json's images for error messages.
func layoutContents(im *v1.IndexManifest) string {
	var out []string
	for _, d := range im.Manifests {
		s := d.Digest.String()
		if t := d.Annotations[refNameAnnotation]; t != "" {
			s = "tag " + t + " (" + s + ")"
		}
		out = append(out, s)
	}
	return strings.Join(out, ", ")
}

// verifyingReader fails at EOF when what it read is not size bytes with
// digest want.
type verifyingReader struct {
	rc   io.ReadCloser
	h    hash.Hash
	want v1.Hash
	size int64
	n    int64
}

func (v *verifyingReader) Read(b []byte) (int, error) {
	n, err := v.rc.Read(b)
	v.h.Write(b[:n])
	v.n += int64(n)
	if errors.Is(err, io.EOF) {
		if v.n != v.size {
			return n, errdefs.Invalid("ref", "blob %s is %d bytes but the manifest says %d; the layout is damaged or truncated", v.want, v.n, v.size)
		}
		if got := fmt.Sprintf("%s:%x", v.want.Algorithm, v.h.Sum(nil)); got != v.want.String() {
			return n, errdefs.Invalid("ref", "blob %s has digest %s; the layout is damaged or was tampered with", v.want, got)
		}
	}
	return n, err
}

func (v *verifyingReader) Close() error { return v.rc.Close() }

// readDockerArchive resolves "PATH[:REF]" in a `docker save` tarball.
func readDockerArchive(spec string) (archiveImage, error) {
	const use = "use docker-archive:PATH[:REF] with PATH a `docker save` tarball"
	if spec == "" {
		return archiveImage{}, errdefs.Invalid("ref", "docker-archive: has no path; %s", use)
	}
	isFile := func(p string) bool {
		fi, err := os.Stat(p)
		return err == nil && !fi.IsDir()
	}
	file, sel, ok := splitArchiveSpec(spec, ":", isFile)
	if !ok {
		if _, err := os.Stat(file); err != nil {
			return archiveImage{}, errdefs.Invalid("ref", "docker-archive %s: %v; %s", file, err, use)
		}
		return archiveImage{}, errdefs.Invalid("ref", "docker-archive %s is a directory; for an OCI image layout use oci-layout:%s", file, file)
	}
	fi, err := os.Stat(file)
	if err != nil {
		return archiveImage{}, errdefs.Invalid("ref", "docker-archive %s: %v", file, err)
	}
	if !fi.Mode().IsRegular() {
		return archiveImage{}, errdefs.Invalid("ref", "docker-archive %s is not a regular file; %s", file, use)
	}
	if fi.Size() == 0 {
		return archiveImage{}, errdefs.Invalid("ref", "docker-archive %s is empty (0 bytes); %s", file, use)
	}
	ref := strings.TrimPrefix(sel, ":")
	if sel != "" && ref == "" {
		return archiveImage{}, errdefs.Invalid("ref", "docker-archive %s: the image reference after ':' is empty; %s", file, use)
	}
	opener := func() (io.ReadCloser, error) { return os.Open(file) }
	what := "docker-archive " + file
	man, err := tarball.LoadManifest(opener)
	if err != nil {
		if strings.Contains(err.Error(), "not found in tar") {
			if terr := readTarToEnd(file); terr != nil {
				return archiveImage{}, archiveError(what, terr) // truncated before manifest.json
			}
			return archiveImage{}, errdefs.Invalid("ref", "%s has no manifest.json; it is not a `docker save` tarball (for a root filesystem tarball use `opendsec image import-tar`)", what)
		}
		return archiveImage{}, archiveError(what, err)
	}
	var tags []string
	for _, d := range man {
		tags = append(tags, d.RepoTags...)
	}
	avail := strings.Join(tags, ", ")
	if avail == "" {
		avail = "no tags"
	}
	var tag *name.Tag
	var storeName string
	switch {
	case len(man) == 0:
		return archiveImage{}, errdefs.Invalid("ref", "%s holds no images (its manifest.json is empty)", what)
	case ref != "":
		t, err := name.NewTag(ref)
		if err != nil {
			return archiveImage{}, errdefs.Invalid("ref", "%s: %q is not an image reference: %v; use a tag it holds (%s)", what, ref, err, avail)
		}
		found := false
		for _, d := range man {
			for _, rt := range d.RepoTags {
				if x, err := name.NewTag(rt); err == nil && x.Name() == t.Name() {
					found = true
				}
			}
		}
		if !found {
			return archiveImage{}, errdefs.Invalid("ref", "%s has no image tagged %s (it holds %s)", what, ref, avail)
		}
		tag = &t
		storeName, _ = NameFromRef(ref)
	case len(man) > 1:
		return archiveImage{}, errdefs.Invalid("ref", "%s holds %d images; pick one with docker-archive:%s:REF (it holds %s)", what, len(man), file, avail)
	default:
		if len(man[0].RepoTags) > 0 {
			storeName, _ = NameFromRef(man[0].RepoTags[0])
		}
	}
	img, err := tarball.Image(opener, tag)
	if err != nil {
		return archiveImage{}, archiveError(what, err)
	}
	cn, err := img.ConfigName()
	if err != nil {
		return archiveImage{}, archiveError(what, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return archiveImage{}, archiveError(what, err)
	}
	a := archiveImage{cf: cf, name: storeName, source: SchemeDockerArchive + absPath(file) + "@" + cn.String()}
	// Only the diff_ids are recorded in a docker-archive; each layer is
	// read uncompressed (decompressed by go-containerregistry when stored
	// compressed) and checked against its diff_id.
	for i, h := range cf.RootFS.DiffIDs {
		l, err := img.LayerByDiffID(h)
		if err != nil {
			return archiveImage{}, archiveError(what, fmt.Errorf("layer %d: %w", i+1, err))
		}
		a.layers = append(a.layers, importLayer{Layer: l, diffID: h.String(), open: l.Uncompressed})
	}
	return a, nil
}

// readTarToEnd reads the tar file's headers to its end, to tell a damaged
// or truncated tarball from one that merely lacks a file.
func readTarToEnd(file string) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		if _, err := tr.Next(); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return err
		}
	}
}
