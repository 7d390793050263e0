package e2b

import (
	"context"
	"crypto/subtle"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/envdsig"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// cacheTTL is how long the proxy trusts a sandbox lookup. /health always
// looks again, so a killed sandbox reads as not running at once.
const cacheTTL = 2 * time.Second

// internalRoutes of envd are never reachable from outside (E2B's proxy
// refuses them the same way), nor are the agent's own extensions.
var internalRoutes = map[string]bool{
	"/init": true, "/freeze": true, "/unfreeze": true, "/collapse": true,
	"/fsfreeze": true, "/fsthaw": true, "/upgrade": true,
}

const unauthorizedBody = "unauthorized access, please provide a valid access token or method signing if supported"

type notFoundBody struct {
	SandboxID string `json:"sandboxId"`
	Message   string `json:"message"`
	Code      int    `json:"code"`
}

type portClosedBody struct {
	SandboxID string `json:"sandboxId"`
	Message   string `json:"message"`
	Port      int    `json:"port"`
	Code      int    `json:"code"`
}

func writeSandboxNotFound(w http.ResponseWriter, id string) {
	writeJSON(w, http.StatusBadGateway, notFoundBody{SandboxID: id, Message: "The sandbox was not found", Code: http.StatusBadGateway})
}

// sandboxSecure reports whether sandbox id takes traffic and which tokens
// its traffic needs, using a short-lived cache unless probe. A running
// sandbox takes traffic, and so does a paused one (its node resumes it for
// the request), except for a probe — envd's /health, E2B's isRunning, which
// must say a paused sandbox is not running (502) and not wake it — and
// except for a sandbox created with autoResume {"enabled": false}, which
// traffic must not wake either; its state is looked up on every request,
// never cached, and its calls ask the node not to resume it (a pause between
// the lookup and the call fails the call instead).
func (g *Gateway) sandboxSecure(ctx context.Context, id string, probe bool) (live bool, c cachedSandbox, err error) {
	g.cacheMu.Lock()
	c, ok := g.cache[id]
	g.cacheMu.Unlock()
	if ok && !probe && time.Since(c.at) < cacheTTL {
		return true, c, nil
	}
	resp, err := g.cfg.API.GetSandbox(ctx, connect.NewRequest(&v1.GetSandboxRequest{Id: id}))
	if err != nil {
		err = errdefs.FromConnect(err)
		if errdefs.IsNotFound(err) || errdefs.IsInvalidArgument(err) {
			g.forget(id)
			return false, cachedSandbox{}, nil
		}
		return false, cachedSandbox{}, fmt.Errorf("get sandbox: %w", err)
	}
	sb := resp.Msg.GetSandbox()
	st := sb.GetState()
	l := sb.GetSpec().GetLabels()
	noResume := l[labelNoResume] == "true"
	takes := st == v1.SandboxState_SANDBOX_STATE_RUNNING || (st == v1.SandboxState_SANDBOX_STATE_PAUSED && !probe && !noResume)
	if !takes || l[labelTeam] == "" {
		// Stopping, paused (for a probe, or with auto-resume off), or not
		// made through the gateway.
		g.forget(id)
		return false, cachedSandbox{}, nil
	}
	c = cachedSandbox{secure: l[labelSecure] == "true", private: l[labelPrivate] == "true", mask: l[labelMask], noResume: noResume, at: time.Now()}
	if noResume {
		return true, c, nil
	}
	g.cacheMu.Lock()
	if len(g.cache) > 100000 {
		clear(g.cache)
	}
	g.cache[id] = c
	g.cacheMu.Unlock()
	return true, c, nil
}

func (g *Gateway) forget(id string) {
	g.cacheMu.Lock()
	delete(g.cache, id)
	g.cacheMu.Unlock()
}

// proxy sends a request to port inside sandbox id.
func (g *Gateway) proxy(w http.ResponseWriter, r *http.Request, id string, port int) {
	node, err := g.nodes.ForSandbox(r.Context(), "sandbox_id", id)
	switch {
	case errdefs.IsInvalidArgument(err):
		http.Error(w, "Invalid sandbox ID", http.StatusBadRequest)
		return
	case errdefs.IsNotFound(err):
		writeSandboxNotFound(w, id)
		return
	case err != nil:
		log.G(r.Context()).Warn("route sandbox traffic", log.SandboxID(id), log.Err(err))
		writeError(w, http.StatusBadGateway, "cannot find the node of sandbox %s: %s", id, err.Error())
		return
	}
	if port == EnvdPort && (internalRoutes[r.URL.Path] || strings.HasPrefix(r.URL.Path, "/_opendsec/")) {
		writeError(w, http.StatusNotFound, "internal route")
		return
	}
	health := port == EnvdPort && r.URL.Path == "/health"
	running, sec, err := g.sandboxSecure(r.Context(), id, health)
	if err != nil {
		log.G(r.Context()).Warn("look up sandbox for proxy", log.SandboxID(id), log.Err(err))
		writeError(w, http.StatusBadGateway, "cannot look up sandbox %s: %s", id, err.Error())
		return
	}
	if !running {
		writeSandboxNotFound(w, id)
		return
	}
	if port != EnvdPort {
		if sec.private && !g.checkTrafficToken(r, id) {
			writeJSON(w, http.StatusForbidden, portClosedBody{
				SandboxID: id, Message: "Missing or invalid traffic access token (e2b-traffic-access-token header)", Port: port, Code: http.StatusForbidden,
			})
			return
		}
		if sec.noResume {
			r = r.WithContext(nodeclient.WithoutAutoResume(r.Context()))
		}
		g.proxyPort(w, r, node, id, port, sec.mask)
		return
	}
	if sec.secure && !health {
		if status, msg := g.checkEnvdAuth(r, id); status != 0 {
			writeError(w, status, "%s", msg)
			return
		}
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			g.rewrite(pr, node.AgentURL(id, pr.In.URL.Path))
			if sec.noResume {
				pr.Out.Header.Set(nodeclient.NoAutoResumeHeader, "1")
			}
		},
		Transport:     node.HTTPClient().Transport,
		FlushInterval: -1,
		ModifyResponse: func(resp *http.Response) error {
			// The node answers for a sandbox that stopped after the lookup,
			// or that was paused since and may not be resumed.
			if health && resp.StatusCode != http.StatusNoContent && resp.StatusCode != http.StatusOK ||
				resp.Header.Get(nodeclient.NoAutoResumeHeader) != "" {
				return errSandboxGone
			}
			guardConnectStream(resp, func(endErr string) bool { return g.sandboxGone(resp.Request.Context(), id, endErr) })
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if err != errSandboxGone && r.Context().Err() == nil {
				log.G(r.Context()).Warn("proxy to agent", log.SandboxID(id), log.Err(err))
			}
			g.forget(id)
			writeSandboxNotFound(w, id)
		},
	}
	rp.ServeHTTP(w, r)
}

