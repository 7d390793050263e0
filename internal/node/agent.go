package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

func slogImage(name string) slog.Attr { return slog.String("image", name) }

// agentTransport returns the sandbox's HTTP transport to its agent: every
// connection is opened by the backend (unix socket, vsock...).
func (n *Node) agentTransport(sb *sandbox) *http.Transport {
	sb.transportOnce.Do(func() {
		rt := n.cfg.Backends[sb.backend]
		id := sb.id
		sb.transport.Store(&http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return rt.AgentConn(ctx, id)
			},
			// One connection per request: a unix socket costs microseconds
			// to open, and no proxied stream ever shares a connection's
			// lifetime with another.
			DisableKeepAlives:  true,
			DisableCompression: true,
			// Uploads ask for 100-continue (AgentProxy): an agent that
			// refuses one from its headers answers before any of the body
			// is sent. Past this the body goes anyway.
			ExpectContinueTimeout: 2 * time.Second,
		})
	})
	return sb.transport.Load()
}

// errSandboxGone ends waitAgent when the sandbox stopped, paused or went
// away while it waited.
var errSandboxGone = errors.New("sandbox no longer running")

// waitAgent asks the agent for /health until it answers 204. The socket
// listens from before the sandbox's start, so the first request normally
// waits in its backlog and is answered as soon as the server runs; a failed
// request (init gone, socket replaced) is retried with a growing delay
// until AgentReadyTimeout, or until the sandbox is no longer running.
func (n *Node) waitAgent(ctx context.Context, sb *sandbox) error {
	ctx, cancel := context.WithTimeoutCause(ctx, n.cfg.AgentReadyTimeout,
		fmt.Errorf("agent of sandbox %s did not answer within %s", sb.id, n.cfg.AgentReadyTimeout))
	defer cancel()
	client := &http.Client{Transport: n.agentTransport(sb)}
	backoff := 5 * time.Millisecond
	var last error
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/health", nil)
		resp, err := client.Do(req)
		if err == nil {
			// The body says why (a container's init names the agent that
			// cannot start).
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
			resp.Body.Close()
			if resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("agent health: status %d: %s", resp.StatusCode, strings.TrimSpace(string(body)))
		}
		last = err
		if !n.stillRunning(sb) {
			return errSandboxGone
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return errdefs.New(errdefs.ErrUnavailable, "%w: %w", context.Cause(ctx), last)
		case <-t.C:
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

// stillRunning reports whether sb is still the node's running sandbox of
// its ID.
func (n *Node) stillRunning(sb *sandbox) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	cur, ok := n.sandboxes[sb.id]
	return ok && cur == sb && sb.rec.State == stateRunning
}

// AgentPrefix is the HTTP path under which the node forwards to agents:
// /agent/<sandbox-id>/<rest> reaches <rest> on that sandbox's agent.
const AgentPrefix = "/agent/"

// NoAutoResumeHeader on a call through AgentProxy keeps a paused sandbox
// paused: the call fails (failed precondition, the answer carrying the
// header too) instead of resuming it. The E2B gateway sets it for sandboxes
// created with autoResume false (nodeclient.NoAutoResumeHeader is the same).
const NoAutoResumeHeader = "Opendsec-No-Auto-Resume"

// AgentProxy forwards /agent/<id>/<rest> to the sandbox's agent, streaming
// in both directions (including 101 upgrades for port tunnels). A paused
// sandbox is resumed first (autoResume) unless the call carries
// NoAutoResumeHeader. Every request counts as activity
// for the idle timeout, and an open request keeps the sandbox from being
// idle.
func (n *Node) AgentProxy() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rest := strings.TrimPrefix(r.URL.Path, AgentPrefix)
		id, sub, _ := strings.Cut(rest, "/")
		if sub == TrajectoryPath && r.Method == http.MethodGet {
			// The node's own route: also for a stopped sandbox.
			n.serveTrajectory(w, r, id)
			return
		}
		sb, dead, err := n.getOrDeadFor(r.Context(), id)
		// A sandbox that died: reported failed, still in the table while
		// its cleanup runs, then a tombstone. Either way say why it is gone.
		if err == nil && (dead || sb.died.Load()) {
			reason, _ := sb.reason.Load().(string)
			err = errdefs.SandboxDied(id, strings.TrimPrefix(reason, "died: "))
		} else if err == nil {
			// Active before it looks: a timeout's pause that does not see
			// this call is seen by it (the pause sets sb.pausing first).
			sb.active.Add(1)
			defer sb.active.Add(-1)
			if n.needsResume(sb) {
				if r.Header.Get(NoAutoResumeHeader) != "" {
					// Marked in the answer too, so a proxy in front
					// tells it from the agent's own answers.
					w.Header().Set(NoAutoResumeHeader, "paused")
					err = errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is paused and the call asked not to resume it (%s)", id, NoAutoResumeHeader)
				} else {
					err = n.autoResume(r.Context(), sb, r.Method+" /"+sub)
				}
			}
			if err == nil {
				n.mu.Lock()
				st := sb.rec.State
				n.mu.Unlock()
				if st != stateRunning {
					err = errdefs.New(errdefs.ErrNotFound, "sandbox %s is %s", id, st)
				}
			}
		}
		if err != nil {
			writeJSONError(w, err)
			return
		}
		if n.traj != nil && r.Method == http.MethodPost && sub == strings.TrimPrefix(processconnect.ProcessStartProcedure, "/") {
			sb.touch()
			defer sb.touch()
			n.serveTrajStart(w, r, sb)
			return
		}
		if n.traj != nil && r.Method == http.MethodGet && sub == codeTunnelPath && isTCPUpgrade(r.Header) {
			n.serveCodeTunnel(w, r, sb, sub)
			return
		}
		if tooLargeUpload(w, r, sub, n.cfg.MaxUploadBytes) {
			return
		}
		if n.traj != nil && r.Method == http.MethodPost && sub == "files" {
			n.serveTrajWrite(w, r, sb, func(w http.ResponseWriter, r *http.Request) { n.forwardToAgent(w, r, sb, id, sub) })
			return
		}
		n.forwardToAgent(w, r, sb, id, sub)
	})
}

