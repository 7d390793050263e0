package apiserver_test

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/httpserver"
	"google.golang.org/protobuf/proto"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/apiserver"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/watcher"
)

type env struct {
	t     testing.TB
	key   *auth.Issuer
	nodes []*fakeNode
	w     *watcher.Watcher
	url   string
	hc    *http.Client // h2c, no token
	tok   string       // a user token

	sbx   opendsecv1connect.SandboxServiceClient
	proc  opendsecv1connect.ProcessServiceClient
	files opendsecv1connect.FileServiceClient
	port  opendsecv1connect.PortServiceClient
}

// setup starts fake nodes with ids, a real watcher polling them, and a real
// apiserver served over h2c on loopback.
func setup(t testing.TB, mod func(*apiserver.Config), ids ...string) *env {
	t.Helper()
	key, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	nodeTok, _ := key.Issue("apiserver", auth.ScopeNode, time.Hour)
	e := &env{t: t, key: key}
	var infos []nodeclient.NodeInfo
	for _, id := range ids {
		n := newFakeNode(t, key, id)
		e.nodes = append(e.nodes, n)
		infos = append(infos, nodeclient.NodeInfo{ID: id, Addr: n.url})
	}
	dir := withNodes(t, nil, infos...)
	e.w = watcher.New(config.Watcher{PollIntervalMS: 100}, dir, nil, nodeTok)
	e.w.Poll(t.Context())
	// Nodes are reached with cleartext HTTP/2 only (the harder case: port
	// tunnels must still use HTTP/1.1).
	h2c := new(http.Protocols)
	h2c.SetUnencryptedHTTP2(true)
	nodeClient := &http.Client{Transport: &http.Transport{Protocols: h2c}}
	t.Cleanup(nodeClient.CloseIdleConnections)
	cfg := apiserver.Config{
		HTTPClient:   nodeClient,
		Nodes:        dir,
		Watcher:      e.w,
		NodeToken:    nodeTok,
		Auth:         auth.NewVerifier(key.PublicKey(), auth.ScopeAdmin, auth.ScopeUser),
		ViewTTL:      time.Nanosecond,
		ViewMaxStale: time.Nanosecond, // every placement sees the watcher's latest view
	}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := apiserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	ctx := t.Context() // not inside the goroutine: a fuzz target's F forbids it there
	go func() { done <- httpserver.Serve(ctx, "apiserver", ln, srv.Handler()) }()
	t.Cleanup(func() {
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	e.url = "http://" + ln.Addr().String()
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	e.hc = &http.Client{Transport: &http.Transport{Protocols: &p}}
	t.Cleanup(e.hc.CloseIdleConnections) // runs before the wait for Serve
	e.tok, _ = key.Issue("alice", auth.ScopeUser, time.Hour)
	c := auth.Client(e.hc, e.tok)
	e.sbx = opendsecv1connect.NewSandboxServiceClient(c, e.url, connect.WithGRPC())
	e.proc = opendsecv1connect.NewProcessServiceClient(c, e.url, connect.WithGRPC())
	e.files = opendsecv1connect.NewFileServiceClient(c, e.url, connect.WithGRPC())
	e.port = opendsecv1connect.NewPortServiceClient(c, e.url, connect.WithGRPC())
	return e
}

// withNodes returns a directory of dir's nodes (none if nil) with nodes
// added, each replacing a node of the same ID.
func withNodes(t testing.TB, dir nodeclient.Directory, nodes ...nodeclient.NodeInfo) nodeclient.Directory {
	t.Helper()
	var all []nodeclient.NodeInfo
	if dir != nil {
		var err error
		if all, err = dir.List(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range nodes {
		i := slices.IndexFunc(all, func(m nodeclient.NodeInfo) bool { return m.ID == n.ID })
		if i < 0 {
			all = append(all, n)
		} else {
			all[i] = n
		}
	}
	d, err := nodeclient.NewStaticDirectory(all...)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func (e *env) refresh() { e.w.Poll(e.t.Context()) }

func (e *env) create(spec *v1.SandboxSpec) *v1.Sandbox {
	e.t.Helper()
	resp, err := e.sbx.CreateSandbox(e.t.Context(), connect.NewRequest(&v1.CreateSandboxRequest{Spec: spec}))
	if err != nil {
		e.t.Fatalf("create: %v", err)
	}
	return resp.Msg.GetSandbox()
}

// wantField asserts err is InvalidArgument and its message names field.
func wantField(t *testing.T, err error, field string) {
	t.Helper()
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("err = %v, want invalid_argument naming %s", err, field)
	}
	var ce *connect.Error
	errors.As(err, &ce)
	if !strings.HasPrefix(ce.Message(), field+":") {
		t.Fatalf("message %q does not start with %q", ce.Message(), field+":")
	}
}

func wantCode(t *testing.T, err error, code connect.Code, contains string) {
	t.Helper()
	if connect.CodeOf(err) != code || !strings.Contains(fmt.Sprint(err), contains) {
		t.Fatalf("err = %v, want %s containing %q", err, code, contains)
	}
}

func busybox() *v1.SandboxSpec { return &v1.SandboxSpec{Image: "root/busybox"} }

func TestCreateValidation(t *testing.T) {
	e := setup(t, nil, "n001")
	for _, tc := range []struct {
		field string
		spec  *v1.SandboxSpec
	}{
		{"spec", nil},
		{"image", &v1.SandboxSpec{}},
		{"image", &v1.SandboxSpec{Image: "no/such:image"}},
		{"backend", &v1.SandboxSpec{Image: "root/busybox", Backend: "kvm"}},
		{"backend", &v1.SandboxSpec{Image: "root/busybox", Backend: "vm"}}, // known, but no node offers it
		{"cpu", &v1.SandboxSpec{Image: "root/busybox", Cpu: -1}},
		{"cpu", &v1.SandboxSpec{Image: "root/busybox", Cpu: 64}},
		{"memory_mb", &v1.SandboxSpec{Image: "root/busybox", MemoryMb: proto.Int64(-5)}},
		{"memory_mb", &v1.SandboxSpec{Image: "root/busybox", MemoryMb: proto.Int64(1 << 20)}},
		{"timeout_seconds", &v1.SandboxSpec{Image: "root/busybox", TimeoutSeconds: -1}},
		{"timeout_seconds", &v1.SandboxSpec{Image: "root/busybox", TimeoutSeconds: 86401}},
		{"idle_timeout_seconds", &v1.SandboxSpec{Image: "root/busybox", IdleTimeoutSeconds: -1}},
		{"pids_limit", &v1.SandboxSpec{Image: "root/busybox", PidsLimit: -1}},
		{"env", &v1.SandboxSpec{Image: "root/busybox", Env: map[string]string{"": "x"}}},
		{"env", &v1.SandboxSpec{Image: "root/busybox", Env: map[string]string{"A=B": "x"}}},
		{"labels", &v1.SandboxSpec{Image: "root/busybox", Labels: map[string]string{"bad key": "x"}}},
		{"user", &v1.SandboxSpec{Image: "root/busybox", User: "Robert'); DROP"}},
		{"workdir", &v1.SandboxSpec{Image: "root/busybox", Workdir: "relative"}},
	} {
		_, err := e.sbx.CreateSandbox(t.Context(), connect.NewRequest(&v1.CreateSandboxRequest{Spec: tc.spec}))
		wantField(t, err, tc.field)
	}
	// The memory error names the largest node's size.
	_, err := e.sbx.CreateSandbox(t.Context(), connect.NewRequest(&v1.CreateSandboxRequest{Spec: &v1.SandboxSpec{Image: "root/busybox", MemoryMb: proto.Int64(9000)}}))
	wantCode(t, err, connect.CodeInvalidArgument, "8192")
	if _, live := e.nodes[0].count(); live != 0 {
		t.Fatalf("%d sandboxes exist after only bad creates", live)
	}
}

func TestCreateDefaultsAndIdempotency(t *testing.T) {
	e := setup(t, nil, "n001")
	sb := e.create(&v1.SandboxSpec{Image: "root/busybox", Labels: map[string]string{"team": "rl"}})
	if !strings.HasPrefix(sb.GetId(), "n001") || len(sb.GetId()) != 20 {
		t.Fatalf("id %q does not encode node n001", sb.GetId())
	}
	got := e.nodes[0].specs[0]
	if got.GetMemoryMb() != 512 || got.GetCpu() != 1 || got.GetTimeoutSeconds() != 300 {
		t.Fatalf("node got spec %v, want defaults filled (512 MiB, 1 cpu, 300 s)", got)
	}
	req := &v1.CreateSandboxRequest{Spec: busybox(), RequestId: "retry-1"}
	a, err := e.sbx.CreateSandbox(t.Context(), connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	b, err := e.sbx.CreateSandbox(t.Context(), connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	if a.Msg.GetSandbox().GetId() != b.Msg.GetSandbox().GetId() {
		t.Fatalf("retry with the same request_id made a second sandbox: %s, %s", a.Msg.GetSandbox().GetId(), b.Msg.GetSandbox().GetId())
	}
	if _, live := e.nodes[0].count(); live != 2 {
		t.Fatalf("%d sandboxes, want 2", live)
	}
}

func TestCreateTriesNextNodeOnRefusal(t *testing.T) {
	e := setup(t, func(c *apiserver.Config) { c.PlacementSample = 2 }, "n001", "n002")
	// n002 is more loaded, so n001 is tried first and refuses.
	e.nodes[1].set(func(n *fakeNode) {
		n.sbs["n002xxxxxxxxxxxxxxxx"] = &nodev1.Sandbox{Id: "n002xxxxxxxxxxxxxxxx", NodeId: "n002", Spec: &nodev1.SandboxSpec{MemoryMb: proto.Int64(4096)}}
	})
	e.nodes[0].set(func(n *fakeNode) { n.refuse = true })
	e.refresh()
	sb := e.create(busybox())
	if sb.GetNodeId() != "n002" || !strings.HasPrefix(sb.GetId(), "n002") {
		t.Fatalf("placed on %s (%s), want n002", sb.GetNodeId(), sb.GetId())
	}
	if c, _ := e.nodes[0].count(); c != 1 {
		t.Fatalf("n001 got %d create calls, want 1 (tried first, refused)", c)
	}
	// Both refuse: resource_exhausted naming the nodes.
	e.nodes[1].set(func(n *fakeNode) { n.refuse = true })
	_, err := e.sbx.CreateSandbox(t.Context(), connect.NewRequest(&v1.CreateSandboxRequest{Spec: busybox()}))
	wantCode(t, err, connect.CodeResourceExhausted, "n001")
}

func TestRouting(t *testing.T) {
	e := setup(t, nil, "n001", "n002")
	e.nodes[0].set(func(n *fakeNode) { n.refuse = true })
	sb := e.create(busybox())
	if sb.GetNodeId() != "n002" {
		t.Fatalf("placed on %s, want n002", sb.GetNodeId())
	}
	got, err := e.sbx.GetSandbox(t.Context(), connect.NewRequest(&v1.GetSandboxRequest{Id: sb.GetId()}))
	if err != nil || got.Msg.GetSandbox().GetId() != sb.GetId() {
		t.Fatalf("get: %v %v", got, err)
	}
	st, err := e.sbx.SetTimeout(t.Context(), connect.NewRequest(&v1.SetTimeoutRequest{Id: sb.GetId(), TimeoutSeconds: 60}))
	if err != nil || st.Msg.GetSandbox().GetExpiresAt() == nil {
		t.Fatalf("set timeout: %v %v", st, err)
	}
	_, err = e.sbx.SetTimeout(t.Context(), connect.NewRequest(&v1.SetTimeoutRequest{Id: sb.GetId(), TimeoutSeconds: -1}))
	wantField(t, err, "timeout_seconds")

	_, err = e.sbx.GetSandbox(t.Context(), connect.NewRequest(&v1.GetSandboxRequest{Id: "n009aaaaaaaaaaaaaaaa"}))
	wantCode(t, err, connect.CodeNotFound, "sandbox n009aaaaaaaaaaaaaaaa not found")
	_, err = e.sbx.GetSandbox(t.Context(), connect.NewRequest(&v1.GetSandboxRequest{Id: "n001aaaaaaaaaaaaaaaa"}))
	wantCode(t, err, connect.CodeNotFound, "not found")
	_, err = e.sbx.GetSandbox(t.Context(), connect.NewRequest(&v1.GetSandboxRequest{Id: "Not-An-ID"}))
	wantField(t, err, "id")

	if _, err := e.sbx.StopSandbox(t.Context(), connect.NewRequest(&v1.StopSandboxRequest{Id: sb.GetId()})); err != nil {
		t.Fatal(err)
	}
	if _, live := e.nodes[1].count(); live != 0 {
		t.Fatal("stop did not reach the owning node")
	}
	_, err = e.sbx.StopSandbox(t.Context(), connect.NewRequest(&v1.StopSandboxRequest{Id: sb.GetId()}))
	wantCode(t, err, connect.CodeNotFound, "not found")
}

func TestList(t *testing.T) {
	e := setup(t, nil, "n001", "n002")
	e.nodes[0].set(func(n *fakeNode) { n.refuse = true })
	b := e.create(&v1.SandboxSpec{Image: "root/busybox", TaskId: "t1", Labels: map[string]string{"k": "v"}})
	e.nodes[0].set(func(n *fakeNode) { n.refuse = false })
	e.nodes[1].set(func(n *fakeNode) { n.refuse = true })
	a := e.create(&v1.SandboxSpec{Image: "root/busybox", TaskId: "t2"})
	e.refresh()
	ids := func(f *v1.ListSandboxesRequest) string {
		resp, err := e.sbx.ListSandboxes(t.Context(), connect.NewRequest(f))
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, sb := range resp.Msg.GetSandboxes() {
			out = append(out, sb.GetId())
		}
		return strings.Join(out, ",")
	}
	if got := ids(&v1.ListSandboxesRequest{}); got != b.GetId()+","+a.GetId() {
		t.Fatalf("all = %s, want both in creation order", got)
	}
	if got := ids(&v1.ListSandboxesRequest{TaskId: "t2"}); got != a.GetId() {
		t.Fatalf("task t2 = %s", got)
	}
	if got := ids(&v1.ListSandboxesRequest{Labels: map[string]string{"k": "v"}}); got != b.GetId() {
		t.Fatalf("label k=v = %s", got)
	}
	if got := ids(&v1.ListSandboxesRequest{Backend: "container"}); got != b.GetId()+","+a.GetId() {
		t.Fatalf("backend container = %s (node default applies)", got)
	}
	if got := ids(&v1.ListSandboxesRequest{Backend: "vm"}); got != "" {
		t.Fatalf("backend vm = %s", got)
	}
}

func TestBatch(t *testing.T) {
	e := setup(t, func(c *apiserver.Config) { c.BatchConcurrency = 3 }, "n001")
	e.nodes[0].set(func(n *fakeNode) { n.maxSbs = 3 })
	e.refresh()
	for _, count := range []int32{0, -1, apiserver.MaxBatch + 1} {
		stream, err := e.sbx.BatchCreateSandboxes(t.Context(), connect.NewRequest(&v1.BatchCreateSandboxesRequest{Spec: busybox(), Count: count}))
		if err == nil {
			for stream.Receive() {
			}
			err = stream.Err()
		}
		wantField(t, err, "count")
	}
	stream, err := e.sbx.BatchCreateSandboxes(t.Context(), connect.NewRequest(&v1.BatchCreateSandboxesRequest{Spec: busybox(), Count: 5, RequestId: "b"}))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int32]bool{}
	ok, failed := 0, 0
	for stream.Receive() {
		m := stream.Msg()
		if seen[m.GetIndex()] {
			t.Fatalf("index %d reported twice", m.GetIndex())
		}
		seen[m.GetIndex()] = true
		switch {
		case m.GetSandbox() != nil && m.GetErrorCode() == "":
			ok++
		case m.GetSandbox() == nil && m.GetErrorCode() == "resource_exhausted" && m.GetErrorMessage() != "":
			failed++
		default:
			t.Fatalf("item %v is neither a sandbox nor an error", m)
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if ok != 3 || failed != 2 || len(seen) != 5 {
		t.Fatalf("ok=%d failed=%d items=%d, want 3 sandboxes (node cap) and 2 per-item errors", ok, failed, len(seen))
	}
	n := e.nodes[0]
	n.mu.Lock()
	defer n.mu.Unlock()
	for rid := range n.byRequest {
		if !strings.HasPrefix(rid, "b-") {
			t.Fatalf("item request_id %q, want b-<index>", rid)
		}
	}
}

func TestAuth(t *testing.T) {
	e := setup(t, nil, "n001")
	noTok := opendsecv1connect.NewSandboxServiceClient(e.hc, e.url, connect.WithGRPC())
	_, err := noTok.ListSandboxes(t.Context(), connect.NewRequest(&v1.ListSandboxesRequest{}))
	wantCode(t, err, connect.CodeUnauthenticated, "missing token")

	bad := opendsecv1connect.NewSandboxServiceClient(auth.Client(e.hc, "odt_bogus.sig"), e.url)
	_, err = bad.ListSandboxes(t.Context(), connect.NewRequest(&v1.ListSandboxesRequest{}))
	wantCode(t, err, connect.CodeUnauthenticated, "invalid token")

	expired, _ := e.key.Issue("alice", auth.ScopeUser, time.Second)
	v := auth.NewVerifier(e.key.PublicKey())
	v.Now = func() time.Time { return time.Now().Add(time.Hour) }
	if _, err := v.Authenticate(http.Header{"Authorization": {"Bearer " + expired}}); err == nil || !strings.Contains(err.Error(), "token expired") {
		t.Fatalf("expired: %v", err)
	}
	// A node token is not for the public API.
	nodeTok, _ := e.key.Issue("svc", auth.ScopeNode, time.Hour)
	nc := opendsecv1connect.NewSandboxServiceClient(auth.Client(e.hc, nodeTok), e.url, connect.WithGRPC())
	_, err = nc.ListSandboxes(t.Context(), connect.NewRequest(&v1.ListSandboxesRequest{}))
	wantCode(t, err, connect.CodePermissionDenied, "scope")
	// Streams are checked too.
	ex := opendsecv1connect.NewProcessServiceClient(e.hc, e.url).Exec(t.Context())
	ex.Send(&v1.ExecRequest{Msg: &v1.ExecRequest_Start{Start: &v1.ExecStart{SandboxId: "n001aaaaaaaaaaaaaaaa", Command: []string{"echo"}}}})
	_, err = ex.Receive()
	wantCode(t, err, connect.CodeUnauthenticated, "missing token")
}
