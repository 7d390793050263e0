package nodeclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// InProcessRemoteAddr is the http.Request.RemoteAddr a node's handler sees
// on requests an InProcess transport served.
const InProcessRemoteAddr = "in-process"

// acceptEncodings are the request headers by which a caller accepts a
// compressed answer (HTTP, connect's streams, gRPC): dropped in-process.
var acceptEncodings = []string{"Accept-Encoding", "Connect-Accept-Encoding", "Grpc-Accept-Encoding"}

// errBodyClosed ends a request whose caller closed the answer's body before
// its end, as a reset stream does over the network.
var errBodyClosed = errors.New("in-process node call: the caller closed the response body")

// InProcess is an http.RoundTripper that hands requests for one node (the
// node in this process: `opendsec up`) straight to that node's
// http.Handler, the same handler its listener serves, and sends every
// other request on through Next. Tokens, the node's interceptors (token
// checks, acting on behalf), connect's encoding and the mapping of errors
// at the node's edge are therefore the very ones a network call meets;
// what goes is the loopback connection, HTTP/2 framing and its
// flow-control, and the goroutines of two HTTP/2 endpoints.
//
// The handler sees an HTTP/2 request (connect's bidirectional streams need
// one) from RemoteAddr InProcessRemoteAddr, without the headers that
// accept a compressed answer (nothing crosses a wire to gain from it). Request and answer bodies
// stream through pipes, so server, client and bidirectional streams work
// as over the network; the handler's context ends when the caller's does,
// when the caller closes the answer body early, or when the handler
// returns. Connection hijacking and Upgrade (the port tunnel) are not
// served in-process: requests with an Upgrade header go through Next, to
// the node's listener.
type InProcess struct {
	scheme, host string
	h            http.Handler
	// Next carries requests for every other node, and upgrades.
	Next   http.RoundTripper
	served atomic.Uint64
}

var _ http.RoundTripper = (*InProcess)(nil)

// NewInProcess returns a transport serving requests for the node at addr
// (its base URL as the directory gives it, NodeInfo.Addr) with h, and the
// rest through next (nil: http.DefaultTransport).
func NewInProcess(addr string, h http.Handler, next http.RoundTripper) (*InProcess, error) {
	u, err := url.Parse(addr)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, errdefs.Invalid("address", "%q must be a URL like http://host:port", addr)
	}
	if h == nil {
		return nil, errdefs.Invalid("handler", "is nil; give the in-process node's handler")
	}
	if next == nil {
		next = http.DefaultTransport
	}
	return &InProcess{scheme: u.Scheme, host: u.Host, h: h, Next: next}, nil
}

// Served is how many requests the node's handler served in-process.
func (t *InProcess) Served() uint64 { return t.served.Load() }

// RoundTrip serves req in-process if it is for the local node and not an
// upgrade, else sends it through Next.
func (t *InProcess) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Host != t.host || req.URL.Scheme != t.scheme || req.Header.Get("Upgrade") != "" {
		return t.Next.RoundTrip(req)
	}
	t.served.Add(1)
	return t.serve(req)
}

// inProcessResult is the answer's head, or why there is none.
type inProcessResult struct {
	resp *http.Response
	err  error
}

func (t *InProcess) serve(req *http.Request) (*http.Response, error) {
	ctx, cancel := context.WithCancelCause(req.Context())
	body := req.Body
	if body == nil {
		body = http.NoBody
	}
	cl := req.ContentLength
	if cl == 0 && body != http.NoBody {
		cl = -1 // a client's 0 with a body means unknown
	}
	u := *req.URL
	u.Scheme, u.Host, u.User = "", "", nil
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	sreq := (&http.Request{
		Method:        req.Method,
		URL:           &u,
		Proto:         "HTTP/2.0",
		ProtoMajor:    2,
		Header:        req.Header.Clone(),
		Body:          body,
		ContentLength: cl,
		Host:          host,
		RemoteAddr:    InProcessRemoteAddr,
		RequestURI:    u.RequestURI(),
		Trailer:       req.Trailer,
	}).WithContext(ctx)
	if sreq.Header == nil {
		sreq.Header = http.Header{}
	}
	// Nothing goes over a wire: the node answers uncompressed.
	for _, k := range acceptEncodings {
		delete(sreq.Header, k)
	}
	pr, pw := io.Pipe()
	w := &inProcessWriter{
		req:    req,
		header: http.Header{},
		pw:     pw,
		body:   &inProcessBody{pr: pr, cancel: cancel},
		first:  make(chan inProcessResult, 1),
	}
	go w.run(t.h, sreq, body, cancel)
	select {
	case r := <-w.first:
		return r.resp, r.err
	case <-req.Context().Done():
		// The handler sees its context end too; its writes fail from now.
		err := context.Cause(req.Context())
		pr.CloseWithError(err)
		return nil, err
	}
}

