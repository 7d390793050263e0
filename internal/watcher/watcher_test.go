package watcher_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/watcher"
)

// fakeNode is an in-process NodeService whose answers the test controls.
type fakeNode struct {
	nodev1connect.UnimplementedNodeServiceHandler
	mu      sync.Mutex
	id      string
	fail    bool
	healthy bool
	sbs     []*nodev1.Sandbox
	// counts, when set, are the live counts Info reports (a current node);
	// nil, Info reports none (a node older than them).
	counts *[2]map[string]int64
	lists  int // ListSandboxes calls
}

func (f *fakeNode) Info(context.Context, *connect.Request[nodev1.InfoRequest]) (*connect.Response[nodev1.InfoResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("node is down"))
	}
	resp := &nodev1.InfoResponse{
		NodeId: f.id, Backends: []string{"container"}, DefaultBackend: "container", Healthy: f.healthy,
		Total: &nodev1.Capacity{Cpu: 4, MemoryMb: 4096, Sandboxes: 10},
	}
	if f.counts != nil {
		resp.SandboxCounts, resp.SandboxesByBackend, resp.SandboxesByTask = true, f.counts[0], f.counts[1]
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeNode) ListSandboxes(context.Context, *connect.Request[nodev1.ListSandboxesRequest]) (*connect.Response[nodev1.ListSandboxesResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lists++
	return connect.NewResponse(&nodev1.ListSandboxesResponse{Sandboxes: f.sbs}), nil
}

func (f *fakeNode) set(fn func(f *fakeNode)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

func startNode(t *testing.T, key *auth.Issuer, f *fakeNode) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(nodev1connect.NewNodeServiceHandler(f, connect.WithInterceptors(auth.NewVerifier(key.PublicKey(), auth.ScopeNode).Interceptor())))
	// Like a real node: HTTP/1.1 and cleartext HTTP/2, which the watcher
	// speaks by default.
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

func directory(t *testing.T, nodes ...nodeclient.NodeInfo) *nodeclient.StaticDirectory {
	t.Helper()
	d, err := nodeclient.NewStaticDirectory(nodes...)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func setup(t *testing.T, f ...*fakeNode) (*watcher.Watcher, *auth.Issuer) {
	t.Helper()
	key, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	tok, err := key.Issue("watcher", auth.ScopeNode, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	var nodes []nodeclient.NodeInfo
	for _, n := range f {
		nodes = append(nodes, nodeclient.NodeInfo{ID: n.id, Addr: startNode(t, key, n)})
	}
	return watcher.New(config.Watcher{PollIntervalMS: 50}, directory(t, nodes...), nil, tok), key
}

func byID(nodes []*watcherv1.NodeStatus, id string) *watcherv1.NodeStatus {
	for _, n := range nodes {
		if n.GetNodeId() == id {
			return n
		}
	}
	return nil
}

func TestPollBuildsView(t *testing.T) {
	a := &fakeNode{id: "n001", healthy: true, sbs: []*nodev1.Sandbox{
		{Id: "n001a", State: nodev1.SandboxState_SANDBOX_STATE_RUNNING, Spec: &nodev1.SandboxSpec{TaskId: "t1"}},
		{Id: "n001b", State: nodev1.SandboxState_SANDBOX_STATE_RUNNING, Spec: &nodev1.SandboxSpec{Backend: "container", TaskId: "t1"}},
		{Id: "n001c", State: nodev1.SandboxState_SANDBOX_STATE_STOPPED, Spec: &nodev1.SandboxSpec{TaskId: "t1"}},
	}}
	b := &fakeNode{id: "n002", fail: true}
	w, _ := setup(t, a, b)

	before := w.Nodes()
	if len(before) != 2 || before[0].GetHealthy() || before[1].GetHealthy() {
		t.Fatalf("before any poll every node must be unhealthy: %v", before)
	}
	w.Poll(t.Context())
	got := w.Nodes()
	na, nb := byID(got, "n001"), byID(got, "n002")
	if !na.GetHealthy() || na.GetInfo().GetTotal().GetMemoryMb() != 4096 || na.GetLastSeen() == nil {
		t.Fatalf("n001 = %v, want healthy with info", na)
	}
	if na.SandboxesByBackend["container"] != 2 || na.SandboxesByTask["t1"] != 2 {
		t.Fatalf("counts = %v %v, want 2 running container sandboxes of task t1", na.SandboxesByBackend, na.SandboxesByTask)
	}
	if nb.GetHealthy() || nb.GetLastError() == "" {
		t.Fatalf("n002 = %v, want unhealthy with the error", nb)
	}
}

// A node that counts its sandboxes in Info is not asked to list them; one
// older than the counts is, every poll.
func TestPollUsesNodeCounts(t *testing.T) {
	sbs := []*nodev1.Sandbox{{Id: "x", State: nodev1.SandboxState_SANDBOX_STATE_RUNNING, Spec: &nodev1.SandboxSpec{TaskId: "t1"}}}
	counting := &fakeNode{id: "n001", healthy: true, sbs: sbs,
		counts: &[2]map[string]int64{{"microvm": 3, "container": 1}, {"t9": 4}}}
	old := &fakeNode{id: "n002", healthy: true, sbs: sbs}
	w, _ := setup(t, counting, old)
	w.Poll(t.Context())
	w.Poll(t.Context())
	got := w.Nodes()
	na, nb := byID(got, "n001"), byID(got, "n002")
	counting.set(func(f *fakeNode) {
		if f.lists != 0 {
			t.Errorf("node with counts: %d ListSandboxes calls, want 0", f.lists)
		}
	})
	old.set(func(f *fakeNode) {
		if f.lists != 2 {
			t.Errorf("node without counts: %d ListSandboxes calls in 2 polls, want 2", f.lists)
		}
	})
	if !na.GetHealthy() || na.SandboxesByBackend["microvm"] != 3 || na.SandboxesByBackend["container"] != 1 || len(na.SandboxesByTask) != 1 || na.SandboxesByTask["t9"] != 4 {
		t.Fatalf("n001 = %v, want the node's counts", na)
	}
	if i := na.GetInfo(); i.GetSandboxCounts() || len(i.GetSandboxesByBackend()) != 0 || len(i.GetSandboxesByTask()) != 0 {
		t.Fatalf("n001 info keeps the counts (%v); they belong in NodeStatus only", i)
	}
	if !nb.GetHealthy() || nb.SandboxesByBackend["container"] != 1 || nb.SandboxesByTask["t1"] != 1 {
		t.Fatalf("n002 = %v, want the counts of its listed sandboxes", nb)
	}
}

func TestFailedPollsMarkUnhealthy(t *testing.T) {
	a := &fakeNode{id: "n001", healthy: true}
	w, _ := setup(t, a)
	w.Poll(t.Context())
	a.set(func(f *fakeNode) { f.fail = true })
	w.Poll(t.Context())
	if n := w.Nodes()[0]; !n.GetHealthy() || n.GetLastError() == "" {
		t.Fatalf("after one failure: %v, want still healthy with the error recorded", n)
	}
	w.Poll(t.Context())
	if n := w.Nodes()[0]; n.GetHealthy() {
		t.Fatalf("after %d failures: still healthy", watcher.FailureThreshold)
	}
	a.set(func(f *fakeNode) { f.fail = false })
	w.Poll(t.Context())
	if n := w.Nodes()[0]; !n.GetHealthy() || n.GetLastError() != "" {
		t.Fatalf("after recovery: %v", n)
	}
	a.set(func(f *fakeNode) { f.healthy = false })
	w.Poll(t.Context())
	if n := w.Nodes()[0]; n.GetHealthy() {
		t.Fatal("a node reporting itself unhealthy is shown healthy")
	}
}

func TestWrongNodeID(t *testing.T) {
	a := &fakeNode{id: "n009", healthy: true}
	w, _ := setup(t, a)
	// Configure it under another ID: the watcher must not trust it.
	w2 := watcher.New(config.Watcher{PollIntervalMS: 50}, directory(t, nodeclient.NodeInfo{ID: "n001", Addr: w.Nodes()[0].GetAddress()}), nil, "")
	w2.Poll(t.Context())
	if n := w2.Nodes()[0]; n.GetHealthy() {
		t.Fatalf("node with mismatched id marked healthy: %v", n)
	}
}

func TestRunServesListNodes(t *testing.T) {
	a := &fakeNode{id: "n001", healthy: true}
	w, key := setup(t, a)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()

	mux := http.NewServeMux()
	mux.Handle(w.Handler(connect.WithInterceptors(auth.NewVerifier(key.PublicKey()).Interceptor())))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	tok, _ := key.Issue("apiserver", auth.ScopeNode, time.Hour)
	client := watcherv1connect.NewWatcherServiceClient(auth.Client(srv.Client(), tok), srv.URL)

	// Sandboxes appear on the node; the running watcher must pick them up.
	a.set(func(f *fakeNode) {
		f.sbs = []*nodev1.Sandbox{{Id: "x", State: nodev1.SandboxState_SANDBOX_STATE_RUNNING, Spec: &nodev1.SandboxSpec{}}}
	})
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := client.ListNodes(t.Context(), connect.NewRequest(&watcherv1.ListNodesRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		if n := resp.Msg.GetNodes()[0]; n.GetHealthy() && n.SandboxesByBackend["container"] == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("watcher did not report the new sandbox: %v", resp.Msg)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
}

// movingDirectory is a node directory whose nodes the test changes, as
// registration will.
type movingDirectory struct {
	mu    sync.Mutex
	nodes []nodeclient.NodeInfo
	fail  error
}

func (d *movingDirectory) set(fail error, nodes ...nodeclient.NodeInfo) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.nodes, d.fail = nodes, fail
}

func (d *movingDirectory) Lookup(ctx context.Context, id string) (nodeclient.NodeInfo, error) {
	nodes, err := d.List(ctx)
	for _, n := range nodes {
		if n.ID == id {
			return n, nil
		}
	}
	if err == nil {
		err = errors.New("node " + id + " is not registered")
	}
	return nodeclient.NodeInfo{}, err
}

func (d *movingDirectory) List(context.Context) ([]nodeclient.NodeInfo, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]nodeclient.NodeInfo(nil), d.nodes...), d.fail
}

// TestPollFollowsTheDirectory: every poll reads the directory, so a node
// that joins is polled, one that leaves drops out of the view, one that
// moves is polled at its new address, and a directory that cannot answer
// leaves the view as it was.
func TestPollFollowsTheDirectory(t *testing.T) {
	key, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	tok, _ := key.Issue("watcher", auth.ScopeNode, time.Hour)
	a := nodeclient.NodeInfo{ID: "n001", Addr: startNode(t, key, &fakeNode{id: "n001", healthy: true})}
	b := nodeclient.NodeInfo{ID: "n002", Addr: startNode(t, key, &fakeNode{id: "n002", healthy: true})}
	d := &movingDirectory{}
	d.set(nil, a)
	w := watcher.New(config.Watcher{PollIntervalMS: 50}, d, nil, tok)
	ids := func() (out []string) {
		for _, n := range w.Nodes() {
			h := "down"
			if n.GetHealthy() {
				h = "up"
			}
			out = append(out, n.GetNodeId()+"@"+n.GetAddress()+" "+h)
		}
		return out
	}
	w.Poll(t.Context())
	if got := ids(); len(got) != 1 || got[0] != "n001@"+a.Addr+" up" {
		t.Fatalf("view %v, want n001 up", got)
	}
	d.set(nil, a, b)
	w.Poll(t.Context())
	if got := ids(); len(got) != 2 || got[1] != "n002@"+b.Addr+" up" {
		t.Fatalf("after n002 joined: %v", got)
	}
	// n002 moves to where n001 listens: it answers as n001 there, so it
	// is down at its new address; n001 leaves.
	d.set(nil, nodeclient.NodeInfo{ID: "n002", Addr: a.Addr})
	w.Poll(t.Context())
	if got := ids(); len(got) != 1 || got[0] != "n002@"+a.Addr+" down" {
		t.Fatalf("after n001 left and n002 moved: %v", got)
	}
	d.set(errors.New("registry down"))
	w.Poll(t.Context())
	if got := ids(); len(got) != 1 || got[0] != "n002@"+a.Addr+" down" {
		t.Fatalf("directory down: %v, want the last view", got)
	}
}
