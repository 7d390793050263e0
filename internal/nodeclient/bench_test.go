package nodeclient_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	"github.com/kernflux/opendsec/internal/auth"

	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// BenchmarkForSandbox is the routing cost every sandbox call now pays: ID
// check, directory lookup, cached client (1000 configured nodes).
func BenchmarkForSandbox(b *testing.B) {
	var nodes []nodeclient.NodeInfo
	for i := range 1000 {
		nodes = append(nodes, nodeclient.NodeInfo{ID: fmt.Sprintf("n%03d", i), Addr: fmt.Sprintf("http://10.0.%d.%d:7071", i/256, i%256)})
	}
	d, err := nodeclient.NewStaticDirectory(nodes...)
	if err != nil {
		b.Fatal(err)
	}
	p := nodeclient.NewPool(d, nodeclient.Options{})
	ctx := b.Context()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := p.ForSandbox(ctx, "id", "n517aaaaaaaaaaaaaaaa"); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkSandboxIDCheck is the part of ForSandbox the apiserver paid
// before the directory (the ID's format check), for comparison.
func BenchmarkSandboxIDCheck(b *testing.B) {
	for b.Loop() {
		if _, err := sandboxid.Node("id", "n517aaaaaaaaaaaaaaaa"); err != nil {
			b.Fatal(err)
		}
	}
}

// benchNode answers GetSandbox with a sandbox of about the size a create
// answers with.
type benchNode struct {
	nodev1connect.UnimplementedNodeServiceHandler
}

func (benchNode) GetSandbox(_ context.Context, req *connect.Request[nodev1.GetSandboxRequest]) (*connect.Response[nodev1.GetSandboxResponse], error) {
	return connect.NewResponse(&nodev1.GetSandboxResponse{Sandbox: &nodev1.Sandbox{
		Id: req.Msg.GetSandboxId(), State: nodev1.SandboxState_SANDBOX_STATE_RUNNING,
		Reason: strings.Repeat("r", 300),
	}}), nil
}

// cpuPerOp reports the process's CPU (user+system) per iteration.
func cpuPerOp(b *testing.B, run func()) {
	var before, after syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &before)
	run()
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &after)
	ns := func(r syscall.Rusage) int64 { return r.Utime.Nano() + r.Stime.Nano() }
	b.ReportMetric(float64(ns(after)-ns(before))/float64(b.N), "cpu-ns/op")
}

// BenchmarkNodeCall is one unary node call with a service token (verified
// by the node's interceptor), 8 in flight, over loopback h2c as between
// separate binaries and in-process as in `opendsec up`.
func BenchmarkNodeCall(b *testing.B) {
	key, err := auth.GenerateIssuer()
	if err != nil {
		b.Fatal(err)
	}
	tok, err := key.Issue("bench", auth.ScopeNode, time.Hour)
	if err != nil {
		b.Fatal(err)
	}
	v := auth.NewVerifier(key.PublicKey(), auth.ScopeNode)
	mux := http.NewServeMux()
	mux.Handle(nodev1connect.NewNodeServiceHandler(benchNode{}, connect.WithInterceptors(v.Interceptor()), connect.WithCompressMinBytes(16<<10)))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	defer srv.Close()
	h2c := nodeclient.DefaultHTTPClient()
	ip, err := nodeclient.NewInProcess(srv.URL, mux, h2c.Transport)
	if err != nil {
		b.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		hc   *http.Client
	}{{"h2c", h2c}, {"in-process", &http.Client{Transport: ip}}} {
		b.Run(tc.name, func(b *testing.B) {
			c, err := nodeclient.New(nodeclient.NodeInfo{ID: "n001", Addr: srv.URL}, nodeclient.Options{HTTPClient: tc.hc, Tokens: auth.StaticToken(tok)})
			if err != nil {
				b.Fatal(err)
			}
			ctx := b.Context()
			b.ReportAllocs()
			b.SetParallelism(4) // 8 in flight on 2 CPUs
			cpuPerOp(b, func() {
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if _, err := c.Node().GetSandbox(ctx, connect.NewRequest(&nodev1.GetSandboxRequest{SandboxId: "n001aaaaaaaaaaaaaaaa"})); err != nil {
							b.Error(err)
							return
						}
					}
				})
			})
		})
	}
}
