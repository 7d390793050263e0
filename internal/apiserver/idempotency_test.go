package apiserver_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// answerProxy sits between the apiserver and a node: every CreateSandbox
// reaches the node, and lose decides for the n-th one (from 1) whether its
// answer is lost: dropAnswer resets the stream after the node answered,
// holdAnswer keeps the answer until the apiserver gives up on the call.
// Every other call passes unchanged.
type answerProxy struct {
	next http.Handler
	lose func(n int) loss

	mu      sync.Mutex
	creates int
	stops   int
	// answered is signalled each time the node answered a create whose
	// answer is held.
	answered chan struct{}
}

type loss int

const (
	deliver loss = iota
	dropAnswer
	holdAnswer
)

func (p *answerProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case nodev1connect.NodeServiceStopSandboxProcedure:
		p.mu.Lock()
		p.stops++
		p.mu.Unlock()
	case nodev1connect.NodeServiceCreateSandboxProcedure:
		p.mu.Lock()
		p.creates++
		l := p.lose(p.creates)
		p.mu.Unlock()
		switch l {
		case dropAnswer:
			// The node makes the sandbox; the apiserver never hears.
			p.next.ServeHTTP(httptest.NewRecorder(), r)
			panic(http.ErrAbortHandler)
		case holdAnswer:
			p.next.ServeHTTP(httptest.NewRecorder(), r.WithContext(context.WithoutCancel(r.Context())))
			p.answered <- struct{}{}
			<-r.Context().Done() // the apiserver gave up: the answer is lost
			return
		}
	}
	p.next.ServeHTTP(w, r)
}

func (p *answerProxy) counts() (creates, stops int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.creates, p.stops
}

func proxied(t *testing.T, lose func(n int) loss) (*realCluster, *answerProxy) {
	t.Helper()
	p := &answerProxy{lose: lose, answered: make(chan struct{}, 1)}
	c := newRealClusterVia(t, func(h http.Handler) http.Handler { p.next = h; return p }, "n001")
	return c, p
}

