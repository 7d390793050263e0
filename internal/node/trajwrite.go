package node

import (
	"bufio"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// File writes in the trajectory log. Every POST /files (the agent's upload
// route: the apiserver's WriteFile, E2B's files.write) through the agent
// proxy is a KindFileWrite call: its target path (FilePathHeader, else
// ?path=), the user, the sha256 and size of the content (hashed as it
// streams to the agent, after any Content-Encoding; for a multipart
// upload, of each file part), and the agent's answer (status and body). A
// write whose CallIDHeader is in the log is not written again: its body is
// read and hashed only, and the recorded answer is sent (ReplayedHeader)
// when it is the same content, or the write is refused
// (failed_precondition, naming both) when it is not.

// FilePathHeader names the path a write is logged under
// (trajectory.FilePathHeader).
const FilePathHeader = trajectory.FilePathHeader

// maxRecordedWriteAnswer bounds the agent's answer kept in the log.
const maxRecordedWriteAnswer = 64 << 10

func fileWriteRequestOf(r *http.Request) trajectory.Request {
	q := r.URL.Query()
	p := r.Header.Get(FilePathHeader)
	if p == "" {
		p = q.Get("path")
	}
	u := q.Get("username")
	if u == "" {
		u = basicUserOf(r.Header)
	}
	return trajectory.Request{Kind: trajectory.KindFileWrite, Path: p, User: u}
}

// serveTrajWrite serves a POST /files through the log; forward sends it
// on to the agent.
func (n *Node) serveTrajWrite(w http.ResponseWriter, r *http.Request, sb *sandbox, forward func(http.ResponseWriter, *http.Request)) {
	callID := r.Header.Get(CallIDHeader)
	req := fileWriteRequestOf(r)
	lg, err := n.trajLog(sb)
	if err != nil {
		writeJSONError(w, err)
		return
	}
	c, prior, err := lg.Begin(callID, req, 0)
	if err != nil {
		writeJSONError(w, err)
		return
	}
	if prior != nil {
		n.replayWrite(w, r, lg, prior, req)
		return
	}
	w.Header().Set(CallSeqHeader, strconv.FormatUint(c.Seq, 10))
	h := newUploadHasher(r.Header)
	tee := &teeBody{ReadCloser: r.Body, pw: h.pw}
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = tee
	}
	rec := &answerRecorder{ResponseWriter: w}
	forward(rec, r)
	if r.ContentLength >= 0 && tee.n.Load() == r.ContentLength {
		// All of it went by; the transport's last read, the one that
		// sees the end, may still be under way.
		h.pw.Close()
	}
	h.pw.CloseWithError(errUploadCut) // a no-op when the pipe ended
	rec.mu.Lock()
	res := trajectory.Result{HTTPStatus: rec.status, Body: rec.body}
	rec.mu.Unlock()
	if res.HTTPStatus == 0 {
		res.HTTPStatus = http.StatusOK
	}
	if sum, ok := h.result(); ok {
		sum = sum.forPath(req.Path)
		res.SHA256, res.Size, res.Files = sum.SHA256, sum.Size, sum.Files
	}
	if _, err := lg.Finish(c.Seq, res); err != nil {
		log.G(n.life).Warn("record file write end", log.SandboxID(sb.id), "seq", c.Seq, log.Err(err))
	}
}

