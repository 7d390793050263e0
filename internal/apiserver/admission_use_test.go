package apiserver_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/apiserver"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/httpserver"
	"github.com/kernflux/opendsec/internal/node"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/watcher"
)

// heldImages is a node.ImageResolver handing out one empty layer.
type heldImages struct{ layer string }

func (i heldImages) Hold(context.Context, string, string) (runtime.Image, error) {
	return runtime.Image{Rootfs: runtime.Rootfs{Image: "root/busybox", Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: i.layer}}}}, nil
}

func (heldImages) Release(context.Context, string) error { return nil }

// realCluster is an apiserver with the production view settings in front
// of real nodes (internal/node on the fake backend) and a real watcher
// polling them in the background.
type realCluster struct {
	nodes []*node.Node
	sbx   opendsecv1connect.SandboxServiceClient
	// client returns a sandbox client calling as sub (user scope).
	client func(sub string) opendsecv1connect.SandboxServiceClient
}

// used is the CPU the nodes have reserved right now: the real use.
func (c *realCluster) used() float64 {
	var sum float64
	for _, n := range c.nodes {
		cpu, _, _ := n.Usage()
		sum += cpu
	}
	return sum
}

// newRealCluster starts len(ids) nodes of 1 core each (16 CPU of quota
// each, node.DefaultCPUOvercommit).
func newRealCluster(t *testing.T, ids ...string) *realCluster {
	t.Helper()
	return newRealClusterVia(t, nil, ids...)
}

// newRealClusterVia is newRealCluster with every node's handler wrapped in
// via (nil: none), e.g. a proxy that loses answers.
func newRealClusterVia(t *testing.T, via func(http.Handler) http.Handler, ids ...string) *realCluster {
	t.Helper()
	key, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	nodeTok, _ := key.Issue("apiserver", auth.ScopeNode, time.Hour)
	verify := auth.NewVerifier(key.PublicKey(), auth.ScopeNode).AcceptOnBehalf() // as a real node: owners are recorded
	c := &realCluster{}
	var infos []nodeclient.NodeInfo
	for _, id := range ids {
		rt := runtimefake.New(runtimefake.Config{StateRoot: t.Name() + "-" + id + "-" + fmt.Sprint(time.Now().UnixNano())})
		n, err := node.New(t.Context(), node.Config{
			ID:             id,
			StateDir:       t.TempDir(),
			Backends:       map[string]runtime.Runtime{runtimefake.Name: rt},
			DefaultBackend: runtimefake.Name,
			Images:         heldImages{layer: t.TempDir()},
			CPU:            1,
			MemoryMB:       1 << 20,
			MaxSandboxes:   1000,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			n.StopAll(context.Background(), "test cleanup")
			n.Close()
		})
		h := n.Handler(connect.WithInterceptors(verify.Interceptor()))
		if via != nil {
			h = via(h)
		}
		srv := httptest.NewUnstartedServer(h)
		srv.Config.Protocols = new(http.Protocols)
		srv.Config.Protocols.SetHTTP1(true)
		srv.Config.Protocols.SetUnencryptedHTTP2(true)
		srv.Start()
		t.Cleanup(srv.Close)
		c.nodes = append(c.nodes, n)
		infos = append(infos, nodeclient.NodeInfo{ID: id, Addr: srv.URL})
	}
	dir := withNodes(t, nil, infos...)
	w := watcher.New(config.Watcher{PollIntervalMS: 100}, dir, nil, nodeTok)
	w.Poll(t.Context())
	wctx, stopWatcher := context.WithCancel(t.Context())
	wdone := make(chan error, 1)
	go func() { wdone <- w.Run(wctx) }()
	t.Cleanup(func() {
		stopWatcher()
		<-wdone
	})
	h2c := new(http.Protocols)
	h2c.SetUnencryptedHTTP2(true)
	nodeClient := &http.Client{Transport: &http.Transport{Protocols: h2c}}
	t.Cleanup(nodeClient.CloseIdleConnections)
	// The production view settings: a view up to DefaultViewMaxStale old
	// serves while a fresh one is fetched.
	srv, err := apiserver.New(apiserver.Config{
		HTTPClient: nodeClient,
		Nodes:      dir,
		Watcher:    w,
		NodeToken:  nodeTok,
		Auth:       auth.NewVerifier(key.PublicKey(), auth.ScopeAdmin, auth.ScopeUser),
	})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- httpserver.Serve(t.Context(), "apiserver", ln, srv.Handler()) }()
	t.Cleanup(func() {
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	hc := &http.Client{Transport: &http.Transport{Protocols: h2c}}
	t.Cleanup(hc.CloseIdleConnections)
	c.client = func(sub string) opendsecv1connect.SandboxServiceClient {
		tok, _ := key.Issue(sub, auth.ScopeUser, time.Hour)
		return opendsecv1connect.NewSandboxServiceClient(auth.Client(hc, tok), "http://"+ln.Addr().String(), connect.WithGRPC())
	}
	c.sbx = c.client("alice")
	return c
}

func oneCPU() *v1.SandboxSpec {
	return &v1.SandboxSpec{Image: "root/busybox", Cpu: 1, MemoryMb: proto.Int64(64)}
}

func isRefusal(err error) bool {
	return connect.CodeOf(err) == connect.CodeResourceExhausted
}

// TestSecurityPlacementChurnNotRefused: 20 workers creating and stopping
// 1-CPU sandboxes against 32 CPU never hold more than 20 CPU, so no create
// may be refused; the in-flight overlay used to keep every finished create
// counted for seconds after its sandbox was stopped, and refused thousands.
func TestSecurityPlacementChurnNotRefused(t *testing.T) {
	c := newRealCluster(t, "n001", "n002")
	ctx := t.Context()
	const workers, rounds = 20, 40
	var refused, created atomic.Int64
	var maxUsed atomic.Int64
	var firstErr error
	var errOnce sync.Once
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range rounds {
				resp, err := c.sbx.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{Spec: oneCPU()}))
				if isRefusal(err) {
					refused.Add(1)
					errOnce.Do(func() { firstErr = err })
					continue
				}
				if err != nil {
					errOnce.Do(func() { firstErr = err })
					return
				}
				created.Add(1)
				if u := int64(c.used()); u > maxUsed.Load() {
					maxUsed.Store(u) // racy max; a report, not a check
				}
				if _, err := c.sbx.StopSandbox(ctx, connect.NewRequest(&v1.StopSandboxRequest{Id: resp.Msg.GetSandbox().GetId()})); err != nil {
					errOnce.Do(func() { firstErr = err })
					return
				}
			}
		})
	}
	wg.Wait()
	t.Logf("created %d, refused %d, real use seen up to %d of 32 CPU", created.Load(), refused.Load(), maxUsed.Load())
	if refused.Load() > 0 || firstErr != nil {
		t.Fatalf("%d of %d creates refused while real use never passed %d of 32 CPU; first error: %v",
			refused.Load(), workers*rounds, workers, firstErr)
	}
}

