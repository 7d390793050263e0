package netpolicy

import (
	"fmt"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// setupNAT installs, in one batch, the sandbox namespace's own nftables
// table ("ip opendsec"), which translates between the guest address every
// sandbox has and the sandbox's host address:
//
//   - out of eth0, the guest's source becomes HostAddr (SNAT);
//   - into eth0, HostAddr becomes the guest (DNAT): the node's port proxy;
//   - the guest's resolver (its gateway, port 53) becomes the node's DNS
//     proxy (DNAT; on output for a guest in the namespace, on prerouting
//     from tap0 for a VM).
//
// Replies are translated back by conntrack. The node sees only HostAddr, so
// its rules, the DNS proxy and conntrack flushes key on it. A guest without
// CAP_NET_ADMIN in the namespace cannot change this table; a packet it
// forges with another source leaves untranslated and the node drops it.
func (m *Manager) setupNAT(ns netns.NsHandle, n Network) error {
	c, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return fmt.Errorf("open sandbox nftables: %w", err)
	}
	t := c.AddTable(&nftables.Table{Name: tableName, Family: nftables.TableFamilyIPv4})
	accept := nftables.ChainPolicyAccept
	chain := func(name string, hook *nftables.ChainHook, prio *nftables.ChainPriority) *nftables.Chain {
		ch := c.AddChain(&nftables.Chain{Name: name, Table: t, Hooknum: hook, Priority: prio, Type: nftables.ChainTypeNAT, Policy: &accept})
		c.FlushChain(ch)
		return ch
	}
	pre := chain("prerouting", nftables.ChainHookPrerouting, nftables.ChainPriorityNATDest)
	out := chain("output", nftables.ChainHookOutput, nftables.ChainPriorityNATDest)
	post := chain("postrouting", nftables.ChainHookPostrouting, nftables.ChainPriorityNATSource)
	add := func(ch *nftables.Chain, ex ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: ex})
	}
	guest := guestPrefix.Addr()
	add(pre, append(append(ifname(expr.MetaKeyIIFNAME, sandboxIf), matchPrefix(16, netip.PrefixFrom(n.HostAddr, 32), expr.CmpOpEq)...),
		natTo(expr.NATTypeDestNAT, guest, 0)...)...)
	resolver := matchPrefix(16, netip.PrefixFrom(guestGateway, 32), expr.CmpOpEq)
	for _, ex := range ruleExprs(rule{proto: ProtoAny, portLo: 53, portHi: 53}, resolver) {
		to := natTo(expr.NATTypeDestNAT, m.alloc.dnsAddr(), 53)
		if n.Mode == ModeTap {
			add(pre, append(append(ifname(expr.MetaKeyIIFNAME, tapIf), ex...), to...)...)
		} else {
			add(out, append(ex, to...)...)
		}
	}
	add(post, append(append(ifname(expr.MetaKeyOIFNAME, sandboxIf), matchPrefix(12, netip.PrefixFrom(guest, 32), expr.CmpOpEq)...),
		natTo(expr.NATTypeSourceNAT, n.HostAddr, 0)...)...)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("install sandbox nat: %w", err)
	}
	return nil
}

func ifname(key expr.MetaKey, name string) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifnameKey(name)},
	}
}

// natTo translates to addr (and port, unless 0).
func natTo(typ expr.NATType, addr netip.Addr, port uint16) []expr.Any {
	a := addr.As4()
	nat := &expr.NAT{Type: typ, Family: unix.NFPROTO_IPV4, RegAddrMin: 1}
	ex := []expr.Any{&expr.Immediate{Register: 1, Data: a[:]}}
	if port != 0 {
		ex = append(ex, &expr.Immediate{Register: 2, Data: binaryutil.BigEndian.PutUint16(port)})
		nat.RegProtoMin = 2
	}
	return append(ex, nat)
}
