package nodeclient_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// countingTransport counts the requests it sends over the network.
type countingTransport struct {
	next http.RoundTripper
	n    atomic.Int64
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.next.RoundTrip(r)
}

func inProcessClient(t *testing.T, n *fakeNode, h http.Handler) (*nodeclient.InProcess, *countingTransport) {
	t.Helper()
	net := &countingTransport{next: h2cOnly(t).Transport}
	ip, err := nodeclient.NewInProcess(n.url, h, net)
	if err != nil {
		t.Fatal(err)
	}
	return ip, net
}

// The node's own handler answers, with its token check and error mapping,
// and nothing goes over the network.
func TestInProcessServesLocalNode(t *testing.T) {
	n := newFakeNode(t, "n001")
	n.set(func(n *fakeNode) { n.states[sbx] = nodev1.SandboxState_SANDBOX_STATE_PAUSED })
	ip, net := inProcessClient(t, n, n.handler)
	c, err := nodeclient.New(nodeclient.NodeInfo{ID: n.id, Addr: n.url}, nodeclient.Options{HTTPClient: &http.Client{Transport: ip}, Tokens: n.token(t)})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Node().Info(t.Context(), connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.GetNodeId() != "n001" {
		t.Fatalf("node id %q", resp.Msg.GetNodeId())
	}
	_, err = c.Node().GetSandbox(t.Context(), connect.NewRequest(&nodev1.GetSandboxRequest{SandboxId: "n001bbbbbbbbbbbbbbbb"}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("unknown sandbox: %v, want not_found", err)
	}
	// A plain agent request, refused by the node's proxy as JSON.
	hresp, err := c.HTTPClient().Get(c.AgentURL(sbx, "/files").String())
	if err != nil {
		t.Fatal(err)
	}
	if err := nodeclient.MapResponse(hresp, "read files"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("agent request to a paused sandbox: %v, want failed_precondition", err)
	}
	if p := n.protosOf("rpc"); len(p) != 2 || p[0] != "HTTP/2.0" {
		t.Fatalf("RPC protocols %v, want two HTTP/2.0 calls", p)
	}
	if got := ip.Served(); got != 3 {
		t.Errorf("served in-process %d, want 3", got)
	}
	if got := net.n.Load(); got != 0 {
		t.Errorf("%d requests went over the network", got)
	}

	// Without a token the node's interceptor refuses, as over the network.
	bare, err := nodeclient.New(nodeclient.NodeInfo{ID: n.id, Addr: n.url}, nodeclient.Options{HTTPClient: &http.Client{Transport: ip}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bare.Node().Info(t.Context(), connect.NewRequest(&nodev1.InfoRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("call without a token: %v, want unauthenticated", err)
	}
}

// Other nodes, and port tunnels to the local one, go over the network.
func TestInProcessOtherNodesOverNetwork(t *testing.T) {
	local, remote := newFakeNode(t, "n001"), newFakeNode(t, "n002")
	local.echoPort(t)
	local.set(func(n *fakeNode) { n.states[sbx] = nodev1.SandboxState_SANDBOX_STATE_RUNNING })
	ip, net := inProcessClient(t, local, local.handler)
	rc, err := nodeclient.New(nodeclient.NodeInfo{ID: remote.id, Addr: remote.url}, nodeclient.Options{HTTPClient: &http.Client{Transport: ip}, Tokens: remote.token(t)})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := rc.Node().Info(t.Context(), connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.GetNodeId() != "n002" || ip.Served() != 0 || net.n.Load() != 1 {
		t.Fatalf("remote node: id %q, served in-process %d, over the network %d; want n002, 0, 1", resp.Msg.GetNodeId(), ip.Served(), net.n.Load())
	}
	if p := remote.protosOf("rpc"); len(p) != 1 || p[0] != "HTTP/2.0" {
		t.Fatalf("remote RPC protocols %v, want one HTTP/2.0 call over h2c", p)
	}

	lc, err := nodeclient.New(nodeclient.NodeInfo{ID: local.id, Addr: local.url}, nodeclient.Options{HTTPClient: &http.Client{Transport: ip}, Tokens: local.token(t)})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := lc.DialPort(t.Context(), sbx, 8000)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if p := local.protosOf("tunnel"); len(p) != 1 || p[0] != "HTTP/1.1" {
		t.Fatalf("tunnel protocols %v, want one HTTP/1.1 request to the listener", p)
	}
	if _, err := conn.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	_ = conn.(interface{ CloseWrite() error }).CloseWrite()
	got, err := io.ReadAll(conn)
	if err != nil || string(got) != "got 4 bytes: ping" {
		t.Fatalf("tunnel answer %q, %v", got, err)
	}
}

// streamingImages answers ImportImage with progress messages, each only
// after the caller saw the one before, and counts UploadBuildContext bytes.
type streamingImages struct {
	nodev1connect.UnimplementedNodeImageServiceHandler
	seen chan int64
}

func (s *streamingImages) ImportImage(ctx context.Context, _ *connect.Request[opendsecv1.ImportImageRequest], st *connect.ServerStream[opendsecv1.ImportImageResponse]) error {
	for i := range int64(3) {
		if err := st.Send(&opendsecv1.ImportImageResponse{Event: &opendsecv1.ImportImageResponse_Progress{Progress: &opendsecv1.ImportProgress{Files: i}}}); err != nil {
			return err
		}
		select {
		case got := <-s.seen:
			if got != i {
				return fmt.Errorf("caller saw %d, want %d", got, i)
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return connect.NewError(connect.CodeResourceExhausted, errors.New("store full"))
}

func (s *streamingImages) UploadBuildContext(_ context.Context, st *connect.ClientStream[opendsecv1.UploadBuildContextRequest]) (*connect.Response[opendsecv1.UploadBuildContextResponse], error) {
	var n int64
	for st.Receive() {
		n += int64(len(st.Msg().GetData()))
	}
	if err := st.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&opendsecv1.UploadBuildContextResponse{ContextId: "ctx", Size: n}), nil
}

func TestInProcessStreams(t *testing.T) {
	n := newFakeNode(t, "n001")
	imgs := &streamingImages{seen: make(chan int64)}
	mux := http.NewServeMux()
	mux.Handle(nodev1connect.NewNodeImageServiceHandler(imgs))
	ip, net := inProcessClient(t, n, mux)
	c := nodev1connect.NewNodeImageServiceClient(&http.Client{Transport: ip}, n.url)

	// Server stream: each message arrives before the handler goes on.
	st, err := c.ImportImage(t.Context(), connect.NewRequest(&opendsecv1.ImportImageRequest{Ref: "x"}))
	if err != nil {
		t.Fatal(err)
	}
	var got int64
	for st.Receive() {
		if f := st.Msg().GetProgress().GetFiles(); f != got {
			t.Fatalf("message %d says %d", got, f)
		}
		imgs.seen <- got
		got++
	}
	if got != 3 || connect.CodeOf(st.Err()) != connect.CodeResourceExhausted {
		t.Fatalf("%d messages, end %v; want 3 then resource_exhausted", got, st.Err())
	}

	// Client stream: 4 pieces of 1 MiB.
	up := c.UploadBuildContext(t.Context())
	for range 4 {
		if err := up.Send(&opendsecv1.UploadBuildContextRequest{Data: make([]byte, 1<<20)}); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := up.CloseAndReceive()
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.GetSize() != 4<<20 {
		t.Fatalf("uploaded %d bytes, want %d", resp.Msg.GetSize(), 4<<20)
	}
	if net.n.Load() != 0 {
		t.Fatalf("%d requests went over the network", net.n.Load())
	}
}

// The handler's context ends when the caller closes the body early or
// gives up before the head, as a reset stream ends it over the network;
// trailers and a panicking handler reach the caller.
func TestInProcessCallerGoneAndTrailers(t *testing.T) {
	n := newFakeNode(t, "n001")
	ended := make(chan error, 1)
	release := make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("/head-then-wait", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
		ended <- context.Cause(r.Context())
	})
	mux.HandleFunc("/wait", func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		ended <- r.Context().Err()
	})
	mux.HandleFunc("/trailers", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Sum")
		_, _ = io.WriteString(w, "body")
		w.Header().Set("X-Sum", "4")
		w.Header().Set(http.TrailerPrefix+"X-Late", "yes")
	})
	mux.HandleFunc("/whoami", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s %s accept=%q connect-accept=%q", r.RemoteAddr, r.Proto, r.Header.Get("Accept-Encoding"), r.Header.Get("Connect-Accept-Encoding"))
	})
	mux.HandleFunc("/panic", func(http.ResponseWriter, *http.Request) {
		<-release
		panic(http.ErrAbortHandler)
	})
	ip, _ := inProcessClient(t, n, mux)
	hc := &http.Client{Transport: ip}

	resp, err := hc.Get(n.url + "/head-then-wait")
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("status %d", resp.StatusCode)
	}
	resp.Body.Close()
	if err := <-ended; err == nil {
		t.Fatal("handler context not ended by closing the body")
	}

	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, n.url+"/wait", nil)
		_, err := hc.Do(req)
		errc <- err
	}()
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("call given up: %v, want context.Canceled", err)
	}
	if err := <-ended; !errors.Is(err, context.Canceled) {
		t.Fatalf("handler context: %v, want canceled", err)
	}

	resp, err = hc.Get(n.url + "/trailers")
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(b) != "body" || resp.Trailer.Get("X-Sum") != "4" || resp.Trailer.Get("X-Late") != "yes" {
		t.Fatalf("body %q (%v), trailers %v", b, err, resp.Trailer)
	}

	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, n.url+"/whoami", nil)
	req.Header.Set("Accept-Encoding", "gzip")
	req.Header.Set("Connect-Accept-Encoding", "gzip")
	resp, err = hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := nodeclient.InProcessRemoteAddr + ` HTTP/2.0 accept="" connect-accept=""`; string(b) != want {
		t.Fatalf("the handler saw %q, want %q (no compressed answers in-process)", b, want)
	}

	close(release)
	if _, err := hc.Get(n.url + "/panic"); err == nil {
		t.Fatal("aborted handler: no error")
	}
}