// TestSecurityPlacementRefusesAtCapacity: with the nodes' 32 CPU reserved,
// a create is refused; one stop later (the watcher not polled since), the
// next create is admitted at once.
func TestSecurityPlacementRefusesAtCapacity(t *testing.T) {
	c := newRealCluster(t, "n001", "n002")
	ctx := t.Context()
	var ids []string
	for i := range 32 {
		resp, err := c.sbx.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{Spec: oneCPU()}))
		if err != nil {
			t.Fatalf("create %d with %g of 32 CPU used: %v", i, c.used(), err)
		}
		ids = append(ids, resp.Msg.GetSandbox().GetId())
	}
	if u := c.used(); u != 32 {
		t.Fatalf("real use %g after 32 creates; want 32", u)
	}
	_, err := c.sbx.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{Spec: oneCPU()}))
	if !isRefusal(err) {
		t.Fatalf("create at capacity: %v; want resource_exhausted", err)
	}
	if u := c.used(); u != 32 {
		t.Fatalf("real use %g after a refused create; want 32", u)
	}
	for round := range 20 {
		if _, err := c.sbx.StopSandbox(ctx, connect.NewRequest(&v1.StopSandboxRequest{Id: ids[0]})); err != nil {
			t.Fatal(err)
		}
		ids = ids[1:]
		resp, err := c.sbx.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{Spec: oneCPU()}))
		if err != nil {
			t.Fatalf("round %d: create after a stop with %g of 32 CPU used: %v", round, c.used(), err)
		}
		ids = append(ids, resp.Msg.GetSandbox().GetId())
		_, err = c.sbx.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{Spec: oneCPU()}))
		if !isRefusal(err) {
			t.Fatalf("round %d: create at capacity: %v; want resource_exhausted", round, err)
		}
	}
}

// TestSecurityPlacementBatchMatchesUse: a batch of 40 against 32 CPU makes
// exactly 32 and refuses 8; after stopping them all, the next batch makes
// 32 again (nothing of the first batch is still counted).
func TestSecurityPlacementBatchMatchesUse(t *testing.T) {
	c := newRealCluster(t, "n001", "n002")
	ctx := t.Context()
	for round := range 3 {
		stream, err := c.sbx.BatchCreateSandboxes(ctx, connect.NewRequest(&v1.BatchCreateSandboxesRequest{Spec: oneCPU(), Count: 40}))
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		var refused int
		for stream.Receive() {
			m := stream.Msg()
			switch {
			case m.GetSandbox() != nil:
				ids = append(ids, m.GetSandbox().GetId())
			case m.GetErrorCode() == connect.CodeResourceExhausted.String():
				refused++
			default:
				t.Fatalf("round %d: item %d: %s: %s", round, m.GetIndex(), m.GetErrorCode(), m.GetErrorMessage())
			}
		}
		if err := stream.Err(); err != nil && !errors.Is(err, context.Canceled) {
			t.Fatal(err)
		}
		if len(ids) != 32 || refused != 8 || c.used() != 32 {
			t.Fatalf("round %d: batch of 40 against 32 CPU made %d, refused %d, real use %g; want 32, 8, 32", round, len(ids), refused, c.used())
		}
		for _, id := range ids {
			if _, err := c.sbx.StopSandbox(ctx, connect.NewRequest(&v1.StopSandboxRequest{Id: id})); err != nil {
				t.Fatal(err)
			}
		}
	}
}
