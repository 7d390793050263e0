package apiserver_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/internal/apiserver"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// fakeReclaimBytes is what the fake node's reclaim frees per sandbox.
const fakeReclaimBytes = 20 << 20

// The fake node's pause: it flips the state of matching sandboxes; with
// reclaim each frees fakeReclaimBytes.
func (n *fakeNode) PauseSandboxes(ctx context.Context, req *connect.Request[nodev1.PauseSandboxesRequest]) (*connect.Response[nodev1.PauseSandboxesResponse], error) {
	if req.Msg.GetReclaim() && n.reclaimDelay > 0 {
		select {
		case <-time.After(n.reclaimDelay):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	out := &nodev1.PauseSandboxesResponse{Sandboxes: n.setMatching(req.Msg.GetSelector(), nodev1.SandboxState_SANDBOX_STATE_PAUSED)}
	if req.Msg.GetReclaim() {
		for _, sb := range out.Sandboxes {
			out.Reclaimed = append(out.Reclaimed, &nodev1.SandboxReclaim{SandboxId: sb.GetId(), BytesBefore: fakeReclaimBytes + 4096, BytesAfter: 4096, BytesFreed: fakeReclaimBytes})
			out.BytesFreed += fakeReclaimBytes
		}
	}
	return connect.NewResponse(out), nil
}

func (n *fakeNode) ResumeSandboxes(_ context.Context, req *connect.Request[nodev1.ResumeSandboxesRequest]) (*connect.Response[nodev1.ResumeSandboxesResponse], error) {
	return connect.NewResponse(&nodev1.ResumeSandboxesResponse{Sandboxes: n.setMatching(req.Msg.GetSelector(), nodev1.SandboxState_SANDBOX_STATE_RUNNING)}), nil
}

func (n *fakeNode) PauseSandbox(_ context.Context, req *connect.Request[nodev1.PauseSandboxRequest]) (*connect.Response[nodev1.PauseSandboxResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	sb, err := n.get(req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	sb.State = nodev1.SandboxState_SANDBOX_STATE_PAUSED
	return connect.NewResponse(&nodev1.PauseSandboxResponse{Sandbox: sb}), nil
}

func (n *fakeNode) setMatching(sel *nodev1.SandboxSelector, st nodev1.SandboxState) []*nodev1.Sandbox {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []*nodev1.Sandbox
	for id, sb := range n.sbs {
		if sel.GetTaskId() != "" && sb.GetSpec().GetTaskId() != sel.GetTaskId() {
			continue
		}
		if ids := sel.GetIds(); len(ids) > 0 && !contains(ids, id) {
			continue
		}
		sb.State = st
		out = append(out, sb)
	}
	return out
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

func TestPauseSandboxesFansOutToEveryNode(t *testing.T) {
	e := setup(t, nil, "n001", "n002")
	// Placement picks among sampled nodes, so create until the job is on
	// both (at least 6 sandboxes); 64 on one node would be a placement bug.
	var job []*v1.Sandbox
	perNode := map[string]int{}
	for len(job) < 6 || len(perNode) < 2 {
		if len(job) == 64 {
			t.Fatalf("placement used %d nodes for %d sandboxes; the test needs both", len(perNode), len(job))
		}
		sb := e.create(&v1.SandboxSpec{Image: "root/busybox", TaskId: "job"})
		job = append(job, sb)
		perNode[sb.GetNodeId()]++
	}
	other := e.create(&v1.SandboxSpec{Image: "root/busybox", TaskId: "other"})
	resp, err := e.sbx.PauseSandboxes(t.Context(), connect.NewRequest(&v1.PauseSandboxesRequest{Selector: &v1.SandboxSelector{TaskId: "job"}}))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Msg.GetSandboxes()) != len(job) || len(resp.Msg.GetFailures()) != 0 {
		t.Fatalf("paused %d, failures %v; want %d and none", len(resp.Msg.GetSandboxes()), resp.Msg.GetFailures(), len(job))
	}
	for _, sb := range resp.Msg.GetSandboxes() {
		if sb.GetState() != v1.SandboxState_SANDBOX_STATE_PAUSED || sb.GetSpec().GetTaskId() != "job" {
			t.Fatalf("answer %s: state %s task %q", sb.GetId(), sb.GetState(), sb.GetSpec().GetTaskId())
		}
	}
	got, err := e.sbx.GetSandbox(t.Context(), connect.NewRequest(&v1.GetSandboxRequest{Id: other.GetId()}))
	if err != nil || got.Msg.GetSandbox().GetState() != v1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("sandbox of another task: %v %v", got, err)
	}

	// By ids: only the owning nodes, and an id of an unknown node fails alone.
	ids := []string{job[0].GetId(), "zzzz" + job[0].GetId()[4:]}
	r2, err := e.sbx.ResumeSandboxes(t.Context(), connect.NewRequest(&v1.ResumeSandboxesRequest{Selector: &v1.SandboxSelector{Ids: ids}}))
	if err != nil {
		t.Fatal(err)
	}
	if len(r2.Msg.GetSandboxes()) != 1 || r2.Msg.GetSandboxes()[0].GetId() != job[0].GetId() {
		t.Fatalf("resumed %v, want only %s", r2.Msg.GetSandboxes(), job[0].GetId())
	}
	if f := r2.Msg.GetFailures(); len(f) != 1 || f[0].GetSandboxId() != ids[1] || f[0].GetErrorCode() != "not_found" {
		t.Fatalf("failures %v, want one not_found for %s", f, ids[1])
	}
}

func TestBatchPauseBadInput(t *testing.T) {
	e := setup(t, nil, "n001")
	_, err := e.sbx.PauseSandboxes(t.Context(), connect.NewRequest(&v1.PauseSandboxesRequest{}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("empty selector: %v, want invalid_argument", err)
	}
	_, err = e.sbx.ResumeSandboxes(t.Context(), connect.NewRequest(&v1.ResumeSandboxesRequest{Selector: &v1.SandboxSelector{TaskId: "x"}, TimeoutSeconds: -1}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("negative timeout: %v, want invalid_argument", err)
	}
	_, err = e.sbx.PauseSandbox(t.Context(), connect.NewRequest(&v1.PauseSandboxRequest{}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("empty id: %v, want invalid_argument", err)
	}
}

// unhealthyView reports some nodes unhealthy, as the watcher does for a
// node that missed its polls.
type unhealthyView struct {
	apiserver.WatcherClient
	down map[string]bool
}

func (u unhealthyView) ListNodes(ctx context.Context, req *connect.Request[watcherv1.ListNodesRequest]) (*connect.Response[watcherv1.ListNodesResponse], error) {
	resp, err := u.WatcherClient.ListNodes(ctx, req)
	if err != nil {
		return nil, err
	}
	for _, st := range resp.Msg.GetNodes() {
		if u.down[st.GetNodeId()] {
			st.Healthy = false
		}
	}
	return resp, nil
}

// A batch pause asks every configured node: one the watcher marks
// unhealthy still pauses its sandboxes, and one that cannot be reached is a
// failure naming it.
func TestPauseSandboxesReachesUnhealthyAndReportsUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there now
	e := setup(t, func(c *apiserver.Config) {
		c.Watcher = unhealthyView{WatcherClient: c.Watcher, down: map[string]bool{"n002": true}}
		c.Nodes = withNodes(t, c.Nodes, nodeclient.NodeInfo{ID: "n003", Addr: deadAddr})
	}, "n001", "n002")
	var onN002 []string
	for _, n := range e.nodes {
		n.set(func(n *fakeNode) {
			for i := range 2 {
				id := n.id + fmt.Sprintf("job%012d", i)
				n.sbs[id] = &nodev1.Sandbox{Id: id, NodeId: n.id, State: nodev1.SandboxState_SANDBOX_STATE_RUNNING, Spec: &nodev1.SandboxSpec{TaskId: "job"}}
				if n.id == "n002" {
					onN002 = append(onN002, id)
				}
			}
		})
	}
	resp, err := e.sbx.PauseSandboxes(t.Context(), connect.NewRequest(&v1.PauseSandboxesRequest{Selector: &v1.SandboxSelector{TaskId: "job"}}))
	if err != nil {
		t.Fatal(err)
	}
	paused := map[string]bool{}
	for _, sb := range resp.Msg.GetSandboxes() {
		paused[sb.GetId()] = true
	}
	for _, id := range onN002 {
		if !paused[id] {
			t.Errorf("sandbox %s on the unhealthy node n002 was not paused (paused: %v)", id, paused)
		}
	}
	if len(paused) != 4 {
		t.Errorf("paused %d sandboxes, want 4", len(paused))
	}
	f := resp.Msg.GetFailures()
	if len(f) != 1 || f[0].GetSandboxId() != "" || f[0].GetErrorCode() != "unavailable" || !strings.Contains(f[0].GetErrorMessage(), "n003") {
		t.Fatalf("failures %v, want one unavailable failure naming node n003", f)
	}
}

// silentNode accepts connections on loopback and never answers, like a node
// whose packets are dropped after the connection was made.
func silentNode(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return "http://" + ln.Addr().String()
}

// A node that never answers costs a batch pause or resume only the per-node
// timeout: the other nodes' results come back, and the silent node is one
// deadline_exceeded failure naming it.
func TestBatchPauseSilentNodeTimesOut(t *testing.T) {
	const perNode = 300 * time.Millisecond
	e := setup(t, func(c *apiserver.Config) {
		c.BatchNodeTimeout = perNode
		c.Nodes = withNodes(t, c.Nodes, nodeclient.NodeInfo{ID: "n009", Addr: silentNode(t)})
	}, "n001")
	id := "n001" + fmt.Sprintf("job%012d", 0)
	e.nodes[0].set(func(n *fakeNode) {
		n.sbs[id] = &nodev1.Sandbox{Id: id, NodeId: n.id, State: nodev1.SandboxState_SANDBOX_STATE_RUNNING, Spec: &nodev1.SandboxSpec{TaskId: "job"}}
	})
	for _, op := range []string{"pause", "resume"} {
		// The caller allows far longer than the per-node timeout: without
		// that timeout the call would use all of it and fail.
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		start := time.Now()
		var (
			sbs []*v1.Sandbox
			f   []*v1.BatchFailure
			err error
		)
		sel := &v1.SandboxSelector{TaskId: "job"}
		if op == "pause" {
			var resp *connect.Response[v1.PauseSandboxesResponse]
			resp, err = e.sbx.PauseSandboxes(ctx, connect.NewRequest(&v1.PauseSandboxesRequest{Selector: sel}))
			if err == nil {
				sbs, f = resp.Msg.GetSandboxes(), resp.Msg.GetFailures()
			}
		} else {
			var resp *connect.Response[v1.ResumeSandboxesResponse]
			resp, err = e.sbx.ResumeSandboxes(ctx, connect.NewRequest(&v1.ResumeSandboxesRequest{Selector: sel}))
			if err == nil {
				sbs, f = resp.Msg.GetSandboxes(), resp.Msg.GetFailures()
			}
		}
		took := time.Since(start)
		cancel()
		if err != nil {
			t.Fatalf("%s after %s: %v", op, took, err)
		}
		if took > 10*time.Second {
			t.Errorf("%s took %s; the silent node should cost about %s", op, took, perNode)
		}
		if len(sbs) != 1 || sbs[0].GetId() != id {
			t.Errorf("%s: changed %v, want only %s", op, sbs, id)
		}
		if len(f) != 1 || f[0].GetSandboxId() != "" || f[0].GetErrorCode() != "deadline_exceeded" ||
			!strings.Contains(f[0].GetErrorMessage(), "n009") || !strings.Contains(f[0].GetErrorMessage(), perNode.String()) {
			t.Errorf("%s: failures %v, want one deadline_exceeded failure naming node n009 and %s", op, f, perNode)
		}
	}
}
