package image

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"

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

// TestPublicRegistryGuard checks a registry import whose registry is at a
// public address never connects to an internal one (a redirect to a cloud
// metadata address, or a name rebound to loopback), while a registry that
// is itself internal (an administrator's, the tests' on loopback) is
// reached as before.
func TestPublicRegistryGuard(t *testing.T) {
	ctx := t.Context()
	for _, k := range []string{"HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"} {
		t.Setenv(k, "")
	}
	for host, want := range map[string]bool{
		"203.0.113.7:5000": true, "203.0.113.7": true,
		"127.0.0.1:5000": false, "localhost:5000": false, "[::1]:5000": false, "10.0.0.1": false,
	} {
		if got := guardRegistry(ctx, host); got != want {
			t.Errorf("guardRegistry(%s) = %v, want %v", host, got, want)
		}
	}
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
