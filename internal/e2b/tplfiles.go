package e2b

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// DefaultMaxTemplateUpload bounds one uploaded COPY archive (as sent,
// compressed or not) and, separately, its unpacked size.
const DefaultMaxTemplateUpload = 256 << 20

// uploadURLTTL is how long a files-hash upload URL stays valid.
const uploadURLTTL = time.Hour

var filesHashRe = regexp.MustCompile(`^[0-9a-f]{64}$`)

// filesDir is where principal p's uploaded COPY archives are kept, one
// <hash>.tar (as uploaded: tar or tar.gz) each.
func (g *Gateway) filesDir(p string) string {
	h := sha256.Sum256([]byte(p))
	return filepath.Join(g.cfg.StateDir, "files", hex.EncodeToString(h[:8]))
}

func (g *Gateway) filePath(p, hash string) string {
	return filepath.Join(g.filesDir(p), hash+".tar")
}

// uploadSig signs an upload URL: principal p may PUT hash's archive for
// template tid until exp.
func (g *Gateway) uploadSig(p, tid, hash string, exp int64) string {
	m := hmac.New(sha256.New, g.cfg.Secret)
	fmt.Fprintf(m, "e2b template upload\x00%s\x00%s\x00%s\x00%d", p, tid, hash, exp)
	return hex.EncodeToString(m.Sum(nil))
}

// templateFile is GET /templates/{templateID}/files/{hash} → 201 {present,
// url?}: whether the caller's archive of that hash is here, and if not a
// signed URL on this gateway to PUT it to.
func (g *Gateway) templateFile(w http.ResponseWriter, r *http.Request) {
	p := principal(r.Context())
	tid, hash := r.PathValue("id"), r.PathValue("hash")
	if _, ok := g.tpls.get(p, tid); !ok {
		writeError(w, http.StatusNotFound, "template %q not found", tid)
		return
	}
	if !filesHashRe.MatchString(hash) {
		writeError(w, http.StatusBadRequest, "hash: %q is not a files hash (64 lowercase hex digits, the SDK's sha256 of the COPY step's files)", hash)
		return
	}
	if _, err := os.Stat(g.filePath(p, hash)); err == nil {
		writeJSON(w, http.StatusCreated, map[string]any{"present": true})
		return
	}
	exp := time.Now().Add(uploadURLTTL).Unix()
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	u := fmt.Sprintf("%s://%s/templates/%s/files/%s?p=%s&expires=%d&signature=%s", scheme, r.Host, tid, hash,
		hex.EncodeToString([]byte(p)), exp, g.uploadSig(p, tid, hash, exp))
	writeJSON(w, http.StatusCreated, map[string]any{"present": false, "url": u})
}

// uploadTemplateFile is PUT /templates/{templateID}/files/{hash}?p=&expires=&signature=
// (the URL templateFile signed; no API key, as with E2B's storage URLs):
// the COPY step's archive, tar or tar.gz, with an exact Content-Length.
// It is checked to be an archive of relative paths within the size bounds
// and kept; its hash is checked against the COPY step that uses it when
// the build starts (the hash covers the step's source and destination).
func (g *Gateway) uploadTemplateFile(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	tid, hash := r.PathValue("id"), r.PathValue("hash")
	pb, err := hex.DecodeString(q.Get("p"))
	exp, err2 := strconv.ParseInt(q.Get("expires"), 10, 64)
	if err != nil || err2 != nil || !filesHashRe.MatchString(hash) ||
		!hmac.Equal([]byte(q.Get("signature")), []byte(g.uploadSig(string(pb), tid, hash, exp))) {
		writeError(w, http.StatusForbidden, "upload URL is not valid; ask GET /templates/%s/files/%s for a new one", tid, hash)
		return
	}
	if time.Now().Unix() > exp {
		writeError(w, http.StatusForbidden, "upload URL expired; ask GET /templates/%s/files/%s for a new one", tid, hash)
		return
	}
	p := string(pb)
	if _, ok := g.tpls.get(p, tid); !ok {
		writeError(w, http.StatusNotFound, "template %q not found", tid)
		return
	}
	limit := g.maxUpload()
	if r.ContentLength < 0 {
		writeError(w, http.StatusLengthRequired, "Content-Length is required")
		return
	}
	if r.ContentLength > limit {
		writeError(w, http.StatusRequestEntityTooLarge, "the archive is %d bytes; at most %d are accepted", r.ContentLength, limit)
		return
	}
	dir := g.filesDir(p)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		writeErr(w, fmt.Errorf("template files: %w", err))
		return
	}
	f, err := os.CreateTemp(dir, ".upload-*")
	if err != nil {
		writeErr(w, fmt.Errorf("template files: %w", err))
		return
	}
	defer func() {
		f.Close()
		os.Remove(f.Name())
	}()
	n, err := io.Copy(f, io.LimitReader(r.Body, r.ContentLength+1))
	if err != nil {
		writeError(w, http.StatusBadRequest, "read the archive: %s", err)
		return
	}
	if n != r.ContentLength {
		writeError(w, http.StatusBadRequest, "the body is %d bytes, not the Content-Length %d", n, r.ContentLength)
		return
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		writeErr(w, err)
		return
	}
	if err := checkArchive(f, limit); err != nil {
		writeErr(w, err)
		return
	}
	if err := f.Close(); err != nil {
		writeErr(w, err)
		return
	}
	if err := os.Rename(f.Name(), g.filePath(p, hash)); err != nil {
		writeErr(w, fmt.Errorf("template files: %w", err))
		return
	}
	sweepFiles(dir)
	w.WriteHeader(http.StatusOK)
}

