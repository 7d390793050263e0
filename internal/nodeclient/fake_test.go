package nodeclient_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// fakeNode is an in-process node over HTTP/1.1 and h2c on loopback: a
// NodeService (Info, GetSandbox) behind the token interceptor, and at
// /agent/<id>/ what the node's agent proxy answers: the node's refusals as
// JSON with their connect status, and the agent's port tunnel, a real
// HTTP/1.1 Upgrade to a TCP connection to a loopback listener standing in
// for the port inside the sandbox.
type fakeNode struct {
	nodev1connect.UnimplementedNodeServiceHandler
	id  string
	url string
	key *auth.Issuer

	mu      sync.Mutex
	states  map[string]nodev1.SandboxState // sandboxes by ID
	reasons map[string]string              // Sandbox.reason by ID
	ports   map[int]string                 // in-sandbox port -> loopback address
	// down answers 503 with this message for a port (the service behind
	// it cannot start).
	down map[int]string
	// protos records r.Proto of each request, by kind ("rpc", "tunnel").
	protos map[string][]string
	// handler is what the listener serves (for in-process calls).
	handler http.Handler
}

func newFakeNode(t *testing.T, id string) *fakeNode {
	t.Helper()
	key, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	n := &fakeNode{id: id, key: key, states: map[string]nodev1.SandboxState{}, ports: map[int]string{}, down: map[int]string{}, protos: map[string][]string{}}
	v := auth.NewVerifier(key.PublicKey(), auth.ScopeNode)
	mux := http.NewServeMux()
	path, h := nodev1connect.NewNodeServiceHandler(n, connect.WithInterceptors(v.Interceptor()))
	mux.Handle(path, n.recording("rpc", h))
	mux.Handle("/agent/", v.Middleware(http.HandlerFunc(n.serveAgent)))
	n.handler = mux
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	n.url = srv.URL
	return n
}

// token is a valid node-scope token for this node.
func (n *fakeNode) token(t *testing.T) auth.TokenSource {
	t.Helper()
	tok, err := n.key.Issue("test", auth.ScopeNode, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return auth.StaticToken(tok)
}

func (n *fakeNode) recording(kind string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.mu.Lock()
		n.protos[kind] = append(n.protos[kind], r.Proto)
		n.mu.Unlock()
		h.ServeHTTP(w, r)
	})
}

func (n *fakeNode) protosOf(kind string) []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.protos[kind]...)
}

func (n *fakeNode) set(fn func(n *fakeNode)) {
	n.mu.Lock()
	defer n.mu.Unlock()
	fn(n)
}

func (n *fakeNode) Info(context.Context, *connect.Request[nodev1.InfoRequest]) (*connect.Response[nodev1.InfoResponse], error) {
	return connect.NewResponse(&nodev1.InfoResponse{NodeId: n.id, Healthy: true}), nil
}

func (n *fakeNode) GetSandbox(_ context.Context, req *connect.Request[nodev1.GetSandboxRequest]) (*connect.Response[nodev1.GetSandboxResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	st, ok := n.states[req.Msg.GetSandboxId()]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("sandbox %s not found", req.Msg.GetSandboxId()))
	}
	return connect.NewResponse(&nodev1.GetSandboxResponse{Sandbox: &nodev1.Sandbox{Id: req.Msg.GetSandboxId(), State: st, Reason: n.reasons[req.Msg.GetSandboxId()]}}), nil
}

// writeNodeError answers like the node's agent proxy: {"code", "message",
// "status"}.
func writeNodeError(w http.ResponseWriter, err error) {
	code := errdefs.HTTPStatus(err)
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(code)
	fmt.Fprintf(w, "{\"code\":%d,\"message\":%q,\"status\":%q}\n", code, err.Error(), errdefs.Code(err).String())
}

// writeAgentError answers like envd and the agent: {"code", "message"}.
func writeAgentError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(code)
	fmt.Fprintf(w, "{\"code\":%d,\"message\":%q}\n", code, msg)
}

func (n *fakeNode) serveAgent(w http.ResponseWriter, r *http.Request) {
	id, sub, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/agent/"), "/")
	n.mu.Lock()
	st, ok := n.states[id]
	n.mu.Unlock()
	switch {
	case !ok:
		writeNodeError(w, errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", id))
		return
	case st == nodev1.SandboxState_SANDBOX_STATE_PAUSED:
		writeNodeError(w, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is paused; resume it first", id))
		return
	case st == nodev1.SandboxState_SANDBOX_STATE_FAILED:
		writeNodeError(w, errdefs.SandboxDied(id, strings.TrimPrefix(n.reasons[id], "died: ")))
		return
	}
	var port int
	if _, err := fmt.Sscanf(sub, "_opendsec/port/%d", &port); err != nil {
		writeAgentError(w, http.StatusNotFound, "no route "+sub)
		return
	}
	n.recording("tunnel", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { n.tunnel(w, r, port) })).ServeHTTP(w, r)
}

// tunnel is the agent's port tunnel: Upgrade: tcp, then bytes both ways
// with half-closes passed on.
func (n *fakeNode) tunnel(w http.ResponseWriter, r *http.Request, port int) {
	n.mu.Lock()
	addr, open := n.ports[port]
	down, isDown := n.down[port]
	n.mu.Unlock()
	if isDown {
		writeAgentError(w, http.StatusServiceUnavailable, down)
		return
	}
	if !open || !strings.EqualFold(r.Header.Get("Upgrade"), "tcp") {
		writeAgentError(w, http.StatusBadGateway, fmt.Sprintf("port %d is not open in the sandbox", port))
		return
	}
	up, err := net.Dial("tcp", addr)
	if err != nil {
		writeAgentError(w, http.StatusBadGateway, err.Error())
		return
	}
	defer up.Close()
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
	brw.Flush()
	toUp := make(chan struct{})
	go func() {
		io.Copy(up, brw)
		up.(*net.TCPConn).CloseWrite()
		close(toUp)
	}()
	io.Copy(conn, up)
	conn.(*net.TCPConn).CloseWrite()
	<-toUp
}

// echoPort listens on loopback like a server inside the sandbox: it reads
// everything until EOF, then answers "got <n> bytes: " and what it read,
// and closes. It is port 8000 of every sandbox of n.
func (n *fakeNode) echoPort(t *testing.T) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b, err := io.ReadAll(c)
				if err != nil {
					return
				}
				fmt.Fprintf(c, "got %d bytes: ", len(b))
				c.Write(b)
			}()
		}
	}()
	n.set(func(n *fakeNode) { n.ports[8000] = ln.Addr().String() })
}