var errSandboxGone = errdefs.New(errdefs.ErrNotFound, "sandbox gone")

// rewrite points an outgoing request at target (the request's path on the
// sandbox's agent, through its node; the query stays) and drops what must
// not reach it: the caller's routing headers, any OpenDsec token (the node
// client's transport adds the gateway's own) and any on-behalf-of claim
// (traffic goes to the node as the gateway's).
func (g *Gateway) rewrite(pr *httputil.ProxyRequest, target *url.URL) {
	u := pr.Out.URL
	u.Scheme, u.Host, u.Path, u.RawPath = target.Scheme, target.Host, target.Path, target.RawPath
	pr.Out.Host = target.Host
	pr.Out.Header.Del(auth.TokenHeader)
	pr.Out.Header.Del(auth.OnBehalfHeader)
	pr.Out.Header.Del("E2b-Sandbox-Id")
	pr.Out.Header.Del("E2b-Sandbox-Port")
	pr.Out.Header.Del(nodeclient.NoAutoResumeHeader)
	if a := pr.Out.Header.Get("Authorization"); len(a) >= 7 && strings.EqualFold(a[:7], "bearer ") {
		pr.Out.Header.Del("Authorization")
	}
	pr.SetXForwarded()
}

// checkEnvdAuth enforces envd's access token for a secure sandbox: the
// X-Access-Token header everywhere, or for /files a v1 URL signature.
// It returns 0 when the request may pass.
func (g *Gateway) checkEnvdAuth(r *http.Request, id string) (int, string) {
	want := g.accessToken(id)
	if tok := r.Header.Get("X-Access-Token"); tok != "" {
		if subtle.ConstantTimeCompare([]byte(tok), []byte(want)) == 1 {
			return 0, ""
		}
		return http.StatusUnauthorized, unauthorizedBody
	}
	if r.URL.Path != "/files" || (r.Method != http.MethodGet && r.Method != http.MethodPost) {
		return http.StatusUnauthorized, unauthorizedBody
	}
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	return envdsig.CheckQuery(r.URL.Query(), op, want, time.Now())
}

