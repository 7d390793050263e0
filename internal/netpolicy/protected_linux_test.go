package netpolicy

import (
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
)

const metadataIP = "169.254.169.254"

// complementRules is what a deny list turns into for a caller that only
// has allow rules (as the E2B gateway computes it): the prefixes covering
// 0.0.0.0/0 minus out, as CIDR rules.
func complementRules(out ...netip.Prefix) []Rule {
	var rec func(p netip.Prefix) []Rule
	rec = func(p netip.Prefix) []Rule {
		overlaps := false
		for _, o := range out {
			if within(p, o) {
				return nil
			}
			overlaps = overlaps || p.Overlaps(o)
		}
		if !overlaps {
			return []Rule{{CIDR: p.String()}}
		}
		a := p.Addr().As4()
		a[p.Bits()/8] |= 0x80 >> (p.Bits() % 8)
		return append(rec(netip.PrefixFrom(p.Addr(), p.Bits()+1)), rec(netip.PrefixFrom(netip.AddrFrom4(a), p.Bits()+1))...)
	}
	return rec(netip.MustParsePrefix("0.0.0.0/0"))
}

func prefixes(s ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range s {
		out = append(out, netip.MustParsePrefix(p))
	}
	return out
}

// TestProtectedDestinations checks that broad rules, and complements of
// deny lists that cut right next to protected addresses, reach neither the
// metadata address, nor the node, nor another sandbox, while a rule that
// lies inside a protected range still opens it.
func TestProtectedDestinations(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	a, err := w.m.Setup(ctx, id(t, "a"), Rules{})
	must(t, err)
	b, err := w.m.Setup(ctx, id(t, "b"), Rules{})
	must(t, err)
	// A metadata server in the test's internet, routed from the node.
	must(t, inNetNS(w.inetNS, func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: prefixNet(netip.MustParsePrefix(metadataIP + "/32"))}); err != nil {
			return err
		}
		// A host with the guest's gateway address beyond the node: only
		// DNS to the gateway may leave a sandbox, and it goes to the proxy.
		return netlink.AddrAdd(lo, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(a.GuestGateway, 32))})
	}))
	must(t, inNetNS(w.nodeNS, func() error {
		for _, d := range []string{metadataIP + "/32", a.GuestGateway.String() + "/32"} {
			_, dst, _ := net.ParseCIDR(d)
			if err := netlink.RouteAdd(&netlink.Route{Dst: dst, Gw: net.ParseIP("198.18.0.2")}); err != nil {
				return err
			}
		}
		return nil
	}))
	w.tcpEcho(w.inetNS, metadataIP+":80")
	w.tcpEcho(w.inetNS, a.GuestGateway.String()+":9999")
	w.tcpEcho(b.NetNSPath, "0.0.0.0:8080")
	w.tcpEcho(w.nodeNS, "0.0.0.0:9999")
	// Controls: the servers answer, so denials below are the policy.
	nodeNet := Network{NetNSPath: w.nodeNS}
	allowed(t, "node → metadata", func() error { return tcpFrom(nodeNet, metadataIP+":80") })
	allowed(t, "node → the guest gateway's address beyond it", func() error { return tcpFrom(nodeNet, a.GuestGateway.String()+":9999") })
	// (Sandbox b's own ingress chain drops every new connection too, so
	// the checks of b below hold with or without a's egress rules.)

	closed := func(what string) {
		t.Helper()
		denied(t, what+": metadata", tcpFrom(a, metadataIP+":80"))
		denied(t, what+": node uplink", tcpFrom(a, nodeUplink+":9999"))
		denied(t, what+": node via the gateway", tcpFrom(a, a.HostGateway.String()+":9999"))
		denied(t, what+": the guest's gateway", tcpFrom(a, a.GuestGateway.String()+":9999"))
		denied(t, what+": dns address, other port", tcpFrom(a, a.DNS.String()+":9999"))
		denied(t, what+": sandbox b", tcpFrom(a, b.HostAddr.String()+":8080"))
	}
	for _, c := range []struct {
		name  string
		allow []Rule
	}{
		{"allow-all in halves", []Rule{{CIDR: "0.0.0.0/1"}, {CIDR: "128.0.0.0/1"}}},
		// The E2B gateway's complement of denyOut [169.254.169.255,
		// 100.96.0.0/13, 198.18.0.0]: it leaves out its reserved ranges.
		{"e2b complement", complementRules(prefixes("169.254.169.255/32", "100.96.0.0/13", "198.18.0.0/32",
			"0.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")...)},
		// A raw complement that holds the node's uplink address as a /32
		// and the pool in quarters: neither says "open the node".
		{"raw complement", complementRules(prefixes("198.18.0.0/32", "100.64.0.0/10", "169.254.0.0/16")...)},
		// A single address is no longer an opt-in by itself.
		{"node uplink /32", []Rule{{CIDR: "0.0.0.0/0"}, {CIDR: nodeUplink + "/32"}}},
	} {
		if len(c.allow) > 256 {
			t.Fatalf("%s: %d rules", c.name, len(c.allow))
		}
		must(t, w.m.SetRules(ctx, a.ID, Rules{Allow: c.allow}))
		allowed(t, c.name+": internet", func() error { return tcpFrom(a, apiIP+":443") })
		closed(c.name)
	}

	// A rule inside link-local says so: metadata opens (on that port only),
	// the rest stays closed.
	must(t, w.m.SetRules(ctx, a.ID, Rules{Allow: []Rule{{CIDR: metadataIP, Protocol: "tcp", Ports: "80"}, {CIDR: "0.0.0.0/0", Protocol: "tcp", Ports: "9999"}}}))
	allowed(t, "explicit metadata rule", func() error { return tcpFrom(a, metadataIP+":80") })
	denied(t, "explicit metadata rule: node uplink", tcpFrom(a, nodeUplink+":9999"))
	denied(t, "explicit metadata rule: node via the gateway", tcpFrom(a, a.HostGateway.String()+":9999"))
	// A caller's rule inside the pool never opens the node itself: the
	// gateway (and the DNS address) are the node's own addresses, dropped
	// before a caller's rules. DNS to the proxy still answers.
	must(t, w.m.SetRules(ctx, a.ID, Rules{Allow: []Rule{{CIDR: a.HostGateway.String(), Protocol: "tcp", Ports: "9999"}, {CIDR: w.m.pool.String(), Protocol: "tcp", Ports: "9999"}, {CIDR: a.DNS.String(), Protocol: "tcp", Ports: "9999"}, {Domain: "api.example.test", Protocol: "tcp", Ports: "443"}}}))
	denied(t, "caller gateway rule", tcpFrom(a, a.HostGateway.String()+":9999"))
	denied(t, "caller gateway rule: dns address, other port", tcpFrom(a, a.DNS.String()+":9999"))
	denied(t, "caller gateway rule: metadata", tcpFrom(a, metadataIP+":80"))
	if rcode, ips, err := resolveFrom(a, a.DNS.String()+":53", "api.example.test"); err != nil || rcode != 0 || len(ips) == 0 {
		t.Fatalf("caller gateway rule: dns via the proxy: rcode %d %v %v", rcode, ips, err)
	}
	// A rule set is the administrator's and counts as given on purpose:
	// it may open link-local, and the node at the gateways.
	pool := w.m.pool.String()
	w.m.Close()
	sets := map[string][]Rule{
		"metadata": {{CIDR: "169.254.0.0/16", Protocol: "tcp"}},
		"gateways": {{CIDR: pool, Protocol: "tcp", Ports: "9999"}},
	}
	for k, v := range w.cfg.RuleSets {
		sets[k] = v
	}
	w.cfg.RuleSets = sets
	w.m = w.newManager()
	_, err = w.m.Recover(ctx, func(id string) bool { return id == a.ID || id == b.ID })
	must(t, err)
	must(t, w.m.SetRules(ctx, a.ID, Rules{RuleSets: []string{"metadata"}}))
	allowed(t, "metadata rule set", func() error { return tcpFrom(a, metadataIP+":80") })
	allowed(t, "metadata rule set: the guest gateway's address beyond the node", func() error { return tcpFrom(a, a.GuestGateway.String()+":9999") })
	denied(t, "metadata rule set: node via the gateway", tcpFrom(a, a.HostGateway.String()+":9999"))
	must(t, w.m.SetRules(ctx, a.ID, Rules{RuleSets: []string{"gateways"}}))
	allowed(t, "gateways rule set", func() error { return tcpFrom(a, a.HostGateway.String()+":9999") })
}
