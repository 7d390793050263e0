package daemon

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/testutil"
)

// remoteNode is a second node on loopback (h2c) that counts the calls it
// gets and answers GetSandbox with a not_found of its own wording.
type remoteNode struct {
	nodev1connect.UnimplementedNodeServiceHandler
	gets atomic.Int64
}

func (r *remoteNode) Info(context.Context, *connect.Request[nodev1.InfoRequest]) (*connect.Response[nodev1.InfoResponse], error) {
	return connect.NewResponse(&nodev1.InfoResponse{NodeId: "n002", Healthy: true}), nil
}

func (r *remoteNode) GetSandbox(_ context.Context, req *connect.Request[nodev1.GetSandboxRequest]) (*connect.Response[nodev1.GetSandboxResponse], error) {
	r.gets.Add(1)
	return nil, connect.NewError(connect.CodeNotFound, errors.New("remote node n002 has no "+req.Msg.GetSandboxId()))
}

// `opendsec up` calls its own node in-process (same handler, so the
// node's token checks and error mapping), and a second, remote node in
// nodes[] over the network.
func TestUpCallsItsNodeInProcess(t *testing.T) {
	testutil.RequiresRoot(t)
	var ip atomic.Pointer[nodeclient.InProcess]
	testHookInProcess = func(t *nodeclient.InProcess) { ip.Store(t) }
	defer func() { testHookInProcess = nil }()

	remote := &remoteNode{}
	mux := http.NewServeMux()
	mux.Handle(nodev1connect.NewNodeServiceHandler(remote))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	defer srv.Close()

	s := startUpWith(t, false, func(c *config.Config) {
		c.Nodes = append(c.Nodes, config.NodeRef{ID: "n002", Address: srv.URL})
	})
	local := ip.Load()
	if local == nil {
		t.Fatal("up built no in-process transport for its node")
	}
	key, err := loadIssuer(t.Context(), s.cfg)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := EnsureBootstrapToken(s.cfg, key)
	if err != nil {
		t.Fatal(err)
	}
	api := opendsecv1connect.NewSandboxServiceClient(h2cClient(), "http://"+s.api, connect.WithInterceptors(auth.ClientInterceptor(admin)))

	before := local.Served()
	_, err = api.GetSandbox(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: s.cfg.Node.ID + "zzzzzzzzzzzzzzzz"}))
	if connect.CodeOf(err) != connect.CodeNotFound || strings.Contains(err.Error(), "remote node") {
		t.Fatalf("get of an unknown sandbox on the local node: %v; want its not_found", err)
	}
	if got := local.Served() - before; got != 1 {
		t.Fatalf("the local node served %d of the apiserver's calls in-process, want 1", got)
	}

	before = local.Served()
	_, err = api.GetSandbox(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: "n002zzzzzzzzzzzzzzzz"}))
	if connect.CodeOf(err) != connect.CodeNotFound || !strings.Contains(err.Error(), "remote node n002") {
		t.Fatalf("get on the remote node: %v; want its not_found", err)
	}
	if remote.gets.Load() != 1 || local.Served() != before {
		t.Fatalf("remote node got %d calls over the network, %d went in-process; want 1 and 0", remote.gets.Load(), local.Served()-before)
	}
	s.stop(t)
}