// inProcessWriter is the node handler's http.ResponseWriter: the head goes
// to the waiting RoundTrip once written, the body through a pipe to the
// caller's Response.Body. Used by the handler's goroutine only, as a
// ResponseWriter is.
type inProcessWriter struct {
	req         *http.Request // the caller's
	header      http.Header
	pw          *io.PipeWriter
	body        *inProcessBody
	first       chan inProcessResult
	resp        *http.Response
	wroteHeader bool
}

func (w *inProcessWriter) run(h http.Handler, sreq *http.Request, body io.Closer, cancel context.CancelCauseFunc) {
	defer func() {
		p := recover()
		_ = body.Close() // as the server does; unblocks a caller still writing
		switch {
		case p == nil:
			w.finish()
		case !w.wroteHeader:
			w.pw.CloseWithError(errAborted(p))
			w.first <- inProcessResult{err: errAborted(p)}
		default:
			w.pw.CloseWithError(errAborted(p))
		}
		cancel(context.Canceled)
	}()
	h.ServeHTTP(w, sreq)
}

func errAborted(p any) error {
	if p == http.ErrAbortHandler {
		return errors.New("in-process node call: the handler aborted the response")
	}
	return fmt.Errorf("in-process node call: the handler panicked: %v", p)
}

// finish ends the answer after the handler returned: the head if it wrote
// none, its trailers, then the end of the body.
func (w *inProcessWriter) finish() {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	for k := range w.resp.Trailer {
		if vs, ok := w.header[k]; ok {
			w.resp.Trailer[k] = vs
		}
	}
	for k, vs := range w.header {
		if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			w.resp.Trailer[http.CanonicalHeaderKey(name)] = vs
		}
	}
	// The caller reads Trailer after the body's EOF, which this close
	// happens before.
	_ = w.pw.Close()
}

func (w *inProcessWriter) Header() http.Header { return w.header }

func (w *inProcessWriter) WriteHeader(code int) {
	if w.wroteHeader {
		return
	}
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		return // informational heads are not the answer
	}
	w.wroteHeader = true
	h := make(http.Header, len(w.header))
	trailer := http.Header{}
	for k, vs := range w.header {
		switch {
		case k == "Trailer":
			for _, v := range vs {
				for name := range strings.SplitSeq(v, ",") {
					if name = strings.TrimSpace(name); name != "" {
						trailer[http.CanonicalHeaderKey(name)] = nil
					}
				}
			}
		case strings.HasPrefix(k, http.TrailerPrefix):
		default:
			h[k] = append([]string(nil), vs...)
		}
	}
	cl := int64(-1)
	if v := h.Get("Content-Length"); v != "" {
		if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
			cl = n
		}
	}
	w.resp = &http.Response{
		Status:        strconv.Itoa(code) + " " + http.StatusText(code),
		StatusCode:    code,
		Proto:         "HTTP/2.0",
		ProtoMajor:    2,
		Header:        h,
		Trailer:       trailer,
		Body:          w.body,
		ContentLength: cl,
		Request:       w.req,
	}
	w.first <- inProcessResult{resp: w.resp}
}

func (w *inProcessWriter) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	return w.pw.Write(p)
}

// Flush sends the head if not yet sent; written bytes are with the
// caller already (the pipe has no buffer).
func (w *inProcessWriter) Flush() {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
}

// inProcessBody is the caller's Response.Body.
type inProcessBody struct {
	pr     *io.PipeReader
	cancel context.CancelCauseFunc
}

func (b *inProcessBody) Read(p []byte) (int, error) { return b.pr.Read(p) }

// Close ends the handler's context (a no-op once it returned) and fails
// its further writes.
func (b *inProcessBody) Close() error {
	b.pr.CloseWithError(errBodyClosed)
	b.cancel(errBodyClosed)
	return nil
}
