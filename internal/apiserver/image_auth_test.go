package apiserver_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/apiserver"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// fakeImages is a node's image service that knows a few image names and
// records which calls reached it. It is for testing the apiserver's
// authorisation above it; the real store is tested in internal/image.
type fakeImages struct {
	nodev1connect.UnimplementedNodeImageServiceHandler
	mu     sync.Mutex
	calls  []string
	images []string
	// onBehalf holds auth.OnBehalfHeader of each ImportImage.
	onBehalf []string
}

func (f *fakeImages) called(m string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, m)
}

func (f *fakeImages) reached(m string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Contains(f.calls, m)
}

func (f *fakeImages) GetImage(_ context.Context, req *connect.Request[v1.GetImageRequest]) (*connect.Response[v1.GetImageResponse], error) {
	n := strings.TrimSuffix(req.Msg.GetName(), ":latest")
	if !slices.Contains(f.images, n) {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "image %s not found", n))
	}
	return connect.NewResponse(&v1.GetImageResponse{Image: &v1.Image{Name: n}}), nil
}

func (f *fakeImages) ImportImage(_ context.Context, req *connect.Request[v1.ImportImageRequest], _ *connect.ServerStream[v1.ImportImageResponse]) error {
	f.called("ImportImage")
	f.mu.Lock()
	f.onBehalf = append(f.onBehalf, req.Header().Get(auth.OnBehalfHeader))
	f.mu.Unlock()
	return nil
}

func (f *fakeImages) TagImage(context.Context, *connect.Request[v1.TagImageRequest]) (*connect.Response[v1.TagImageResponse], error) {
	f.called("TagImage")
	return connect.NewResponse(&v1.TagImageResponse{}), nil
}

func (f *fakeImages) RemoveImage(context.Context, *connect.Request[v1.RemoveImageRequest]) (*connect.Response[v1.RemoveImageResponse], error) {
	f.called("RemoveImage")
	return connect.NewResponse(&v1.RemoveImageResponse{}), nil
}

func (f *fakeImages) ComposeImage(context.Context, *connect.Request[v1.ComposeImageRequest]) (*connect.Response[v1.ComposeImageResponse], error) {
	f.called("ComposeImage")
	return connect.NewResponse(&v1.ComposeImageResponse{}), nil
}

func (f *fakeImages) GarbageCollect(context.Context, *connect.Request[v1.GarbageCollectRequest]) (*connect.Response[v1.GarbageCollectResponse], error) {
	f.called("GarbageCollect")
	return connect.NewResponse(&v1.GarbageCollectResponse{}), nil
}

func (f *fakeImages) VerifyImages(context.Context, *connect.Request[v1.VerifyImagesRequest]) (*connect.Response[v1.VerifyImagesResponse], error) {
	f.called("VerifyImages")
	return connect.NewResponse(&v1.VerifyImagesResponse{}), nil
}

func (f *fakeImages) PackDiff(context.Context, *connect.Request[v1.PackDiffRequest]) (*connect.Response[v1.PackDiffResponse], error) {
	f.called("PackDiff")
	return connect.NewResponse(&v1.PackDiffResponse{}), nil
}

