package netpolicy

import (
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
)

// toUnshardedLayout rewrites a sandbox's rules into the layout of before
// shards: its egress and ingress chains, domain sets and map entries in
// the node table itself, nothing in its shard or the node's veth set.
func (w *world) toUnshardedLayout(id string) {
	w.t.Helper()
	sb, err := w.m.get(id)
	must(w.t, err)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	w.m.nftMu.Lock()
	defer w.m.nftMu.Unlock()
	n := w.m.nft
	c := n.c
	spec := sandboxSpec{id: id, index: sb.st.Index, hostIf: sb.net.HostIf, addr: sb.net.HostAddr, rules: sb.rules, flushSets: true, seed: sb.learned.list(time.Now())}
	must(w.t, n.queueEgress(n.table, spec, time.Now()))
	i := c.AddChain(&nftables.Chain{Name: inChain(id), Table: n.table})
	c.FlushChain(i)
	c.AddRule(&nftables.Rule{Table: n.table, Chain: i, Exprs: append(ctEstablished(), verdict(expr.VerdictAccept))})
	c.AddRule(&nftables.Rule{Table: n.table, Chain: i, Exprs: []expr.Any{verdict(expr.VerdictDrop)}})
	must(w.t, c.SetAddElements(n.vmap(inMapName), []nftables.SetElement{{Key: ifnameKey(spec.hostIf), VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: i.Name}}}))
	must(w.t, n.queueRemove(n.shard(spec.index), id, []string{spec.hostIf}, sb.st.DomainSets))
	el := []nftables.SetElement{{Key: ifnameKey(spec.hostIf)}}
	must(w.t, c.SetDeleteElements(n.ifSet(), el))
	must(w.t, n.flush())
}

// A node restarted on a table of the layout before shards keeps enforcing
// its sandboxes' rules from it, and Recover moves them into their shards,
// DNS admissions included, leaving nothing behind in the node table.
func TestRecoverMovesUnshardedRulesIntoShards(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	rules := Rules{RuleSets: []string{"example"}, Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "80"}}}
	s, err := w.m.Setup(ctx, id(t, "a"), rules)
	must(t, err)
	_, ips, err := resolveFrom(s, s.DNS.String()+":53", "api.example.test")
	must(t, err)
	if len(ips) == 0 {
		t.Fatal("api.example.test resolved to nothing")
	}
	w.toUnshardedLayout(s.ID)
	w.m.Close()
	w.m = w.newManager()
	old := map[string]int{}
	must(t, w.m.nft.leftoversIn(w.m.nft.table, old))
	if _, ok := old[s.ID]; !ok {
		t.Fatalf("the node table holds no rules of %s before recover: %v", s.ID, old)
	}
	// Before Recover: the old layout's rules are enforced.
	allowed(t, "unsharded layout, cidr rule", func() error { return tcpFrom(s, apiIP+":80") })
	denied(t, "unsharded layout, other address", tcpFrom(s, evilIP+":443"))

	rep, err := w.m.Recover(ctx, func(id string) bool { return id == s.ID })
	must(t, err)
	if len(rep.Kept) != 1 || len(rep.Removed) != 0 {
		t.Fatalf("recover report %+v", rep)
	}
	left := map[string]int{}
	must(t, w.m.nft.leftoversIn(w.m.nft.table, left))
	if len(left) != 0 {
		t.Errorf("rules left in the node table after recover: %v", left)
	}
	want := counts{veths: 1, chains: 1, sets: 1, baseRules: w.count().baseRules, mapElems: 2, netns: 1, allocs: 1, states: 1}
	if got := w.count(); got != want {
		t.Errorf("after recover: %+v, want %+v", got, want)
	}
	if got := w.setElems(s.ID, 0); len(got) == 0 {
		t.Errorf("domain set of %s is empty after the move; want what DNS admitted before (%v)", s.ID, ips)
	}
	allowed(t, "moved sandbox, address admitted before the move", func() error { return tcpFrom(s, apiIP+":443") })
	allowed(t, "moved sandbox, cidr rule", func() error { return tcpFrom(s, apiIP+":80") })
	denied(t, "moved sandbox, other address", tcpFrom(s, evilIP+":443"))
	must(t, w.m.Teardown(ctx, s.ID))
	if got := w.count(); got.chains+got.sets+got.mapElems != 0 {
		t.Errorf("after teardown: %+v", got)
	}
}

// Sandboxes in different shards each get their own policy, and the
// shards' base chains never judge another shard's sandbox: egress as its
// rules say, nothing into a sandbox, no sandbox to another.
func TestSandboxesInTwoShards(t *testing.T) {
	old := shardSize
	shardSize = 1
	t.Cleanup(func() { shardSize = old })
	w := newWorld(t)
	ctx := t.Context()
	a, err := w.m.Setup(ctx, id(t, "a"), Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}})
	must(t, err)
	b, err := w.m.Setup(ctx, id(t, "b"), Rules{Allow: []Rule{{CIDR: evilIP, Protocol: "tcp", Ports: "443"}}})
	must(t, err)
	tables, err := w.m.nft.tables()
	must(t, err)
	if len(tables) != 3 {
		t.Fatalf("%d tables, want the node's and 2 shards", len(tables))
	}
	w.tcpEcho(a.NetNSPath, "0.0.0.0:8080")
	w.tcpEcho(b.NetNSPath, "0.0.0.0:8080")
	allowed(t, "a → its allowed address", func() error { return tcpFrom(a, apiIP+":443") })
	denied(t, "a → b's allowed address", tcpFrom(a, evilIP+":443"))
	allowed(t, "b → its allowed address", func() error { return tcpFrom(b, evilIP+":443") })
	denied(t, "b → a's allowed address", tcpFrom(b, apiIP+":443"))
	denied(t, "a → b", tcpFrom(a, b.HostAddr.String()+":8080"))
	denied(t, "b → a", tcpFrom(b, a.HostAddr.String()+":8080"))
	node := Network{NetNSPath: w.nodeNS}
	denied(t, "node → a", tcpFrom(node, a.HostAddr.String()+":8080"))
	denied(t, "node → b", tcpFrom(node, b.HostAddr.String()+":8080"))
	inet := Network{NetNSPath: w.inetNS}
	denied(t, "internet → b", tcpFrom(inet, b.HostAddr.String()+":8080"))
	must(t, w.m.Teardown(ctx, a.ID))
	allowed(t, "b after a's teardown", func() error { return tcpFrom(b, evilIP+":443") })
	must(t, w.m.Teardown(ctx, b.ID))
	if got := w.count(); got.chains+got.sets+got.mapElems != 0 {
		t.Errorf("after teardown: %+v", got)
	}
}