// forwardToAgent proxies r to /sub on sandbox id's agent (sb).
func (n *Node) forwardToAgent(w http.ResponseWriter, r *http.Request, sb *sandbox, id, sub string) {
	// An upload without a Content-Length over the limit: the agent
	// answers 413 once it has read the limit, and the proxy, still
	// sending, sees a broken pipe instead of that answer. Counting
	// what went to the agent tells the two apart.
	var sent atomic.Int64
	upload := r.Method == http.MethodPost && sub == "files" && n.cfg.MaxUploadBytes > 0 && r.Body != nil && r.Body != http.NoBody
	if upload {
		r.Body = &countingBody{ReadCloser: r.Body, n: &sent}
	}
	sb.touch()
	defer sb.touch()
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = "agent"
			pr.Out.URL.Path = "/" + sub
			pr.Out.URL.RawPath = ""
			pr.Out.Host = "agent"
			// The node's token is for the node, not the agent; a Basic
			// Authorization (envd user selection) goes through.
			if a := pr.Out.Header.Get("Authorization"); len(a) >= 7 && strings.EqualFold(a[:7], "bearer ") {
				pr.Out.Header.Del("Authorization")
			}
			pr.Out.Header.Del(auth.TokenHeader)
			pr.Out.Header.Del(auth.OnBehalfHeader)
			if upload {
				// The agent refuses a write from its path or
				// Content-Length without reading the body; the proxy,
				// still sending it, got a broken pipe instead of the
				// agent's 403 or 413.
				pr.Out.Header.Set("Expect", "100-continue")
			}

		},
		Transport:     n.agentTransport(sb),
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if limit := n.cfg.MaxUploadBytes; upload && sent.Load() > limit {
				writeTooLarge(w, fmt.Sprintf("upload of more than %d bytes exceeds the limit of %d bytes (node.max_upload_mb)", limit, limit))
				return
			}
			log.G(r.Context()).Warn("agent request failed", log.SandboxID(id), log.Err(err))
			writeJSONError(w, errdefs.New(errdefs.ErrUnavailable, "agent of sandbox %s unreachable: %w", id, err))
		},
	}
	if upload && r.Header.Get("Expect") == "" {
		// The 100 Continue the agent answers to the proxy's Expect is
		// the proxy's own: ReverseProxy would pass it on to a client
		// that never asked (undici, E2B's JS SDK, fails the fetch).
		w = no1xxWriter{w}
	}
	proxy.ServeHTTP(w, r)
}

// tooLargeUpload answers 413 to a POST /files (E2B's upload route) whose
// Content-Length is over the upload limit, as the agent would — but before
// any of the body moves: the agent answers without reading it, and the
// proxy, still sending, got a broken pipe and answered 503 "agent
// unreachable" instead of the agent's 413.
func tooLargeUpload(w http.ResponseWriter, r *http.Request, sub string, limit int64) bool {
	if limit <= 0 || r.Method != http.MethodPost || sub != "files" || r.Header.Get("Content-Encoding") != "" {
		return false
	}
	slack := int64(0)
	if strings.HasPrefix(r.Header.Get("Content-Type"), "multipart/") {
		slack = 64 << 10 // part headers and boundaries, as the agent allows
	}
	if r.ContentLength <= limit+slack {
		return false
	}
	writeTooLarge(w, fmt.Sprintf("upload of %d bytes exceeds the limit of %d bytes (node.max_upload_mb)", r.ContentLength, limit))
	return true
}

// writeTooLarge answers 413 in the agent's JSON shape.
func writeTooLarge(w http.ResponseWriter, msg string) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("Connection", "close")
	w.WriteHeader(http.StatusRequestEntityTooLarge)
	fmt.Fprintf(w, "{\"code\":%d,\"message\":%q,\"status\":%q}\n", http.StatusRequestEntityTooLarge, msg, "resource_exhausted")
}

// no1xxWriter drops informational responses (1xx but 101) on their way to
// the client.
type no1xxWriter struct{ http.ResponseWriter }

func (w no1xxWriter) WriteHeader(code int) {
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		return
	}
	w.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController (the proxy's flushes) reach the
// writer underneath.
func (w no1xxWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// countingBody counts the bytes read from a request body.
type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (c *countingBody) Read(p []byte) (int, error) {
	k, err := c.ReadCloser.Read(p)
	c.n.Add(int64(k))
	return k, err
}

// writeJSONError answers {"code": <http status>, "message", "status": <connect
// code name>}; status keeps categories that share an HTTP status apart
// (failed_precondition and invalid_argument are both 400). A sandbox that
// died adds "died": the reason.
func writeJSONError(w http.ResponseWriter, err error) {
	code, msg := errdefs.ToHTTP(context.Background(), err)
	body := map[string]any{"code": code, "message": msg, "status": errdefs.Code(err).String()}
	var de *errdefs.DiedError
	if errors.As(err, &de) {
		body["died"] = de.Reason
		w.Header().Set(errdefs.DiedMetadataKey, de.Reason)
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}