// setupImages is setup with node n001 also serving fakeImages; it returns
// image clients with a user and an admin token.
func setupImages(t *testing.T) (e *env, f *fakeImages, user, admin opendsecv1connect.ImageServiceClient) {
	t.Helper()
	f = &fakeImages{images: []string{"root/busybox", "root/py:3.11"}}
	e = setup(t, func(cfg *apiserver.Config) {
		// The watcher polls the plain fake node; calls go to this one,
		// which serves sandboxes and images.
		n := newFakeNode(t, mustIssuer(t), "n001")
		mux := http.NewServeMux()
		mux.Handle(nodev1connect.NewNodeServiceHandler(n))
		mux.Handle(nodev1connect.NewNodeImageServiceHandler(f))
		srv := httptest.NewUnstartedServer(mux)
		srv.Config.Protocols = new(http.Protocols)
		srv.Config.Protocols.SetHTTP1(true)
		srv.Config.Protocols.SetUnencryptedHTTP2(true)
		srv.Start()
		t.Cleanup(srv.Close)
		cfg.Nodes = withNodes(t, cfg.Nodes, nodeclient.NodeInfo{ID: "n001", Addr: srv.URL})
	}, "n001")
	adminTok, err := e.key.Issue("root", auth.ScopeAdmin, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	user = opendsecv1connect.NewImageServiceClient(auth.Client(e.hc, e.tok), e.url, connect.WithGRPC())
	admin = opendsecv1connect.NewImageServiceClient(auth.Client(e.hc, adminTok), e.url, connect.WithGRPC())
	return e, f, user, admin
}

func importErr(t *testing.T, c opendsecv1connect.ImageServiceClient, m *v1.ImportImageRequest) error {
	t.Helper()
	st, err := c.ImportImage(t.Context(), connect.NewRequest(m))
	if err != nil {
		return err
	}
	defer st.Close()
	for st.Receive() {
	}
	return st.Err()
}

// TestImageServiceNeedsAdmin calls every guarded image method with a
// user-scope token: each is refused with permission_denied saying an admin
// token is needed, and never reaches the node; the same calls with an
// admin token (or a user's call that replaces nothing) go through.
func TestImageServiceNeedsAdmin(t *testing.T) {
	e, f, user, admin := setupImages(t)
	ctx := t.Context()
	sb := e.create(busybox())

	type call struct {
		name   string
		method string // what reaches the node when allowed
		run    func(c opendsecv1connect.ImageServiceClient) error
	}
	denied := []call{
		{"rm", "RemoveImage", func(c opendsecv1connect.ImageServiceClient) error {
			_, err := c.RemoveImage(ctx, connect.NewRequest(&v1.RemoveImageRequest{Name: "root/py:3.11"}))
			return err
		}},
		{"gc", "GarbageCollect", func(c opendsecv1connect.ImageServiceClient) error {
			_, err := c.GarbageCollect(ctx, connect.NewRequest(&v1.GarbageCollectRequest{}))
			return err
		}},
		{"verify", "VerifyImages", func(c opendsecv1connect.ImageServiceClient) error {
			_, err := c.VerifyImages(ctx, connect.NewRequest(&v1.VerifyImagesRequest{}))
			return err
		}},
		{"tag over a base image", "TagImage", func(c opendsecv1connect.ImageServiceClient) error {
			_, err := c.TagImage(ctx, connect.NewRequest(&v1.TagImageRequest{Source: "root/busybox", Target: "root/py:3.11"}))
			return err
		}},
		{"compose over an image", "ComposeImage", func(c opendsecv1connect.ImageServiceClient) error {
			_, err := c.ComposeImage(ctx, connect.NewRequest(&v1.ComposeImageRequest{Base: "root/busybox", Name: "root/busybox:latest"}))
			return err
		}},
		{"pack_diff over an image", "PackDiff", func(c opendsecv1connect.ImageServiceClient) error {
			_, err := c.PackDiff(ctx, connect.NewRequest(&v1.PackDiffRequest{SandboxId: sb.GetId(), Name: "root/py:3.11"}))
			return err
		}},
		{"import over an image", "ImportImage", func(c opendsecv1connect.ImageServiceClient) error {
			return importErr(t, c, &v1.ImportImageRequest{Ref: "203.0.113.7:5000/team/app:v1", Name: "root/py:3.11"})
		}},
		{"import over an image by its ref's name", "ImportImage", func(c opendsecv1connect.ImageServiceClient) error {
			return importErr(t, c, &v1.ImportImageRequest{Ref: "203.0.113.7:5000/root/py:3.11"})
		}},
		{"import an oci-layout", "ImportImage", func(c opendsecv1connect.ImageServiceClient) error {
			return importErr(t, c, &v1.ImportImageRequest{Ref: "oci-layout:/etc:v1", Name: "mine/etc"})
		}},
		{"import a docker-archive", "ImportImage", func(c opendsecv1connect.ImageServiceClient) error {
			return importErr(t, c, &v1.ImportImageRequest{Ref: "docker-archive:/etc/shadow", Name: "mine/shadow"})
		}},
		{"import from loopback", "ImportImage", func(c opendsecv1connect.ImageServiceClient) error {
			return importErr(t, c, &v1.ImportImageRequest{Ref: "127.0.0.1:5000/team/app:v1", Name: "mine/app", Insecure: true})
		}},
		{"import from localhost", "ImportImage", func(c opendsecv1connect.ImageServiceClient) error {
			return importErr(t, c, &v1.ImportImageRequest{Ref: "localhost:5000/team/app:v1", Name: "mine/app"})
		}},
		{"import from the metadata address", "ImportImage", func(c opendsecv1connect.ImageServiceClient) error {
			return importErr(t, c, &v1.ImportImageRequest{Ref: "169.254.169.254/latest/meta-data:v1", Name: "mine/md", Insecure: true})
		}},
		{"import from a private address", "ImportImage", func(c opendsecv1connect.ImageServiceClient) error {
			return importErr(t, c, &v1.ImportImageRequest{Ref: "10.1.2.3:5000/x:v1", Name: "mine/x"})
		}},
		{"import from an IPv6 loopback", "ImportImage", func(c opendsecv1connect.ImageServiceClient) error {
			return importErr(t, c, &v1.ImportImageRequest{Ref: "[::1]:5000/x:v1", Name: "mine/x"})
		}},
	}
	for _, c := range denied {
		t.Run(c.name, func(t *testing.T) {
			f.mu.Lock()
			f.calls = nil
			f.mu.Unlock()
			err := c.run(user)
			if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "admin token") {
				t.Fatalf("user token: %v, want permission_denied saying an admin token is needed", err)
			}
			if f.reached(c.method) {
				t.Fatalf("a refused %s reached the node", c.method)
			}
			if err := c.run(admin); err != nil {
				t.Fatalf("admin token: %v", err)
			}
			if !f.reached(c.method) {
				t.Fatalf("an admin's %s did not reach the node", c.method)
			}
		})
	}

	// What replaces nothing stays open to users.
	if _, err := user.TagImage(ctx, connect.NewRequest(&v1.TagImageRequest{Source: "root/busybox", Target: "alice/box:v1"})); err != nil {
		t.Fatalf("user tag to a new name: %v", err)
	}
	if _, err := user.ComposeImage(ctx, connect.NewRequest(&v1.ComposeImageRequest{Base: "root/busybox", Name: "alice/env:v1"})); err != nil {
		t.Fatalf("user compose to a new name: %v", err)
	}
	if _, err := user.PackDiff(ctx, connect.NewRequest(&v1.PackDiffRequest{SandboxId: sb.GetId(), Name: "alice/packed:v1"})); err != nil {
		t.Fatalf("user pack_diff to a new name: %v", err)
	}
	if err := importErr(t, user, &v1.ImportImageRequest{Ref: "203.0.113.7:5000/team/app:v1"}); err != nil {
		t.Fatalf("user import from a public address to a new name: %v", err)
	}
	if _, err := user.ListImages(ctx, connect.NewRequest(&v1.ListImagesRequest{})); err != nil && connect.CodeOf(err) == connect.CodePermissionDenied {
		t.Fatalf("user list: %v", err)
	}
}