// Signature is envd's file URL signature (see envdsig.Sign).
func Signature(path, op, username, token, expiration string) string {
	return envdsig.Sign(path, op, username, token, expiration)
}

// proxyPort forwards a request to a TCP port inside the sandbox through the
// agent's tunnel (one tunnel per request; upgrades such as WebSocket work).
// The request keeps its Host header unless mask (the sandbox's
// network.maskRequestHost) is set: then Host is mask with ${PORT} replaced
// by port, as E2B's proxy does.
func (g *Gateway) proxyPort(w http.ResponseWriter, r *http.Request, node *nodeclient.Client, id string, port int, mask string) {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return node.DialPort(ctx, id, port)
		},
		DisableKeepAlives:  true,
		DisableCompression: true,
	}
	defer tr.CloseIdleConnections()
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = fmt.Sprintf("localhost:%d", port)
			pr.Out.Host = pr.In.Host
			if mask != "" {
				pr.Out.Host = maskHost(mask, port)
			}
			pr.Out.Header.Del(auth.TokenHeader)
			pr.Out.Header.Del(auth.OnBehalfHeader)
			pr.Out.Header.Del("E2b-Sandbox-Id")
			pr.Out.Header.Del("E2b-Sandbox-Port")
			pr.Out.Header.Del("E2b-Traffic-Access-Token")
			pr.SetXForwarded()
		},
		Transport:     tr,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			var re *nodeclient.ResponseError
			if nodeclient.AutoResumeOff(r.Context()) && errors.Is(err, errdefs.ErrFailedPrecondition) {
				// Paused since the lookup, and autoResume is off.
				writeSandboxNotFound(w, id)
				return
			}
			if port == CodeInterpreterPort && errors.As(err, &re) && re.StatusCode == http.StatusServiceUnavailable {
				// The agent says why the interpreter cannot run (no python3
				// in the image...): 503, not the SDK's "sandbox timeout" 502.
				writeError(w, http.StatusServiceUnavailable, "%s", re.Message)
				return
			}
			writeJSON(w, http.StatusBadGateway, portClosedBody{
				SandboxID: id, Message: "The sandbox is running but port is not open", Port: port, Code: http.StatusBadGateway,
			})
		},
	}
	rp.ServeHTTP(w, r)
}

// signedFileSandbox finds the running secure sandbox whose access token
// signed the /files URL of r. It costs one list and a hash per sandbox.
func (g *Gateway) signedFileSandbox(r *http.Request) (string, error) {
	q := r.URL.Query()
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	resp, err := g.cfg.API.ListSandboxes(r.Context(), connect.NewRequest(&v1.ListSandboxesRequest{
		Labels: map[string]string{labelSecure: "true"},
	}))
	if err != nil {
		return "", fmt.Errorf("list sandboxes: %w", errdefs.FromConnect(err))
	}
	sig := []byte(q.Get("signature"))
	for _, sb := range resp.Msg.GetSandboxes() {
		want := Signature(q.Get("path"), op, q.Get("username"), g.accessToken(sb.GetId()), q.Get("signature_expiration"))
		if subtle.ConstantTimeCompare(sig, []byte(want)) == 1 {
			return sb.GetId(), nil
		}
	}
	return "", errdefs.New(errdefs.ErrUnauthenticated, "invalid signature: no running sandbox signed this URL")
}

// guardConnectStream turns the end of a Connect server stream (a process's
// output, a watch) into an aborted response when the sandbox is gone: the
// stream ended without its end-of-stream message, or with an error while
// gone() reports the sandbox not running (the node ends a process stream
// with the error its agent connection broke with when the sandbox is
// killed). The reverse proxy then aborts the response, an HTTP/2 stream
// reset (RST_STREAM) or a cut HTTP/1.1 connection: a transport failure for
// the SDKs, as from E2B's proxy, on which they probe the sandbox and report
// it killed ("The sandbox was killed ..."), not a protocol or envd error.
func guardConnectStream(resp *http.Response, gone func(endErr string) bool) {
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/connect+") {
		return
	}
	resp.Body = &connectStreamBody{ReadCloser: resp.Body, gone: gone}
}

