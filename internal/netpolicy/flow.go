package netpolicy

import (
	"net/netip"
	"time"
)

// learned is an address the DNS proxy admitted for a name.
type learned struct {
	name    string
	addr    netip.Addr
	expires time.Time
}

// flowPolicy answers, in Go, what the nftables rules of a sandbox answer
// for a new connection; SetRules uses it to cut tracked connections the new
// rules no longer allow.
type flowPolicy struct {
	rules    []rule
	learned  []learned
	dns      netip.Addr
	pool     netip.Prefix
	explicit func(rule) bool
}

func (r rule) allowsProto(proto uint8, port uint16) bool {
	want := map[string]uint8{ProtoTCP: 6, ProtoUDP: 17, ProtoICMP: 1}
	switch {
	case r.proto == ProtoAny && r.portHi == 0:
	case r.proto == ProtoAny:
		if proto != 6 && proto != 17 {
			return false
		}
	case want[r.proto] != proto:
		return false
	}
	if r.portHi == 0 {
		return true
	}
	return port >= r.portLo && port <= r.portHi
}

func (p flowPolicy) allows(dst netip.Addr, proto uint8, port uint16, now time.Time) bool {
	if dst == p.dns && port == 53 && (proto == 6 || proto == 17) {
		return true
	}
	protected := p.pool.Contains(dst) || linkLocal.Contains(dst)
	for _, r := range p.rules {
		if r.isDomain() || !r.prefix.Contains(dst) || !r.allowsProto(proto, port) {
			continue
		}
		if !protected || p.explicit(r) && (r.fromSet || !p.nodeOwned(dst)) {
			return true
		}
	}
	if protected {
		return false
	}
	for _, r := range p.rules {
		if !r.isDomain() || !r.allowsProto(proto, port) {
			continue
		}
		for _, l := range p.learned {
			if l.addr == dst && l.expires.After(now) && r.matches(l.name) {
				return true
			}
		}
	}
	return false
}

// nodeOwned reports whether dst is one of the node's own addresses in the
// pool (the DNS proxy's, or the node end, even address, of a sandbox's /31)
// or in the guest's /30 (its gateway stands for the node). Only rule sets
// open those; nftables drops them before a caller's rules.
func (p flowPolicy) nodeOwned(dst netip.Addr) bool {
	return dst == p.dns || guestPrefix.Masked().Contains(dst) || p.pool.Contains(dst) && dst.Is4() && dst.As4()[3]%2 == 0
}

// linkLocal holds cloud metadata services (169.254.169.254).
var linkLocal = netip.MustParsePrefix("169.254.0.0/16")

// protectedExplicit reports whether a CIDR rule opens protected
// destinations on purpose, so it is placed before the protection rules: its
// prefix lies entirely inside link-local (169.254.0.0/16) or entirely inside
// the pool. A rule that merely covers such a range (0.0.0.0/0, 0.0.0.0/1, a
// complement computed from a deny list) does not, whatever its length; a
// single address outside both ranges does not either, so no rule opens the
// node's own addresses outside the pool.
func protectedExplicit(pool netip.Prefix, r rule) bool {
	return within(r.prefix, linkLocal) || within(r.prefix, pool)
}

// within reports whether p lies entirely inside outer.
func within(p, outer netip.Prefix) bool {
	return p.IsValid() && outer.Bits() <= p.Bits() && outer.Contains(p.Addr())
}
