package image

import (
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/compression"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func TestIsInternalAddr(t *testing.T) {
	for a, want := range map[string]bool{
		"127.0.0.1": true, "::1": true, "10.1.2.3": true, "172.16.0.1": true, "192.168.1.1": true,
		"169.254.169.254": true, "fe80::1": true, "fd00::1": true, "100.96.0.5": true, "0.0.0.0": true,
		"::ffff:127.0.0.1": true, "224.0.0.1": true,
		"203.0.113.7": false, "8.8.8.8": false, "2001:4860::8888": false,
	} {
		if got := IsInternalAddr(netip.MustParseAddr(a)); got != want {
			t.Errorf("IsInternalAddr(%s) = %v, want %v", a, got, want)
		}
	}
}

func clearProxyEnv(t *testing.T) {
	for _, k := range []string{"HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"} {
		t.Setenv(k, "")
	}
}

// TestPublicRegistryGuard checks that every import is guarded unless the
// caller is an admin (or a proxy is the node's egress control), and that
// the guarded transport never connects to an internal address.
func TestPublicRegistryGuard(t *testing.T) {
	clearProxyEnv(t)
	if !guardRegistry(false) {
		t.Fatal("a non-admin import is not guarded")
	}
	if guardRegistry(true) {
		t.Fatal("an admin's import is guarded")
	}
	t.Setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
	if guardRegistry(false) {
		t.Fatal("an import through the node's proxy is guarded")
	}
	clearProxyEnv(t)

	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("metadata")) }))
	defer srv.Close()
	c := &http.Client{Transport: publicOnlyTransport()}
	resp, err := c.Get(srv.URL)
	if err == nil {
		resp.Body.Close()
		t.Fatalf("the guarded transport reached %s", srv.URL)
	}
	if !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("guarded dial to loopback: %v, want permission denied", err)
	}
}

// TestImportRebindingRefused is DNS rebinding at the node: the apiserver
// let a user import from a name that resolved to a public address there,
// and at the node the same name ("localhost" here) resolves to an internal
// one. Without the admin option the node connects nowhere internal: the
// import is refused, the registry sees no request and the store is
// unchanged. The same import by an admin (WithInternalRegistry) succeeds.
func TestImportRebindingRefused(t *testing.T) {
	clearProxyEnv(t)
	ctx := t.Context()
	var hits atomic.Int64
	reg := registry.New(registry.Logger(discardLogger()))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		reg.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	_, port, err := net.SplitHostPort(strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip, fileE("f", "data")))
	if err != nil {
		t.Fatal(err)
	}
	pushIndex(t, "127.0.0.1:"+port+"/team/app:v1", img)
	hits.Store(0)

	s := openStore(t, filepath.Join(t.TempDir(), "images"), WithFormat(FormatDir))
	before := snapshot(t, s)
	ref := "localhost:" + port + "/team/app:v1"
	for _, r := range []string{ref, "127.0.0.1:" + port + "/team/app:v1"} {
		_, err = s.Import(ctx, r)
		if !errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), "admin token") {
			t.Fatalf("non-admin import of %s: %v, want permission denied saying an admin token is needed", r, err)
		}
	}
	if n := hits.Load(); n != 0 {
		t.Fatalf("the refused imports reached the internal registry (%d requests)", n)
	}
	if after := snapshot(t, s); !slices.Equal(before, after) {
		t.Fatalf("a refused import changed the store:\n%v\n%v", before, after)
	}
	got, err := s.Import(ctx, ref, WithInternalRegistry())
	if err != nil {
		t.Fatalf("admin import: %v", err)
	}
	if got.Name != "team/app:v1" || hits.Load() == 0 {
		t.Fatalf("admin import: %+v after %d requests", got, hits.Load())
	}
}
