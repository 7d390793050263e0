package agent

import (
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/envdsig"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// fileAuth applies envd's /files rules: with a token configured, either
// X-Access-Token matches, or a v1_ signature over path, operation, username
// (and expiration) does.
func (a *Agent) fileAuth(r *http.Request, op string) (status int, msg string) {
	if a.cfg.AccessToken == "" {
		return 0, ""
	}
	if tok := r.Header.Get("X-Access-Token"); tok != "" {
		if a.tokenOK(tok) {
			return 0, ""
		}
		return http.StatusUnauthorized, unauthorizedMsg
	}
	return envdsig.CheckQuery(r.URL.Query(), op, a.cfg.AccessToken, time.Now())
}

// Signature is envd's file URL signature (see envdsig.Sign).
func Signature(path, op, username, token, expiration string) string {
	return envdsig.Sign(path, op, username, token, expiration)
}

// fileUser resolves ?username= (default user when absent).
func (a *Agent) fileUser(r *http.Request) (*user, error) {
	name := r.URL.Query().Get("username")
	if name == "" {
		name = a.cfg.DefaultUser
	}
	return a.users.lookup(name)
}

func (a *Agent) serveDownload(w http.ResponseWriter, r *http.Request) {
	if status, msg := a.fileAuth(r, "read"); status != 0 {
		writeError(w, status, msg)
		return
	}
	usr, err := a.fileUser(r)
	if err != nil {
		writeErr(w, err)
		return
	}
	raw := r.URL.Query().Get("path")
	if raw == "" {
		writeError(w, http.StatusBadRequest, "path: missing; pass ?path=<file to read>")
		return
	}
	p, err := resolvePath("path", raw, usr.Home)
	if err != nil {
		writeErr(w, err)
		return
	}
	f, err := os.Open(p)
	if err != nil {
		writeErr(w, fsErr("open", p, err))
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		writeErr(w, fsErr("stat", p, err))
		return
	}
	if st.IsDir() {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is a directory; read a file, or list the directory", p))
		return
	}
	name := filepath.Base(p)
	w.Header().Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": name}))
	w.Header().Add("Vary", "Accept-Encoding")
	gz, identity := acceptEncoding(r.Header.Get("Accept-Encoding"))
	plain := r.Header.Get("Range") != "" || r.Header.Get("If-Match") != "" || r.Header.Get("If-None-Match") != "" ||
		r.Header.Get("If-Modified-Since") != "" || r.Header.Get("If-Unmodified-Since") != "" || st.Size() == 0
	if gz && !plain {
		ct := mime.TypeByExtension(filepath.Ext(name))
		if ct == "" {
			ct = "application/octet-stream"
		}
		w.Header().Set("Content-Type", ct)
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Last-Modified", st.ModTime().UTC().Format(http.TimeFormat))
		w.WriteHeader(http.StatusOK)
		if r.Method == http.MethodHead {
			return
		}
		zw := gzip.NewWriter(w)
		io.Copy(zw, f)
		zw.Close()
		return
	}
	if !identity && !plain {
		writeError(w, http.StatusNotAcceptable, "Accept-Encoding: no supported encoding; accept gzip or identity")
		return
	}
	if st.Size() == 0 {
		// Empty, or a file whose size the kernel does not report
		// (/proc, /sys: stat says 0, and seq files cannot seek to their
		// end, which ServeContent needs): stream what a read gives.
		ct := mime.TypeByExtension(filepath.Ext(name))
		if ct == "" {
			ct = "application/octet-stream"
		}
		w.Header().Set("Content-Type", ct)
		w.Header().Set("Last-Modified", st.ModTime().UTC().Format(http.TimeFormat))
		w.WriteHeader(http.StatusOK)
		if r.Method != http.MethodHead {
			io.Copy(w, f)
		}
		return
	}
	http.ServeContent(w, r, name, st.ModTime(), f)
}

// acceptEncoding reports whether gzip and identity are acceptable.
func acceptEncoding(h string) (gz, identity bool) {
	identity = true
	starQ := -1.0
	identityQ := -1.0
	for _, part := range splitComma(h) {
		if part == "" {
			continue
		}
		name, params, _ := strings.Cut(part, ";")
		q := 1.0
		if v, ok := strings.CutPrefix(strings.TrimSpace(params), "q="); ok {
			if f, err := strconv.ParseFloat(v, 64); err == nil {
				q = f
			}
		}
		switch strings.ToLower(strings.TrimSpace(name)) {
		case "gzip", "x-gzip":
			gz = q > 0
		case "identity":
			identityQ = q
		case "*":
			starQ = q
		}
	}
	if starQ > 0 && !gz && !strings.Contains(strings.ToLower(h), "gzip") {
		gz = true
	}
	if identityQ == 0 || (identityQ < 0 && starQ == 0) {
		identity = false
	}
	return gz, identity
}

// uploaded is one file of a POST /files, written to a temp file beside its
// target and renamed over it only when the whole request succeeded.
type uploaded struct {
	target  string
	tmp     string
	created []string // directories made for it
}

type uploadResult struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

func (a *Agent) serveUpload(w http.ResponseWriter, r *http.Request) {
	if status, msg := a.fileAuth(r, "write"); status != 0 {
		writeError(w, status, msg)
		return
	}
	usr, err := a.fileUser(r)
	if err != nil {
		writeErr(w, err)
		return
	}
	md, err := uploadMetadata(r.Header)
	if err != nil {
		writeErr(w, err)
		return
	}
	limit := a.cfg.MaxUploadBytes
	ct, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	multi := ct == "multipart/form-data"
	slack := int64(0)
	if multi {
		slack = 64 << 10 // part headers and boundaries
	}
	if r.ContentLength > limit+slack && r.Header.Get("Content-Encoding") == "" {
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("upload of %d bytes exceeds the limit of %d bytes", r.ContentLength, limit))
		return
	}
	body := io.Reader(r.Body)
	switch enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))); enc {
	case "", "identity":
	case "gzip", "x-gzip":
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			writeError(w, http.StatusBadRequest, "body: Content-Encoding is gzip but the body is not gzip data")
			return
		}
		defer zr.Close()
		body = zr
	default:
		writeError(w, http.StatusBadRequest, fmt.Sprintf("Content-Encoding: %q is not supported; send gzip or no encoding", enc))
		return
	}

	var done []*uploaded
	cleanup := func() {
		for i := len(done) - 1; i >= 0; i-- {
			os.Remove(done[i].tmp)
			a.fs.uploads.releaseTemp(done[i].tmp)
			removeCreated(done[i].created)
		}
	}
	add := func(rawPath string, src io.Reader) error {
		if rawPath == "" {
			return errdefs.Invalid("path", "missing; pass ?path=<target file> or name the multipart part's filename")
		}
		target, err := resolvePath("path", rawPath, usr.Home)
		if err != nil {
			return err
		}
		if err := a.fs.reserved.check("write", target, false); err != nil {
			return err
		}
		for _, u := range done {
			if u.target == target {
				return errdefs.Invalid("path", "'%s' is the target of more than one part; upload each file once", target)
			}
		}
		u, err := writeTemp(&a.fs.uploads, target, src, usr, md, limit)
		if u != nil {
			done = append(done, u)
		}
		return err
	}

	raw := r.URL.Query().Get("path")
	if multi {
		mr := multipart.NewReader(body, params["boundary"])
		for {
			part, perr := mr.NextPart()
			if perr == io.EOF {
				break
			}
			if perr != nil {
				err = errdefs.Invalid("body", "malformed multipart body: %s", perr)
				break
			}
			if part.FormName() != "file" {
				continue
			}
			target := raw
			if target == "" {
				// The full filename, not Part.FileName()'s basename.
				_, dp, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
				target = dp["filename"]
			}
			if err = add(target, part); err != nil {
				break
			}
		}
		if err == nil && len(done) == 0 {
			err = errdefs.Invalid("body", "no multipart part named \"file\"; send the file as form field \"file\"")
		}
	} else {
		err = add(raw, body)
	}
	if err != nil {
		cleanup()
		a.writeUploadErr(w, err)
		return
	}
	results := make([]uploadResult, 0, len(done))
	for _, u := range done {
		_, statErr := os.Lstat(u.target)
		a.fs.uploads.note(u.target, statErr == nil)
		if err := os.Rename(u.tmp, u.target); err != nil {
			cleanup()
			a.writeUploadErr(w, fsErr("write", u.target, err))
			return
		}
		a.fs.uploads.releaseTemp(u.tmp)
		results = append(results, uploadResult{Path: u.target, Name: filepath.Base(u.target), Type: "file", Metadata: md})
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(results)
}

