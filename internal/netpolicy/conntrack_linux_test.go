package netpolicy

import (
	"encoding/json"
	"net"
	"net/netip"
	"os"
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

// TestTeardownConntrackCounted checks when a teardown may skip the
// conntrack flush: only when the sandbox's egress counter shows that no
// packet of it ever reached the node. A sandbox whose chain was rewritten
// (SetRules, a node restart) keeps its flows: they must still go, or the
// next sandbox on its host address would inherit them (a counter that
// started again with the chain would lose them).
func TestTeardownConntrackCounted(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	rules := Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}}
	flushes := func() (uint64, uint64) { return w.m.ctFlushes.Load(), w.m.ctSkipped.Load() }
	gone := func(what string, n Network) {
		t.Helper()
		if got := w.flowSources(w.nodeNS, apiIP, 443); slices.Contains(got, n.HostAddr.String()) {
			t.Fatalf("%s: the node still tracks flows from %s after its teardown: %v", what, n.HostAddr, got)
		}
	}

	idle, err := w.m.Setup(ctx, id(t, "idle"), rules)
	must(t, err)
	must(t, w.m.Teardown(ctx, idle.ID))
	if f, s := flushes(); f != 0 || s != 1 {
		t.Fatalf("idle sandbox: %d flushes, %d skipped; want 0, 1", f, s)
	}

	a, err := w.m.Setup(ctx, id(t, "a"), rules)
	must(t, err)
	allowed(t, "a → api:443", func() error { return tcpFrom(a, apiIP+":443") })
	must(t, w.m.Teardown(ctx, a.ID))
	gone("a", a)
	if f, s := flushes(); f != 1 || s != 1 {
		t.Fatalf("after a: %d flushes, %d skipped; want 1, 1", f, s)
	}

	// The same rules again: the flow stays allowed and tracked, the chain
	// is new.
	b, err := w.m.Setup(ctx, id(t, "b"), rules)
	must(t, err)
	allowed(t, "b → api:443", func() error { return tcpFrom(b, apiIP+":443") })
	must(t, w.m.SetRules(ctx, b.ID, rules))
	if got := w.flowSources(w.nodeNS, apiIP, 443); !slices.Contains(got, b.HostAddr.String()) {
		t.Fatalf("b's allowed flow was cut by SetRules of the same rules: %v", got)
	}
	must(t, w.m.Teardown(ctx, b.ID))
	gone("b after SetRules", b)

	// A node restart: the reloaded sandbox's chain is rewritten.
	c, err := w.m.Setup(ctx, id(t, "c"), rules)
	must(t, err)
	allowed(t, "c → api:443", func() error { return tcpFrom(c, apiIP+":443") })
	w.restart()
	_, err = w.m.Recover(ctx, func(id string) bool { return id == c.ID })
	must(t, err)
	must(t, w.m.Teardown(ctx, c.ID))
	gone("c after a restart", c)

	// After a restart an idle sandbox still skips; one whose state is of a
	// node before the counter flushes, counter or not.
	d, err := w.m.Setup(ctx, id(t, "d"), rules)
	must(t, err)
	e, err := w.m.Setup(ctx, id(t, "e"), rules)
	must(t, err)
	statePath := w.m.statePath(e.ID)
	b0, err := os.ReadFile(statePath)
	must(t, err)
	var st map[string]any
	must(t, json.Unmarshal(b0, &st))
	if st["counted"] != true {
		t.Fatalf("state of a new sandbox is not counted: %s", b0)
	}
	delete(st, "counted")
	b1, err := json.Marshal(st)
	must(t, err)
	must(t, os.WriteFile(statePath, b1, 0o600))
	w.restart()
	_, err = w.m.Recover(ctx, func(id string) bool { return id == d.ID || id == e.ID })
	must(t, err)
	f0, s0 := flushes()
	must(t, w.m.Teardown(ctx, d.ID))
	if f, s := flushes(); f != f0 || s != s0+1 {
		t.Fatalf("idle sandbox after a restart: %d flushes, %d skipped; want %d, %d", f, s, f0, s0+1)
	}
	must(t, w.m.Teardown(ctx, e.ID))
	if f, s := flushes(); f != f0+1 || s != s0+1 {
		t.Fatalf("sandbox of a node before the counter: %d flushes, %d skipped; want %d, %d", f, s, f0+1, s0+1)
	}
}
