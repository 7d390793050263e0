package netpolicy

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// nodeObjects are what one node has in the shared node namespace and
// netns_dir: its table, the sandbox chains in it, and the veths and
// namespace files of its sandboxes.
type nodeObjects struct {
	table  bool
	chains int
	veths  []string
	netns  []string
}

func (w *world) objectsOf(node string) nodeObjects {
	w.t.Helper()
	var o nodeObjects
	h, err := netlink.NewHandleAt(mustNS(w.t, w.nodeNS))
	must(w.t, err)
	defer h.Close()
	links, err := h.LinkList()
	must(w.t, err)
	for _, l := range links {
		if a := l.Attrs(); l.Type() == "veth" && strings.HasPrefix(a.Alias, node) {
			o.veths = append(o.veths, a.Name)
		}
	}
	conn, err := nftables.New(nftables.WithNetNSFd(int(mustNS(w.t, w.nodeNS))))
	must(w.t, err)
	tables, err := conn.ListTablesOfFamily(nftables.TableFamilyINet)
	must(w.t, err)
	o.table = slices.ContainsFunc(tables, func(t *nftables.Table) bool { return t.Name == TableName(node) })
	chains, err := conn.ListChainsOfTableFamily(nftables.TableFamilyINet)
	must(w.t, err)
	for _, ch := range chains {
		if id, ok := idFromChain(ch.Name); ok && (ch.Table.Name == TableName(node) || isShardOf(TableName(node), ch.Table.Name)) && strings.HasPrefix(id, node) {
			o.chains++
		}
	}
	ents, err := os.ReadDir(w.cfg.NetNSDir)
	if err != nil && !os.IsNotExist(err) {
		w.t.Fatal(err)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), node) {
			o.netns = append(o.netns, e.Name())
		}
	}
	return o
}

// Two nodes on one machine, in one network namespace and with one
// netns_dir (the harshest sharing: nodes in namespaces of their own share
// less), each with its own node ID, state and pool. A restart and recovery
// of either leaves the other's veths, table, namespace files and policy
// alone, and each cleans up only its own.
func TestSecurityTwoNodesShareANamespace(t *testing.T) {
	w := newWorldOf(t, "aaaa")
	ctx := t.Context()
	cfgB := w.cfg
	cfgB.NodeID = "bbbb"
	cfgB.StateDir = filepath.Join(w.dir, "state-b")
	cfgB.Pool = "100.112.0.0/24" // one namespace: the nodes' addresses must differ
	newB := func() *Manager {
		m, err := New(ctx, cfgB, "")
		must(t, err)
		return m
	}
	b := newB()
	t.Cleanup(func() { b.Close() })

	rules := Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}}
	sa, err := w.m.Setup(ctx, "aaaa"+id(t, "1"), rules)
	must(t, err)
	sb, err := b.Setup(ctx, "bbbb"+id(t, "1"), rules)
	must(t, err)
	if sa.HostIf == sb.HostIf || !strings.HasPrefix(sa.HostIf, "odaaaa") || !strings.HasPrefix(sb.HostIf, "odbbbb") || len(sa.HostIf) != 15 {
		t.Fatalf("veths %q and %q: want od<node> and 9 characters each", sa.HostIf, sb.HostIf)
	}
	works := func(what string, n Network) {
		t.Helper()
		allowed(t, what+": allowed address", func() error { return tcpFrom(n, apiIP+":443") })
		denied(t, what+": other address", tcpFrom(n, evilIP+":443"))
		denied(t, what+": other port", tcpFrom(n, apiIP+":8443"))
	}
	works("node a", sa)
	works("node b", sb)
	wantA := w.objectsOf("aaaa")
	wantB := w.objectsOf("bbbb")
	if !wantA.table || wantA.chains != 1 || len(wantA.veths) != 1 || len(wantA.netns) != 1 {
		t.Fatalf("node a has %+v; want its table, 1 chain, a veth and a namespace", wantA)
	}
	if !wantB.table || wantB.chains != 1 || len(wantB.veths) != 1 || len(wantB.netns) != 1 {
		t.Fatalf("node b has %+v; want its table, 1 chain, a veth and a namespace", wantB)
	}

	// Node b restarts and recovers with its own sandbox alive.
	b.Close()
	b = newB()
	rep, err := b.Recover(ctx, func(id string) bool { return id == sb.ID })
	must(t, err)
	if !slices.Equal(rep.Kept, []string{sb.ID}) || len(rep.Removed) != 0 {
		t.Errorf("node b's recover: %+v; want only %s kept, nothing removed", rep, sb.ID)
	}
	if got := w.objectsOf("aaaa"); !equalObjects(got, wantA) {
		t.Fatalf("node b's restart changed node a's objects: %+v, want %+v", got, wantA)
	}
	works("node a after b's restart", sa)
	works("node b after its restart", sb)

	// Node a restarts too; b's are left alone.
	w.m.Close()
	w.m = w.newManager()
	rep, err = w.m.Recover(ctx, func(id string) bool { return id == sa.ID })
	must(t, err)
	if !slices.Equal(rep.Kept, []string{sa.ID}) || len(rep.Removed) != 0 {
		t.Errorf("node a's recover: %+v; want only %s kept", rep, sa.ID)
	}
	if got := w.objectsOf("bbbb"); !equalObjects(got, wantB) {
		t.Fatalf("node a's restart changed node b's objects: %+v, want %+v", got, wantB)
	}
	works("node b after a's restart", sb)

	// Node b finds its sandbox dead: it removes that one, nothing of a's.
	b.Close()
	b = newB()
	rep, err = b.Recover(ctx, func(string) bool { return false })
	must(t, err)
	if !slices.Equal(rep.Removed, []string{sb.ID}) {
		t.Errorf("node b's recover with nothing alive removed %v; want only %s", rep.Removed, sb.ID)
	}
	if got := w.objectsOf("bbbb"); !got.table || got.chains != 0 || len(got.veths) != 0 || len(got.netns) != 0 {
		t.Errorf("node b after removing its sandbox: %+v; want its table and nothing else", got)
	}
	if got := w.objectsOf("aaaa"); !equalObjects(got, wantA) {
		t.Fatalf("node b's cleanup changed node a's objects: %+v, want %+v", got, wantA)
	}
	works("node a after b's cleanup", sa)

	// And a's teardown leaves b's table.
	must(t, w.m.Teardown(ctx, sa.ID))
	if got := w.objectsOf("aaaa"); got.chains != 0 || len(got.veths) != 0 || len(got.netns) != 0 {
		t.Errorf("node a after teardown: %+v", got)
	}
	if !w.objectsOf("bbbb").table {
		t.Error("node a's teardown removed node b's table")
	}
}