var _ nodev1connect.NodeImageServiceHandler = (*fakeImages)(nil)

// TestImportPassesCallerToNode checks the node learns from the apiserver
// who an import's caller is (the node then decides whether internal
// registries may be reached, never from its own DNS answer): every import
// carries the caller's own signed token, a user's and an admin's, and a
// header a user set itself does not get through.
func TestImportPassesCallerToNode(t *testing.T) {
	e, f, user, admin := setupImages(t)
	if err := importErr(t, user, &v1.ImportImageRequest{Ref: "203.0.113.7:5000/team/app:v1"}); err != nil {
		t.Fatalf("user import: %v", err)
	}
	st, err := user.ImportImage(t.Context(), func() *connect.Request[v1.ImportImageRequest] {
		r := connect.NewRequest(&v1.ImportImageRequest{Ref: "203.0.113.7:5000/team/app:v2"})
		r.Header().Set(auth.OnBehalfHeader, "odt_forged.sig")
		return r
	}())
	if err != nil {
		t.Fatal(err)
	}
	for st.Receive() {
	}
	if err := st.Err(); err != nil {
		t.Fatalf("user import with a forged header: %v", err)
	}
	st.Close()
	if err := importErr(t, admin, &v1.ImportImageRequest{Ref: "203.0.113.7:5000/team/app:v3"}); err != nil {
		t.Fatalf("admin import: %v", err)
	}
	f.mu.Lock()
	got := slices.Clone(f.onBehalf)
	f.mu.Unlock()
	var scopes []string
	for _, tok := range got {
		c, err := auth.Verify(e.key.PublicKey(), tok, time.Now())
		if err != nil {
			t.Fatalf("forwarded caller token %q: %v", tok, err)
		}
		scopes = append(scopes, c.Subject+"/"+c.Scope)
	}
	if want := []string{"alice/user", "alice/user", "root/admin"}; !slices.Equal(scopes, want) {
		t.Fatalf("callers the node was told of: %q, want %q", scopes, want)
	}
}