// errStreamCut is a Connect stream cut short: the sandbox is gone.
var errStreamCut = errors.New("connect stream cut: the sandbox is gone")

// connectStreamBody follows the envelopes (flags byte, 4-byte big-endian
// length, message) of a Connect stream. It passes messages through as they
// come and holds back the end-of-stream envelope (flag 0x02) until the body
// ends, to decide between handing it on and errStreamCut.
type connectStreamBody struct {
	io.ReadCloser
	gone      func(endErr string) bool
	buf       []byte
	hdr       [5]byte
	hdrN      int
	remaining uint32
	inEnd     bool   // the envelope being read is the end-of-stream one
	end       []byte // the end-of-stream envelope, held back
	ended     bool   // end holds the whole end-of-stream envelope
	out       []byte // bytes to hand out before reading on
	err       error  // what Read returns once out is drained
}

func (b *connectStreamBody) Read(p []byte) (int, error) {
	for len(b.out) == 0 && b.err == nil {
		if cap(b.buf) < len(p) {
			b.buf = make([]byte, len(p))
		}
		n, err := b.ReadCloser.Read(b.buf[:len(p)])
		b.scan(b.buf[:n])
		if err != nil {
			b.err = b.finish(err)
		} else if n == 0 {
			break
		}
	}
	if len(b.out) > 0 {
		n := copy(p, b.out)
		b.out = b.out[n:]
		return n, nil
	}
	return 0, b.err
}

func (b *connectStreamBody) finish(err error) error {
	if err != io.EOF {
		return err
	}
	if !b.ended || b.hdrN > 0 {
		return errStreamCut
	}
	var end struct {
		Error *struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if b.end[0]&0x01 == 0 && json.Unmarshal(b.end[5:], &end) == nil && end.Error != nil &&
		b.gone != nil && b.gone(end.Error.Code+": "+end.Error.Message) {
		return errStreamCut
	}
	b.out = append(b.out, b.end...)
	return io.EOF
}

func (b *connectStreamBody) scan(data []byte) {
	for len(data) > 0 {
		if b.remaining > 0 {
			k := uint32(len(data))
			if k > b.remaining {
				k = b.remaining
			}
			if b.inEnd {
				b.end = append(b.end, data[:k]...)
			} else {
				b.out = append(b.out, data[:k]...)
			}
			b.remaining -= k
			data = data[k:]
			if b.remaining == 0 && b.inEnd {
				b.ended = true
			}
			continue
		}
		if b.ended {
			// Bytes after the end-of-stream message: not Connect; pass on.
			b.out = append(b.out, data...)
			return
		}
		k := copy(b.hdr[b.hdrN:], data)
		b.hdrN += k
		data = data[k:]
		if b.hdrN < len(b.hdr) {
			continue
		}
		b.hdrN = 0
		b.remaining = binary.BigEndian.Uint32(b.hdr[1:])
		if b.hdr[0]&0x02 != 0 {
			b.inEnd = true
			b.end = append(b.end, b.hdr[:]...)
			b.ended = b.remaining == 0
		} else {
			b.out = append(b.out, b.hdr[:]...)
		}
	}
}

// sandboxGone reports whether sandbox id has stopped (or is stopping) after
// one of its streams ended with endErr. A stream the sandbox's end broke
// may end before the sandbox reads as stopping: an error that reads like a
// broken connection is looked at again for up to a second.
func (g *Gateway) sandboxGone(ctx context.Context, id, endErr string) bool {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	transport := strings.Contains(endErr, "EOF") || strings.HasPrefix(endErr, "unavailable") ||
		strings.Contains(endErr, "connection") || strings.Contains(endErr, "stream")
	for i := 0; ; i++ {
		running, _, err := g.sandboxSecure(ctx, id, true)
		if err != nil {
			return false
		}
		if !running {
			return true
		}
		if !transport || i == 4 {
			return false
		}
		time.Sleep(250 * time.Millisecond)
	}
}
