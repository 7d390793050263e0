package node

import (
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/testutil"
)

// TestImportInternalRegistryNeedsAdmin serves NodeImageService behind the
// node's authentication and imports from a registry whose name resolves,
// at the node, to loopback (what DNS rebinding makes of a name the
// apiserver saw public). The apiserver's hop (node-scope token) without
// an admin caller's forwarded token (auth.OnBehalfHeader) is refused and
// nothing reaches the registry; on behalf of an admin, or with an admin
// token, the import goes through. A
// user-scope token cannot call the node at all.
func TestImportInternalRegistryNeedsAdmin(t *testing.T) {
	testutil.RequiresRoot(t) // the import keeps the layer's owners and modes
	for _, k := range []string{"HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"} {
		t.Setenv(k, "")
	}
	var hits atomic.Int64
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	rs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		reg.ServeHTTP(w, r)
	}))
	t.Cleanup(rs.Close)
	port := rs.URL[strings.LastIndex(rs.URL, ":")+1:]
	img, err := random.Image(512, 1)
	if err != nil {
		t.Fatal(err)
	}
	push, err := name.ParseReference("127.0.0.1:" + port + "/team/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(push, img, remote.WithContext(t.Context())); err != nil {
		t.Fatal(err)
	}

	dir := filepath.Join(t.TempDir(), "images")
	store, err := image.Open(dir, image.WithMountDir(dir+".mounts"), image.WithFormat(image.FormatDir))
	if err != nil {
		t.Fatal(err)
	}
	iss, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	v := auth.NewVerifier(iss.PublicKey(), auth.ScopeNode, auth.ScopeAdmin).AcceptOnBehalf()
	mux := http.NewServeMux()
	mux.Handle(nodev1connect.NewNodeImageServiceHandler(&imageService{store: store}, connect.WithInterceptors(v.Interceptor(), errdefs.Interceptor())))
	ns := httptest.NewServer(mux)
	t.Cleanup(ns.Close)
	token := func(scope string) string {
		tok, err := iss.Issue("t", scope, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	ref := "localhost:" + port + "/team/app:v1"
	imp := func(scope string, admin bool) error {
		c := nodev1connect.NewNodeImageServiceClient(auth.Client(ns.Client(), token(scope)), ns.URL)
		req := connect.NewRequest(&opendsecv1.ImportImageRequest{Ref: ref, Name: "mine/app:" + scope})
		if admin {
			// The apiserver forwards its admin caller's own signed token.
			req.Header().Set(auth.OnBehalfHeader, token(auth.ScopeAdmin))
		}
		st, err := c.ImportImage(t.Context(), req)
		if err != nil {
			return err
		}
		defer st.Close()
		for st.Receive() {
		}
		return st.Err()
	}

	hits.Store(0)
	if err := imp(auth.ScopeNode, false); connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "admin token") {
		t.Fatalf("apiserver hop on its own behalf: %v, want permission_denied saying an admin token is needed", err)
	}
	if err := imp(auth.ScopeUser, true); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("user token straight to the node: %v, want permission_denied", err)
	}
	if n := hits.Load(); n != 0 {
		t.Fatalf("refused imports reached the internal registry (%d requests)", n)
	}
	if imgs, err := store.List(t.Context()); err != nil || len(imgs) != 0 {
		t.Fatalf("refused imports left images %v (%v)", imgs, err)
	}
	if err := imp(auth.ScopeNode, true); err != nil {
		t.Fatalf("apiserver hop on behalf of an admin: %v", err)
	}
	if err := imp(auth.ScopeAdmin, false); err != nil {
		t.Fatalf("admin token straight to the node: %v", err)
	}
	if hits.Load() == 0 {
		t.Fatal("admin imports never reached the registry")
	}
}
