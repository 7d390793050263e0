package apiserver

import (
	"context"
	"net/netip"
	"strings"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// protectedRange is an address range only admins may open to a sandbox
// with a caller rule.
type protectedRange struct {
	prefix netip.Prefix
	what   string
}

// protectedRanges are what a node lets a rule open on purpose when the
// rule lies inside one (see internal/netpolicy, protectedExplicit):
// link-local with the cloud metadata service, and the node's sandbox pool.
// The apiserver does not know each node's pool, so it refuses all of
// 100.64.0.0/10 (CGNAT), which holds the pools as configured by default
// (100.96.0.0/12) and as the docs ask for.
var protectedRanges = []protectedRange{
	{netip.MustParsePrefix("169.254.0.0/16"), "169.254.0.0/16 (link-local, with the cloud metadata service and its credentials)"},
	{netip.MustParsePrefix("100.64.0.0/10"), "100.64.0.0/10 (CGNAT, which holds the nodes' sandbox address pools and the node's own addresses on them)"},
}

// checkNetworkPolicy refuses a non-admin caller's allow rules that would
// open a protected range: a CIDR rule lying inside 169.254.0.0/16 or
// 100.64.0.0/10. Broader rules (0.0.0.0/0, 169.254.0.0/15) stay open to
// everyone: nodes place them after the drops for protected ranges, so they
// never reach those. Rule sets are the administrator's, from the node
// configuration, and may open them. Malformed rules are left for the node,
// which names the field.
func checkNetworkPolicy(ctx context.Context, np *v1.NetworkPolicy) error {
	if np == nil || isAdmin(ctx) {
		return nil
	}
	for i, r := range np.GetAllow() {
		p, ok := ruleCIDR(r.GetCidr())
		if !ok {
			continue
		}
		for _, pr := range protectedRanges {
			if pr.prefix.Bits() <= p.Bits() && pr.prefix.Contains(p.Addr()) {
				return errdefs.New(errdefs.ErrPermissionDenied,
					"network.allow[%d]: cidr %s lies inside %s; opening it needs %s, or a rule set an administrator defined in the node configuration (broad rules like 0.0.0.0/0 are fine: they never reach this range)",
					i, r.GetCidr(), pr.what, adminScope)
			}
		}
	}
	return nil
}

// ruleCIDR parses a rule's cidr as the node does: an IPv4 prefix or
// address.
func ruleCIDR(s string) (netip.Prefix, bool) {
	s = strings.TrimSpace(s)
	if s == "" {
		return netip.Prefix{}, false
	}
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		return p.Masked(), err == nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, a.BitLen()), true
}