// uploadTTL is how long an uploaded archive no build used is kept.
const uploadTTL = 7 * 24 * time.Hour

// sweepFiles removes a principal's uploads and stale partial uploads no
// build used for uploadTTL (a build's use renews them).
func sweepFiles(dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > uploadTTL {
			_ = os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}

func (g *Gateway) maxUpload() int64 {
	if g.cfg.MaxTemplateUpload > 0 {
		return g.cfg.MaxTemplateUpload
	}
	return DefaultMaxTemplateUpload
}

// archiveReader reads r as a tar, gunzipping it first when it is gzipped.
func archiveReader(r io.Reader) (*tar.Reader, error) {
	br := bufio.NewReader(r)
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, err
		}
		return tar.NewReader(zr), nil
	}
	return tar.NewReader(br), nil
}

// entryName is a tar entry's path, cleaned; it must stay relative.
func entryName(name string) (string, error) {
	n := strings.TrimSuffix(name, "/")
	c := path.Clean(n)
	if n == "" || path.IsAbs(n) || c == ".." || strings.HasPrefix(c, "../") {
		return "", fmt.Errorf("entry %q is not a path inside the context", name)
	}
	return c, nil
}

// checkArchive reads an uploaded archive through: only files,
// directories, symlinks and hard links to earlier entries, relative
// paths, at most limit bytes unpacked.
func checkArchive(r io.Reader, limit int64) error {
	bad := func(format string, args ...any) error {
		return errdefs.New(errdefs.ErrInvalidArgument, "the archive is not a COPY upload: "+format, args...)
	}
	tr, err := archiveReader(r)
	if err != nil {
		return bad("%s", err)
	}
	seen := map[string]bool{}
	var total int64
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return bad("%s", err)
		}
		name, err := entryName(h.Name)
		if err != nil {
			return bad("%s", err)
		}
		switch h.Typeflag {
		case tar.TypeReg, tar.TypeDir, tar.TypeSymlink:
		case tar.TypeLink:
			t, err := entryName(h.Linkname)
			if err != nil || !seen[t] {
				return bad("hard link %q does not name an earlier entry", h.Name)
			}
		default:
			return bad("entry %q is not a file, directory or link", h.Name)
		}
		seen[name] = true
		n, err := io.Copy(io.Discard, tr)
		if err != nil {
			return bad("%s", err)
		}
		if total += n; total > limit {
			return errdefs.New(errdefs.ErrInvalidArgument, "the archive unpacks to more than %d bytes", limit)
		}
	}
	return nil
}

// jsDirSizes are the directory sizes tried for the JS SDK's files hash,
// which hashes a directory's st_size (not in the archive): ext4's.
var jsDirSizes = []int64{4096}

// checkFilesHash reports whether want is the files hash of a COPY step
// (src, dest) over its uploaded archive, by the Python SDK's rule or the
// JS SDK's (which also hashes directories' sizes).
func checkFilesHash(open func() (io.ReadCloser, error), src, dest, want string) bool {
	if got, err := filesHash(open, src, dest, -1); err == nil && got == want {
		return true
	}
	for _, size := range jsDirSizes {
		if got, err := filesHash(open, src, dest, size); err == nil && got == want {
			return true
		}
	}
	return false
}