// nodeIDs is every sandbox on the cluster's one node, sorted (listed
// through the apiserver, checked against the node's own count); each must
// be running.
func (c *realCluster) nodeIDs(t *testing.T) []string {
	t.Helper()
	resp, err := c.sbx.ListSandboxes(t.Context(), connect.NewRequest(&v1.ListSandboxesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, sb := range resp.Msg.GetSandboxes() {
		if sb.GetState() != v1.SandboxState_SANDBOX_STATE_RUNNING {
			t.Errorf("sandbox %s is %s; want running", sb.GetId(), sb.GetState())
		}
		ids = append(ids, sb.GetId())
	}
	if _, _, n := c.nodes[0].Usage(); n != len(ids) {
		t.Fatalf("node holds %d sandboxes, the list shows %d", n, len(ids))
	}
	slices.Sort(ids)
	return ids
}

// TestIdempotentCreateLostAnswer: the node made the sandbox but its answer
// never reached the apiserver (the proxy reset the stream); the caller's
// retry with the same request_id gets that sandbox, and the node has one.
func TestIdempotentCreateLostAnswer(t *testing.T) {
	c, p := proxied(t, func(n int) loss {
		if n == 1 {
			return dropAnswer
		}
		return deliver
	})
	req := &v1.CreateSandboxRequest{Spec: oneCPU(), RequestId: "lost-answer-1"}
	if _, err := c.sbx.CreateSandbox(t.Context(), connect.NewRequest(req)); err == nil {
		t.Fatal("create whose answer the proxy dropped succeeded; want an error")
	}
	made := c.nodeIDs(t)
	if len(made) != 1 {
		t.Fatalf("node has %v after the lost answer; want the one sandbox it made", made)
	}
	resp, err := c.sbx.CreateSandbox(t.Context(), connect.NewRequest(req))
	if err != nil {
		t.Fatalf("retry with the same request_id: %v", err)
	}
	if got := resp.Msg.GetSandbox().GetId(); got != made[0] {
		t.Fatalf("retry returned sandbox %s; want %s, the one the node made for the lost answer", got, made[0])
	}
	if ids := c.nodeIDs(t); !slices.Equal(ids, made) {
		t.Fatalf("node has %v after the retry; want exactly %v", ids, made)
	}
	if creates, _ := p.counts(); creates != 2 {
		t.Fatalf("node saw %d creates; want 2 (the lost one and the retry)", creates)
	}
}

// TestIdempotentCreateClientTimeout: the client gives up (its context ends)
// after the node made the sandbox and before the answer came back; the
// apiserver must not stop that sandbox behind the caller's back, and the
// retry with the same request_id gets it, running.
func TestIdempotentCreateClientTimeout(t *testing.T) {
	c, p := proxied(t, func(n int) loss {
		if n == 1 {
			return holdAnswer
		}
		return deliver
	})
	req := &v1.CreateSandboxRequest{Spec: oneCPU(), RequestId: "client-timeout-1"}
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		<-p.answered // the node made it; the client times out now
		cancel()
	}()
	if _, err := c.sbx.CreateSandbox(ctx, connect.NewRequest(req)); connect.CodeOf(err) != connect.CodeCanceled {
		t.Fatalf("create the client gave up on: %v; want canceled", err)
	}
	made := c.nodeIDs(t)
	if len(made) != 1 {
		t.Fatalf("node has %v after the client's timeout; want the one sandbox it made", made)
	}
	resp, err := c.sbx.CreateSandbox(t.Context(), connect.NewRequest(req))
	if err != nil {
		t.Fatalf("retry with the same request_id: %v", err)
	}
	if got := resp.Msg.GetSandbox().GetId(); got != made[0] {
		t.Fatalf("retry returned sandbox %s; want %s, the one made before the timeout", got, made[0])
	}
	if _, err := c.sbx.GetSandbox(t.Context(), connect.NewRequest(&v1.GetSandboxRequest{Id: made[0]})); err != nil {
		t.Fatalf("get the sandbox after the retry: %v", err)
	}
	if ids := c.nodeIDs(t); !slices.Equal(ids, made) {
		t.Fatalf("node has %v after the retry; want exactly %v", ids, made)
	}
	if _, stops := p.counts(); stops != 0 {
		t.Fatalf("the apiserver sent %d stops for the sandbox the caller will retry for; want none", stops)
	}
}

// TestIdempotentBatchLostAnswers: in a batch of 12 with a request_id the
// answers of the 3rd and 8th creates are lost (those items fail); the same
// batch again returns every sandbox already made under its index and makes
// only the missing ones: exactly 12 on the node.
func TestIdempotentBatchLostAnswers(t *testing.T) {
	const count = 12
	c, _ := proxied(t, func(n int) loss {
		if n == 3 || n == 8 {
			return dropAnswer
		}
		return deliver
	})
	spec := oneCPU()
	spec.Cpu = 0.5
	run := func() map[int32]string {
		st, err := c.sbx.BatchCreateSandboxes(t.Context(), connect.NewRequest(&v1.BatchCreateSandboxesRequest{Spec: spec, Count: count, RequestId: "batch-lost-1"}))
		if err != nil {
			t.Fatal(err)
		}
		got := map[int32]string{}
		for st.Receive() {
			if m := st.Msg(); m.GetSandbox() != nil {
				got[m.GetIndex()] = m.GetSandbox().GetId()
			}
		}
		if err := st.Err(); err != nil {
			t.Fatal(err)
		}
		return got
	}
	first := run()
	if len(first) != count-2 {
		t.Fatalf("first batch delivered %d sandboxes; want %d (two answers lost)", len(first), count-2)
	}
	if ids := c.nodeIDs(t); len(ids) != count {
		t.Fatalf("node has %d sandboxes after the first batch; want %d (it made the lost ones too)", len(ids), count)
	}
	second := run()
	if len(second) != count {
		t.Fatalf("retried batch delivered %d sandboxes; want %d", len(second), count)
	}
	for i, id := range first {
		if second[i] != id {
			t.Errorf("item %d: retry returned %s; want %s, the sandbox made the first time", i, second[i], id)
		}
	}
	want := make([]string, 0, count)
	for _, id := range second {
		want = append(want, id)
	}
	slices.Sort(want)
	if ids := c.nodeIDs(t); !slices.Equal(ids, want) {
		t.Fatalf("node has %v; want exactly the retried batch's %v", ids, want)
	}
	if len(slices.Compact(slices.Clone(want))) != count {
		t.Fatal(errors.New(fmt.Sprint("duplicate sandbox IDs in the batch: ", want)))
	}
}