func equalObjects(a, b nodeObjects) bool {
	return a.table == b.table && a.chains == b.chains && slices.Equal(a.veths, b.veths) && slices.Equal(a.netns, b.netns)
}

// A node upgraded from before node IDs were in the names still recovers
// the sandboxes it started then: the old veth and namespace path are kept,
// the rules move to the node's own table, the old table goes, and a later
// teardown removes the old veth.
func TestSecurityTwoNodesUpgradeKeepsOldNames(t *testing.T) {
	w := newWorld(t) // no node ID: the names of before
	ctx := t.Context()
	rules := Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}}
	old, err := w.m.Setup(ctx, "aaaa"+id(t, "1"), rules)
	must(t, err)
	if old.HostIf != HostIfName("", old.ID) {
		t.Fatalf("veth without node ID %q, want %q", old.HostIf, HostIfName("", old.ID))
	}
	// State of before had no names in it.
	p := filepath.Join(w.cfg.StateDir, "sandboxes", old.ID+".json")
	raw, err := os.ReadFile(p)
	must(t, err)
	var st map[string]any
	must(t, json.Unmarshal(raw, &st))
	delete(st, "host_if")
	delete(st, "netns_path")
	raw, err = json.Marshal(st)
	must(t, err)
	must(t, os.WriteFile(p, raw, 0o600))

	w.m.Close()
	w.cfg.NodeID = "aaaa"
	w.m = w.newManager()
	rep, err := w.m.Recover(ctx, func(id string) bool { return id == old.ID })
	must(t, err)
	if !slices.Equal(rep.Kept, []string{old.ID}) {
		t.Fatalf("recover after upgrade: %+v; want %s kept", rep, old.ID)
	}
	got, err := w.m.Get(old.ID)
	must(t, err)
	if got.HostIf != old.HostIf || got.NetNSPath != old.NetNSPath {
		t.Errorf("after upgrade the sandbox has veth %q netns %q, want %q %q", got.HostIf, got.NetNSPath, old.HostIf, old.NetNSPath)
	}
	o := w.objectsOf("aaaa")
	if !o.table || o.chains != 1 || !slices.Equal(o.veths, []string{old.HostIf}) {
		t.Errorf("after upgrade node a has %+v; want its table with 1 chain and veth %s", o, old.HostIf)
	}
	if w.objectsOf("").table {
		t.Errorf("table %q still there after the upgrade moved its rules", tableName)
	}
	allowed(t, "upgraded sandbox, allowed address", func() error { return tcpFrom(old, apiIP+":443") })
	denied(t, "upgraded sandbox, other address", tcpFrom(old, evilIP+":443"))
	// Rules change in the node's own table only, and take effect.
	must(t, w.m.SetRules(ctx, old.ID, Rules{Allow: []Rule{{CIDR: evilIP, Protocol: "tcp", Ports: "443"}}}))
	allowed(t, "upgraded sandbox, newly allowed address", func() error { return tcpFrom(old, evilIP+":443") })
	must(t, w.m.Teardown(ctx, old.ID))
	if o := w.objectsOf("aaaa"); o.chains != 0 || len(o.veths) != 0 || len(o.netns) != 0 {
		t.Errorf("after teardown: %+v; want nothing of the sandbox", o)
	}
}

// Two nodes in one namespace with one pool would share addresses: the
// second refuses to start, naming the fix, and leaves the first working.
func TestSecurityTwoNodesOnePoolRefused(t *testing.T) {
	w := newWorldOf(t, "aaaa")
	ctx := t.Context()
	sa, err := w.m.Setup(ctx, "aaaa"+id(t, "1"), Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}})
	must(t, err)
	cfgB := w.cfg
	cfgB.NodeID = "bbbb"
	cfgB.StateDir = filepath.Join(w.dir, "state-b")
	b, err := New(ctx, cfgB, "")
	if err == nil {
		b.Close()
		t.Fatal("a second node with the same pool in the same namespace started")
	}
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "network.pool") {
		t.Errorf("second node's error %v: want invalid_argument naming network.pool", err)
	}
	if w.objectsOf("bbbb").table {
		t.Errorf("the refused node left its table %s", TableName("bbbb"))
	}
	allowed(t, "first node's sandbox", func() error { return tcpFrom(sa, apiIP+":443") })
}
