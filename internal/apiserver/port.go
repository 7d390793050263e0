package apiserver

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// DefaultHTTPTimeout bounds an HTTPRequest without timeout_ms.
const DefaultHTTPTimeout = 30 * time.Second

// MaxHTTPHeaderBytes caps the status line and headers of an HTTPRequest's
// response, like net/http's DefaultMaxHeaderBytes.
const MaxHTTPHeaderBytes = 1 << 20

// headerLimiter reads from r, failing once more than n bytes were read
// while it is limited.
type headerLimiter struct {
	r        io.Reader
	n        int64
	limited  bool
	exceeded bool
}

func (l *headerLimiter) Read(p []byte) (int, error) {
	if !l.limited {
		return l.r.Read(p)
	}
	if l.n <= 0 {
		l.exceeded = true
		return 0, errHeaderTooLarge
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	k, err := l.r.Read(p)
	l.n -= int64(k)
	return k, err
}

var errHeaderTooLarge = errors.New("response headers too large")

func validateHTTPRequest(m *v1.HTTPRequestRequest) error {
	if m.GetPort() < 1 || m.GetPort() > 65535 {
		return errdefs.Invalid("port", "%d must be between 1 and 65535", m.GetPort())
	}
	if m.GetMethod() != "" && !methodRe.MatchString(m.GetMethod()) {
		return errdefs.Invalid("method", "%q is not an HTTP method; e.g. GET or POST", m.GetMethod())
	}
	if p := m.GetPath(); p != "" && (!strings.HasPrefix(p, "/") || strings.ContainsAny(p, " \r\n\x00")) {
		return errdefs.Invalid("path", "%q must start with / and contain no spaces or line breaks, e.g. /api?x=1", p)
	}
	for _, h := range m.GetHeaders() {
		if !headerNameRe.MatchString(h.GetName()) || strings.ContainsAny(h.GetValue(), "\r\n\x00") {
			return errdefs.Invalid("headers", "%q: %q is not a valid HTTP header", h.GetName(), h.GetValue())
		}
	}
	if m.GetTimeoutMs() < 0 {
		return errdefs.Invalid("timeout_ms", "%d must be ≥ 0 (0 means %s)", m.GetTimeoutMs(), DefaultHTTPTimeout)
	}
	return nil
}

// HTTPRequest sends one HTTP request to a port inside the sandbox through
// the agent's TCP tunnel (GET <node>/agent/<id>/_opendsec/port/<port> with
// Upgrade: tcp) and returns the response, its body capped at
// MaxHTTPBodyBytes.
func (s *Server) HTTPRequest(ctx context.Context, req *connect.Request[v1.HTTPRequestRequest]) (*connect.Response[v1.HTTPRequestResponse], error) {
	m := req.Msg
	a, err := s.agentFor(ctx, m.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := validateHTTPRequest(m); err != nil {
		return nil, err
	}
	timeout := DefaultHTTPTimeout
	if m.GetTimeoutMs() > 0 {
		timeout = time.Duration(m.GetTimeoutMs()) * time.Millisecond
	}
	ctx, cancel := context.WithTimeoutCause(ctx, timeout,
		errdefs.New(errdefs.ErrDeadlineExceeded, "port %d did not answer within %s; raise timeout_ms", m.GetPort(), timeout))
	defer cancel()

	conn, err := a.node.DialPort(ctx, a.id, int(m.GetPort()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()

	method := m.GetMethod()
	if method == "" {
		method = http.MethodGet
	}
	p := m.GetPath()
	if p == "" {
		p = "/"
	}
	hreq, err := http.NewRequest(method, fmt.Sprintf("http://localhost:%d%s", m.GetPort(), p), bytes.NewReader(m.GetBody()))
	if err != nil {
		return nil, errdefs.Invalid("path", "%q: %s", p, err)
	}
	for _, h := range m.GetHeaders() {
		if strings.EqualFold(h.GetName(), "Host") {
			hreq.Host = h.GetValue()
			continue
		}
		hreq.Header.Add(h.GetName(), h.GetValue())
	}
	hreq.Close = true // one request per tunnel
	if err := hreq.Write(conn); err != nil {
		return nil, ctxErr(ctx, errdefs.New(errdefs.ErrUnavailable, "send request to port %d: %s", m.GetPort(), err))
	}
	lim := &headerLimiter{r: conn, n: MaxHTTPHeaderBytes, limited: true}
	resp, err := http.ReadResponse(bufio.NewReader(lim), hreq)
	lim.limited = false // the body has its own cap
	if lim.exceeded {
		return nil, errdefs.New(errdefs.ErrResourceExhausted,
			"the response headers from port %d exceed %d bytes; make the server in the sandbox send smaller headers", m.GetPort(), MaxHTTPHeaderBytes)
	}
	if err != nil {
		return nil, ctxErr(ctx, errdefs.New(errdefs.ErrUnavailable, "read response from port %d: %s", m.GetPort(), err))
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, s.cfg.MaxHTTPBodyBytes+1))
	if err != nil {
		return nil, ctxErr(ctx, errdefs.New(errdefs.ErrUnavailable, "read response body from port %d: %s", m.GetPort(), err))
	}
	if int64(len(body)) > s.cfg.MaxHTTPBodyBytes {
		return nil, errdefs.New(errdefs.ErrResourceExhausted,
			"the response body from port %d exceeds %d bytes; fetch it in parts or write it to a file and use ReadFile", m.GetPort(), s.cfg.MaxHTTPBodyBytes)
	}
	out := &v1.HTTPRequestResponse{Status: int32(resp.StatusCode), Body: body}
	for name, vals := range resp.Header {
		for _, v := range vals {
			out.Headers = append(out.Headers, &v1.Header{Name: name, Value: v})
		}
	}
	return connect.NewResponse(out), nil
}