// filesHash computes the E2B SDKs' files hash of a COPY step (src, dest)
// from its uploaded archive: sha256 of "COPY src dest", then for each
// entry in order its relative path, st_mode in decimal, size (for
// directories only when dirSize >= 0, as dirSize; a symlink's is its
// target's length), and then a file's content or a symlink's target.
func filesHash(open func() (io.ReadCloser, error), src, dest string, dirSize int64) (string, error) {
	f, err := open()
	if err != nil {
		return "", err
	}
	defer f.Close()
	tr, err := archiveReader(f)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "COPY %s %s", src, dest)
	for {
		hd, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return "", err
		}
		name, err := entryName(hd.Name)
		if err != nil {
			return "", err
		}
		perm := hd.Mode & 0o7777
		h.Write([]byte(name))
		switch hd.Typeflag {
		case tar.TypeDir:
			h.Write([]byte(strconv.FormatInt(0o040000|perm, 10)))
			if dirSize >= 0 {
				h.Write([]byte(strconv.FormatInt(dirSize, 10)))
			}
		case tar.TypeSymlink:
			h.Write([]byte(strconv.FormatInt(0o120000|perm, 10)))
			h.Write([]byte(strconv.Itoa(len(hd.Linkname))))
			h.Write([]byte(hd.Linkname))
		case tar.TypeReg:
			h.Write([]byte(strconv.FormatInt(0o100000|perm, 10)))
			h.Write([]byte(strconv.FormatInt(hd.Size, 10)))
			if _, err := io.Copy(h, tr); err != nil {
				return "", err
			}
		case tar.TypeLink:
			// A second name of an earlier file: its content again.
			target, _ := entryName(hd.Linkname)
			if _, err := linkedContent(open, target, h, perm); err != nil {
				return "", err
			}
		}
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// linkedContent writes the mode, size and content of the regular file
// entry target (of the archive open reads) to h.
func linkedContent(open func() (io.ReadCloser, error), target string, h hash.Hash, perm int64) (int64, error) {
	f, err := open()
	if err != nil {
		return 0, err
	}
	defer f.Close()
	tr, err := archiveReader(f)
	if err != nil {
		return 0, err
	}
	for {
		hd, err := tr.Next()
		if err != nil {
			return 0, fmt.Errorf("hard link to %q: %w", target, err)
		}
		if n, _ := entryName(hd.Name); n == target && hd.Typeflag == tar.TypeReg {
			h.Write([]byte(strconv.FormatInt(0o100000|perm, 10)))
			h.Write([]byte(strconv.FormatInt(hd.Size, 10)))
			return io.Copy(h, tr)
		}
	}
}

// writeContext writes the build context tar: each archive (by hash) under
// files/<hash>/.
func writeContext(w io.Writer, archives map[string]string) error {
	tw := tar.NewWriter(w)
	hdr := func(name string) *tar.Header {
		return &tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: 0o755, ModTime: time.Unix(0, 0)}
	}
	if err := tw.WriteHeader(hdr("files/")); err != nil {
		return err
	}
	for hash, file := range archives {
		prefix := "files/" + hash + "/"
		if err := tw.WriteHeader(hdr(prefix)); err != nil {
			return err
		}
		if err := copyArchive(tw, file, prefix); err != nil {
			return err
		}
	}
	return tw.Close()
}

func copyArchive(tw *tar.Writer, file, prefix string) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	tr, err := archiveReader(f)
	if err != nil {
		return err
	}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name, err := entryName(h.Name)
		if err != nil {
			return err
		}
		out := &tar.Header{Name: prefix + name, Typeflag: h.Typeflag, Mode: h.Mode & 0o7777, Size: h.Size,
			Linkname: h.Linkname, ModTime: h.ModTime, Uid: 0, Gid: 0}
		switch h.Typeflag {
		case tar.TypeDir:
			out.Name += "/"
		case tar.TypeLink:
			t, err := entryName(h.Linkname)
			if err != nil {
				return err
			}
			out.Linkname = prefix + t
		case tar.TypeReg, tar.TypeSymlink:
		default:
			return fmt.Errorf("entry %q: unsupported type", h.Name)
		}
		if err := tw.WriteHeader(out); err != nil {
			return err
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := io.Copy(tw, tr); err != nil {
				return err
			}
		}
	}
}