// replayWrite answers a write whose call ID the log has: its body is
// hashed (not written), then compared with the recorded write's.
func (n *Node) replayWrite(w http.ResponseWriter, r *http.Request, lg *trajectory.Log, prior *trajectory.Call, req trajectory.Request) {
	h := newUploadHasher(r.Header)
	limit := n.cfg.MaxUploadBytes
	if limit <= 0 {
		limit = 1 << 40
	}
	_, cerr := io.Copy(h.pw, io.LimitReader(r.Body, limit+64<<10+1))
	h.pw.CloseWithError(cerr)
	sum, ok := h.result()
	if ok {
		sum = sum.forPath(req.Path)
		req.SHA256, req.Size, req.Files = sum.SHA256, sum.Size, sum.Files
	}
	// A write with the same call ID still going: its answer is awaited.
	for {
		c, changed := lg.Watch(prior.Seq)
		if c == nil {
			writeJSONError(w, errdefs.New(errdefs.ErrNotFound, "call %d is gone from the trajectory log", prior.Seq))
			return
		}
		prior = c
		if c.State != trajectory.StateRunning {
			break
		}
		select {
		case <-changed:
		case <-r.Context().Done():
			return
		}
	}
	if prior.Req.HasContent() && (!ok || !prior.Req.SameContent(req)) {
		if !ok {
			req.SHA256, req.Size = "(unknown: the body did not arrive whole)", 0
		}
		writeJSONError(w, &trajectory.MismatchError{CallID: prior.CallID, Seq: prior.Seq, Recorded: prior.Req, New: req})
		return
	}
	w.Header().Set(CallSeqHeader, strconv.FormatUint(prior.Seq, 10))
	w.Header().Set(ReplayedHeader, "true")
	if prior.HTTPStatus == 0 {
		code := errdefs.ErrUnavailable
		if prior.State == trajectory.StateInterrupted {
			code = errdefs.ErrFailedPrecondition
		}
		writeJSONError(w, errdefs.New(code, "call %d (call_id %q): %s", prior.Seq, prior.CallID, prior.ErrMsg))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(prior.HTTPStatus)
	_, _ = w.Write(prior.Body)
}

var errUploadCut = errors.New("the upload ended before its body did")

// teeBody hands every byte read from the request body to a hasher.
type teeBody struct {
	io.ReadCloser
	pw *io.PipeWriter
	n  atomic.Int64
}

func (t *teeBody) Read(p []byte) (int, error) {
	k, err := t.ReadCloser.Read(p)
	if k > 0 {
		t.n.Add(int64(k))
		_, _ = t.pw.Write(p[:k]) // the hasher reads everything, or is done
	}
	switch {
	case err == io.EOF:
		t.pw.Close()
	case err != nil:
		t.pw.CloseWithError(err)
	}
	return k, err
}

// uploadSum is the content of an upload.
type uploadSum struct {
	SHA256 string
	Size   int64
	Files  []trajectory.FileRef
}

// forPath is s for a write logged under path: a multipart upload of one
// file to a named path is that file's write (the same content, whatever
// the boundary, as a plain upload of it).
func (s uploadSum) forPath(path string) uploadSum {
	if path != "" && len(s.Files) == 1 {
		return uploadSum{SHA256: s.Files[0].SHA256, Size: s.Files[0].Size}
	}
	return s
}

// uploadHasher hashes an upload's content as it streams by, in a
// goroutine reading a pipe: the content of a plain body (after gzip), or
// of each "file" part of a multipart one. It holds no more than a read
// buffer.
type uploadHasher struct {
	pw   *io.PipeWriter
	done chan struct{}
	sum  uploadSum
	ok   bool
}

func newUploadHasher(h http.Header) *uploadHasher {
	pr, pw := io.Pipe()
	u := &uploadHasher{pw: pw, done: make(chan struct{})}
	gz := false
	switch strings.ToLower(strings.TrimSpace(h.Get("Content-Encoding"))) {
	case "gzip", "x-gzip":
		gz = true
	}
	ct, params, _ := mime.ParseMediaType(h.Get("Content-Type"))
	go func() {
		defer close(u.done)
		// Whatever happens, the pipe is read to its end: the body's reader
		// never blocks on it.
		defer func() { _, _ = io.Copy(io.Discard, pr) }()
		var body io.Reader = bufio.NewReaderSize(pr, 32<<10)
		if gz {
			zr, err := gzip.NewReader(body)
			if err != nil {
				return
			}
			defer zr.Close()
			body = zr
		}
		if ct != "multipart/form-data" {
			hs := sha256.New()
			k, err := io.Copy(hs, body)
			if err != nil {
				return
			}
			u.sum = uploadSum{SHA256: hex.EncodeToString(hs.Sum(nil)), Size: k}
			u.ok = true
			return
		}
		mr := multipart.NewReader(body, params["boundary"])
		for {
			part, err := mr.NextPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				return
			}
			if part.FormName() != "file" {
				continue
			}
			_, dp, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
			hs := sha256.New()
			k, err := io.Copy(hs, part)
			if err != nil {
				return
			}
			u.sum.Files = append(u.sum.Files, trajectory.FileRef{Path: dp["filename"], SHA256: hex.EncodeToString(hs.Sum(nil)), Size: k})
		}
		// The pipe must end here too: a body cut short is not whole.
		if _, err := io.Copy(io.Discard, body); err != nil {
			return
		}
		u.ok = len(u.sum.Files) > 0
	}()
	return u
}

// result waits for the hash; ok is false unless the whole body arrived
// and parsed.
func (u *uploadHasher) result() (uploadSum, bool) {
	<-u.done
	return u.sum, u.ok
}

// answerRecorder keeps the status and the start of the body of an answer
// on its way to the client.
type answerRecorder struct {
	http.ResponseWriter
	mu     sync.Mutex
	status int
	body   []byte
}

func (a *answerRecorder) WriteHeader(code int) {
	if code >= 200 {
		a.mu.Lock()
		if a.status == 0 {
			a.status = code
		}
		a.mu.Unlock()
	}
	a.ResponseWriter.WriteHeader(code)
}

func (a *answerRecorder) Write(p []byte) (int, error) {
	a.mu.Lock()
	if a.status == 0 {
		a.status = http.StatusOK
	}
	if room := maxRecordedWriteAnswer - len(a.body); room > 0 {
		a.body = append(a.body, p[:min(room, len(p))]...)
	}
	a.mu.Unlock()
	return a.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach the writer underneath.
func (a *answerRecorder) Unwrap() http.ResponseWriter { return a.ResponseWriter }
