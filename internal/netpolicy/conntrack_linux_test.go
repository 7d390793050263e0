package netpolicy

import (
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// addFlows makes n UDP conntrack entries from 10.250.x.y in the node's
// namespace: other traffic of a busy node.
func (w *world) addFlows(n int) {
	w.t.Helper()
	must(w.t, inNetNS(w.nodeNS, func() error {
		for i := range n {
			src := net.IPv4(10, 250, byte(i>>8), byte(i)).To4()
			dst := net.IPv4(198, 18, 9, 9).To4()
			f := &netlink.ConntrackFlow{FamilyType: unix.AF_INET, TimeOut: 600,
				Forward: netlink.IPTuple{SrcIP: src, DstIP: dst, Protocol: unix.IPPROTO_UDP, SrcPort: 4000, DstPort: 53},
				Reverse: netlink.IPTuple{SrcIP: dst, DstIP: src, Protocol: unix.IPPROTO_UDP, SrcPort: 53, DstPort: 4000}}
			if err := netlink.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, f); err != nil {
				return err
			}
		}
		return nil
	}))
}

func (w *world) flowCount() int {
	w.t.Helper()
	var n int
	must(w.t, inNetNS(w.nodeNS, func() error {
		flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
		n = len(flows)
		return err
	}))
	return n
}

// TestTeardownForgetsOnlyItsConnections checks that a sandbox's teardown
// deletes the node's conntrack entries from its host address, and no
// other: not another sandbox's, not the node's other traffic. It also
// times the kernel-filtered flush against the dump of the whole table it
// replaces, on a table of 4000 entries.
func TestTeardownForgetsOnlyItsConnections(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	rules := Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}}
	a, err := w.m.Setup(ctx, id(t, "a"), rules)
	must(t, err)
	b, err := w.m.Setup(ctx, id(t, "b"), rules)
	must(t, err)
	allowed(t, "a → api:443", func() error { return tcpFrom(a, apiIP+":443") })
	allowed(t, "b → api:443", func() error { return tcpFrom(b, apiIP+":443") })
	const others = 4000
	w.addFlows(others)
	want := []string{a.HostAddr.String(), b.HostAddr.String()}
	slices.Sort(want)
	if got := w.flowSources(w.nodeNS, apiIP, 443); !slices.Equal(got, want) {
		t.Fatalf("node's flows to api:443 from %v, want %v", got, want)
	}
	before := w.flowCount()

	// The two ways of flushing an address with no entries, side by side.
	idle := netip.MustParseAddr("10.251.0.1")
	t0 := time.Now()
	n, err := conntrackDeleteFrom(w.nodeNS, idle)
	filtered := time.Since(t0)
	must(t, err)
	t0 = time.Now()
	must(t, inNetNS(w.nodeNS, func() error {
		_, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, ctFilter{src: idle, cut: func(netip.Addr, uint8, uint16) bool { return true }})
		return err
	}))
	dumped := time.Since(t0)
	t.Logf("flush of an address with no entries in a table of %d: kernel-filtered %v, whole-table dump %v", before, filtered, dumped)
	if n != 0 || w.flowCount() != before {
		t.Fatalf("flush of an idle address deleted %d entries (table %d → %d)", n, before, w.flowCount())
	}

	must(t, w.m.Teardown(ctx, a.ID))
	if got := w.flowSources(w.nodeNS, apiIP, 443); !slices.Equal(got, []string{b.HostAddr.String()}) {
		t.Fatalf("after a's teardown the node's flows to api:443 come from %v, want only b's %s", got, b.HostAddr)
	}
	if got := w.flowCount(); got >= before || got < others+1 {
		t.Fatalf("after a's teardown the table has %d entries (before %d, %d of them not a's)", got, before, others+1)
	}
}
