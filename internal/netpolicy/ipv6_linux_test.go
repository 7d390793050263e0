package netpolicy

import (
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// IPv6 test addresses: the node side of the sandbox's veth, the node's
// uplink and the internet behind it (unique local, only in the test's
// namespaces).
const (
	v6Gateway = "fd00:6::1"
	v6Sandbox = "fd00:6::2"
	v6Uplink  = "fd00:7::1"
	v6Inet    = "fd00:7::2"
)

// tcp6From connects from the sandbox's namespace to addr over IPv6 and
// round-trips a line.
func tcp6From(n Network, addr string) error {
	return inNetNS(n.NetNSPath, func() error {
		c, err := net.DialTimeout("tcp6", addr, denyWait)
		if err != nil {
			return err
		}
		defer c.Close()
		return roundTrip(c)
	})
}

func addV6(name, prefix string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	// No duplicate address detection: the address is usable at once.
	return netlink.AddrAdd(l, &netlink.Addr{IPNet: prefixNet(netip.MustParsePrefix(prefix)), Flags: unix.IFA_F_NODAD})
}

// A sandbox has no IPv6 at all: it is disabled in its namespace, no address
// exists, and even a sandbox that turned it back on (which a container
// cannot: /proc/sys is read-only there, see test/e2e) and gave itself an
// address and route sends nothing, to the node or beyond, because the
// node's rules drop every IPv6 packet from the veth, whatever the rules
// allow. The control proves the plumbing: with an IPv6 accept placed first
// in the sandbox's chains the same connections work.
func TestIPv6Off(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	a, err := w.m.Setup(ctx, id(t, "a"), Rules{Allow: []Rule{{CIDR: "0.0.0.0/0"}}})
	must(t, err)

	must(t, inNetNS(a.NetNSPath, func() error {
		for _, k := range []string{"all", "default", "lo", sandboxIf} {
			v, err := os.ReadFile("/proc/sys/net/ipv6/conf/" + k + "/disable_ipv6")
			if err != nil {
				return err
			}
			if strings.TrimSpace(string(v)) != "1" {
				t.Errorf("net.ipv6.conf.%s.disable_ipv6 = %q, want 1", k, strings.TrimSpace(string(v)))
			}
		}
		addrs, err := netlink.AddrList(nil, netlink.FAMILY_V6)
		if err != nil {
			return err
		}
		if len(addrs) != 0 {
			t.Errorf("sandbox has IPv6 addresses %v, want none", addrs)
		}
		return nil
	}))
	denied(t, "ipv6 out with ipv6 disabled", tcp6From(a, "["+v6Gateway+"]:7000"))

	// The node's end of the veth has IPv6 off too: no address, no route
	// in the node namespace's IPv6 table (which the kernel walks whole on
	// every link change there).
	must(t, inNetNS(w.nodeNS, func() error {
		v, err := os.ReadFile("/proc/sys/net/ipv6/conf/" + a.HostIf + "/disable_ipv6")
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(v)) != "1" {
			t.Errorf("node side: net.ipv6.conf.%s.disable_ipv6 = %q, want 1", a.HostIf, strings.TrimSpace(string(v)))
		}
		l, err := netlink.LinkByName(a.HostIf)
		if err != nil {
			return err
		}
		if l.Attrs().Flags&net.FlagUp == 0 {
			t.Errorf("node side: veth %s is not up", a.HostIf)
		}
		addrs, err := netlink.AddrList(l, netlink.FAMILY_V6)
		if err != nil {
			return err
		}
		if len(addrs) != 0 {
			t.Errorf("node side: veth %s has IPv6 addresses %v, want none", a.HostIf, addrs)
		}
		routes, err := netlink.RouteList(l, netlink.FAMILY_V6)
		if err != nil {
			return err
		}
		if len(routes) != 0 {
			t.Errorf("node side: veth %s has IPv6 routes %v, want none", a.HostIf, routes)
		}
		return nil
	}))

	// The node side as a node with IPv6 would have it: an IPv6 address on
	// the sandbox's veth and the uplink, forwarding on, echo servers on
	// the node and in the internet.
	must(t, inNetNS(w.nodeNS, func() error {
		if err := writeSysctl("net/ipv6/conf/all/forwarding", "1"); err != nil {
			return err
		}
		if err := writeSysctl("net/ipv6/conf/"+a.HostIf+"/disable_ipv6", "0"); err != nil {
			return err
		}
		if err := addV6(a.HostIf, v6Gateway+"/64"); err != nil {
			return err
		}
		return addV6("uplink", v6Uplink+"/64")
	}))
	must(t, inNetNS(w.inetNS, func() error {
		if err := addV6("peer", v6Inet+"/64"); err != nil {
			return err
		}
		_, dst, _ := net.ParseCIDR("fd00:6::/64")
		return netlink.RouteAdd(&netlink.Route{Dst: dst, Gw: net.ParseIP(v6Uplink)})
	}))
	w.tcpEcho6(w.nodeNS, "["+v6Gateway+"]:7000")
	w.tcpEcho6(w.inetNS, "["+v6Inet+"]:443")
	// The sandbox side, as a sandbox that escaped its read-only /proc/sys
	// would do it.
	must(t, inNetNS(a.NetNSPath, func() error {
		for _, k := range []string{"all", "default", "lo", sandboxIf} {
			if err := writeSysctl("net/ipv6/conf/"+k+"/disable_ipv6", "0"); err != nil {
				return err
			}
		}
		if err := addV6(sandboxIf, v6Sandbox+"/64"); err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{Dst: &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}, Gw: net.ParseIP(v6Gateway)})
	}))

	denied(t, "ipv6 sandbox → node", tcp6From(a, "["+v6Gateway+"]:7000"))
	denied(t, "ipv6 sandbox → internet", tcp6From(a, "["+v6Inet+"]:443"))
	denied(t, "ipv6 node → sandbox", inNetNS(w.nodeNS, func() error {
		c, err := net.DialTimeout("tcp6", "["+v6Sandbox+"]:22", denyWait)
		if err == nil {
			c.Close()
		}
		return err
	}))

	// Control: accept IPv6 first in the sandbox's chains.
	w.acceptIPv6First(a.ID)
	allowed(t, "ipv6 sandbox → node with an accept", func() error { return tcp6From(a, "["+v6Gateway+"]:7000") })
	allowed(t, "ipv6 sandbox → internet with an accept", func() error { return tcp6From(a, "["+v6Inet+"]:443") })

	// Any rule change rewrites the chain: IPv6 is dropped again, at once.
	must(t, w.m.SetRules(ctx, a.ID, Rules{Allow: []Rule{{CIDR: "0.0.0.0/0"}}}))
	denied(t, "ipv6 sandbox → node after SetRules", tcp6From(a, "["+v6Gateway+"]:7000"))
	denied(t, "ipv6 sandbox → internet after SetRules", tcp6From(a, "["+v6Inet+"]:443"))
	allowed(t, "ipv4 still allowed", func() error { return tcpFrom(a, apiIP+":443") })
}

