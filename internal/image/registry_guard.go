package image

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
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

// WithInternalRegistry lets a registry import connect to internal
// addresses (loopback, private, link-local, CGNAT): the registry itself,
// where it redirects and its token server. Only for imports an admin asked
// for; without it every connection must go to a public address.
func WithInternalRegistry() ImportOption {
	return func(o *importOptions) { o.internalRegistry = true }
}

// guardRegistry reports whether a registry import must never connect to an
// internal address: always, unless the caller is an admin
// (internalAllowed). The decision is never taken from this node's own DNS
// answer for the registry's name: a name that resolved to a public address
// when the apiserver checked it can resolve to an internal one here (DNS
// rebinding, split horizon), so connections are checked as they are made.
// With an HTTP(S) proxy configured the proxy is the node's egress control
// and connections go to it, so nothing is guarded.
func guardRegistry(internalAllowed bool) bool {
	if internalAllowed {
		return false
	}
	for _, k := range []string{"HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"} {
		if os.Getenv(k) != "" { //nolint:forbidigo // net/http's proxy variables (remote.DefaultTransport reads them too), not an OpenDsec setting
			return false
		}
	}
	return true
}

// errInternalAddr is why the guarded transport refused a connection.
var errInternalAddr = errdefs.New(errdefs.ErrPermissionDenied, "connecting to an internal address is refused; importing from a registry on a loopback, private, link-local or CGNAT address (or one that redirects or resolves there) needs an admin token")

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
				return fmt.Errorf("%s: %w", host, errInternalAddr)
			}
			return nil
		},
	}
	t := remote.DefaultTransport.(*http.Transport).Clone()
	t.DialContext = d.DialContext
	return t
}
