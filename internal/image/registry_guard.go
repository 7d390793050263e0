package image

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// cgnat is 100.64.0.0/10 (RFC 6598), where sandbox address pools live.
var cgnat = netip.MustParsePrefix("100.64.0.0/10")

// IsInternalAddr reports whether a is not a public unicast address:
// loopback, private (RFC 1918, fc00::/7), link-local (169.254/16 with cloud
// metadata, fe80::/10), shared (100.64/10), multicast or unspecified.
func IsInternalAddr(a netip.Addr) bool {
	a = a.Unmap()
	return !a.IsValid() || a.IsLoopback() || a.IsPrivate() || a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast() ||
		a.IsInterfaceLocalMulticast() || a.IsMulticast() || a.IsUnspecified() || cgnat.Contains(a)
}

// guardRegistry reports whether an import from registry (host[:port])
// must never connect to an internal address: true unless the registry is
// itself on one (by IP or by name). A registry on an internal address is
// only reachable by admins (the apiserver checks); a public one must not
// redirect the node, or have its name rebound, into the cluster's network.
// A name that does not resolve is guarded. With an HTTP(S) proxy
// configured the proxy is the node's egress control and connections go to
// it, so nothing is guarded.
func guardRegistry(ctx context.Context, registry string) bool {
	for _, k := range []string{"HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"} {
		if os.Getenv(k) != "" {
			return false
		}
	}
	host := registry
	if h, _, err := net.SplitHostPort(registry); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	if a, err := netip.ParseAddr(host); err == nil {
		return !IsInternalAddr(a)
	}
	addrs, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil || len(addrs) == 0 {
		return true
	}
	for _, a := range addrs {
		if IsInternalAddr(a) {
			return false
		}
	}
	return true
}

// publicOnlyTransport is remote.DefaultTransport whose every connection
// (to the registry, to where it redirects, to a token server) is refused
// when it would go to an internal address.
func publicOnlyTransport() http.RoundTripper {
	d := &net.Dialer{
		Timeout:   30 * time.Second,
		KeepAlive: 30 * time.Second,
		Control: func(_, address string, _ syscall.RawConn) error {
			host, _, err := net.SplitHostPort(address)
			if err != nil {
				return err
			}
			if a, err := netip.ParseAddr(host); err != nil || IsInternalAddr(a) {
				return errdefs.New(errdefs.ErrPermissionDenied, "registry import: the registry is public, so connecting to the internal address %s is refused (a redirect or a rebound name?)", host)
			}
			return nil
		},
	}
	t := remote.DefaultTransport.(*http.Transport).Clone()
	t.DialContext = d.DialContext
	return t
}