// acceptIPv6First puts "meta nfproto ipv6 accept" at the top of the
// sandbox's egress chain and the ingress chain (neighbour discovery needs both),
// bypassing the package: a test control only.
func (w *world) acceptIPv6First(id string) {
	w.t.Helper()
	conn, err := nftables.New(nftables.WithNetNSFd(int(mustNS(w.t, w.nodeNS))))
	must(w.t, err)
	sb, err := w.m.get(id)
	must(w.t, err)
	sb.mu.Lock()
	shard := w.m.nft.shard(sb.st.Index)
	sb.mu.Unlock()
	main := &nftables.Table{Name: tableName, Family: nftables.TableFamilyINet}
	// The ingress chain is every sandbox's: the control opens IPv6 into
	// all of them.
	for _, ch := range []*nftables.Chain{{Name: outChain(id), Table: shard}, {Name: inChainName, Table: main}} {
		conn.InsertRule(&nftables.Rule{Table: ch.Table, Chain: ch,
			Exprs: append(nfproto(unix.NFPROTO_IPV6), verdict(expr.VerdictAccept))})
	}
	must(w.t, conn.Flush())
}

// tcpEcho6 serves line echo on an IPv6 addr inside ns until the test ends.
func (w *world) tcpEcho6(ns, addr string) {
	var ln net.Listener
	must(w.t, inNetNS(ns, func() (err error) {
		// The address was just added without DAD; bind can still race the
		// kernel's address list for a moment.
		deadline := time.Now().Add(5 * time.Second)
		for {
			ln, err = net.Listen("tcp6", addr)
			if err == nil || time.Now().After(deadline) {
				return err
			}
			time.Sleep(10 * time.Millisecond)
		}
	}))
	w.t.Cleanup(func() { ln.Close() })
	go serveEcho(ln)
}