var errTooLarge = errors.New("upload too large")

func (a *Agent) writeUploadErr(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, errTooLarge):
		writeError(w, http.StatusRequestEntityTooLarge, err.Error())
	case errors.Is(err, errdefs.ErrResourceExhausted):
		writeError(w, http.StatusInsufficientStorage, err.Error())
	default:
		writeErr(w, err)
	}
}

// writeTemp writes src to a temp file in target's directory (made if
// missing, owned by usr), with usr as owner, mode 0644 and metadata xattrs.
// temps remembers the temp file so that watchers skip it.
func writeTemp(temps *recentUploads, target string, src io.Reader, usr *user, md map[string]string, limit int64) (*uploaded, error) {
	if st, err := os.Stat(target); err == nil && st.IsDir() {
		return nil, errdefs.Invalid("path", "'%s' is a directory; name a file inside it", target)
	}
	created, err := mkdirAllAs(filepath.Dir(target), usr)
	if err != nil {
		return nil, err
	}
	f, err := temps.createTemp(filepath.Dir(target))
	if err != nil {
		removeCreated(created)
		return nil, fsErr("create", target, err)
	}
	u := &uploaded{target: target, tmp: f.Name(), created: created}
	n, err := io.Copy(f, io.LimitReader(src, limit+1))
	if err == nil && n > limit {
		err = fmt.Errorf("upload of more than %d bytes exceeds the limit of %d bytes: %w", limit, limit, errTooLarge)
	} else if err != nil {
		err = fsErr("write", target, err)
	}
	if err == nil {
		err = f.Chmod(0o644)
	}
	if err == nil {
		_ = f.Chown(int(usr.UID), int(usr.GID))
		for k, v := range md {
			if xerr := unix.Fsetxattr(int(f.Fd()), xattrPrefix+k, []byte(v), 0); xerr != nil {
				err = fmt.Errorf("set metadata %s on '%s': %w", k, target, xerr)
				break
			}
		}
	}
	if cerr := f.Close(); err == nil && cerr != nil {
		err = fsErr("write", target, cerr)
	}
	return u, err
}

// uploadMetadata collects X-Metadata-<key> headers as envd validates them.
func uploadMetadata(h http.Header) (map[string]string, error) {
	var md map[string]string
	total := 0
	for name, vals := range h {
		key, ok := strings.CutPrefix(strings.ToLower(name), "x-metadata-")
		if !ok {
			continue
		}
		if key == "" || len(key) > 246 || !printableASCII(key) {
			return nil, errdefs.Invalid("X-Metadata-"+key, "key must be 1..246 printable ASCII characters")
		}
		v := strings.Join(vals, ",")
		if !printableASCII(v) {
			return nil, errdefs.Invalid("X-Metadata-"+key, "value must be printable ASCII")
		}
		total += len(key) + len(v)
		if total > 4096 {
			return nil, errdefs.Invalid("X-Metadata", "metadata is larger than 4096 bytes; send less")
		}
		if md == nil {
			md = map[string]string{}
		}
		md[key] = v
	}
	return md, nil
}

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
