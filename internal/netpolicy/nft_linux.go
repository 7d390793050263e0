package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Layout. The node's table (TableName) holds the NAT, the ingress of every
// sandbox and the node-wide set of sandbox veths; each sandbox's egress
// chain and domain sets live in a shard table of at most shardSize
// sandboxes (by allocation index), with base chains of its own that
// dispatch by a verdict map on the veth. Every nftables commit that adds a
// jump (a rule's verdict, a verdict map element) makes the kernel validate
// the whole table it touches, every chain reachable from its base chains
// (nft_chain_validate): with every sandbox in one table a create cost O(n)
// in the kernel. A shard bounds that to O(shardSize), and adding a veth to
// the node's set (no verdict) validates nothing.
//
// Per packet: the node's table tests the veth set (ingress: jump to the one
// shared ingress chain; egress: accept there, the shard decides); each
// shard looks the veth up in its map; a packet is dropped when any table
// drops it. A packet from a sandbox meets its own egress chain exactly
// once, and never the ingress chain, as in one table.
//
// Tables of the layout before shards (sandbox chains, maps sandbox_out and
// sandbox_in in the node's table) keep working: the node's base chains
// dispatch through those maps first, and Recover moves each live
// sandbox's rules into its shard.
const (
	outMapName  = "sandbox_out" // host ifname → jump sb-<id>-o
	inMapName   = "sandbox_in"  // host ifname → jump sb-<id>-i (layout before shards)
	ifSetName   = "sandbox_ifs" // host ifnames of the sandboxes in shards
	inChainName = "sandbox-in"  // every sandbox's ingress
	chainPrefix = "sb-"
	// ProxyMark is the socket mark (SO_MARK) of the node's port proxy: the
	// only traffic the node may open towards a sandbox.
	ProxyMark = 0x0d5ec001
)

// shardSize is the number of sandboxes (allocation indexes) per shard
// table: a commit validates at most that many sandbox chains; a packet
// meets one base chain per shard. A variable for tests only.
var shardSize = 64

func outChain(id string) string         { return chainPrefix + id + "-o" }
func egressCounter(id string) string    { return chainPrefix + id + "-c" }
func inChain(id string) string          { return chainPrefix + id + "-i" }
func domainSet(id string, i int) string { return fmt.Sprintf("%s%s-d%d", chainPrefix, id, i) }
func idFromChain(name string) (string, bool) {
	if !strings.HasPrefix(name, chainPrefix) {
		return "", false
	}
	s := strings.TrimPrefix(name, chainPrefix)
	for _, suf := range []string{"-o", "-i"} {
		if strings.HasSuffix(s, suf) {
			return strings.TrimSuffix(s, suf), true
		}
	}
	return "", false
}

// shardOf is the shard of allocation index i.
func shardOf(i int) int { return max(i-1, 0) / shardSize }

// shardTableName is shard k of the node table main.
func shardTableName(main string, k int) string { return fmt.Sprintf("%s.s%d", main, k) }

// isShardOf reports whether table name is a shard of main.
func isShardOf(main, name string) bool {
	rest, ok := strings.CutPrefix(name, main+".s")
	if !ok || rest == "" {
		return false
	}
	for _, c := range rest {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

func ifnameKey(name string) []byte {
	b := make([]byte, 16)
	copy(b, name)
	return b
}

// nftState builds batches on one connection; callers hold Manager.nftMu.
type nftState struct {
	c     *nftables.Conn
	table *nftables.Table
	pool  netip.Prefix
	dns   netip.Addr
	// shards are the shard tables whose base this connection installed
	// since its last failed commit.
	shards map[string]bool
}

// shard is the table of the sandbox with allocation index i.
func (n *nftState) shard(i int) *nftables.Table {
	return &nftables.Table{Name: shardTableName(n.table.Name, shardOf(i)), Family: nftables.TableFamilyINet}
}

// flush sends the queued batch; after a failure nothing of it holds, so
// shard bases are installed again.
func (n *nftState) flush() error {
	err := n.c.Flush()
	if err != nil {
		clear(n.shards)
	}
	return err
}

func vmapIn(t *nftables.Table, name string) *nftables.Set {
	return &nftables.Set{Table: t, Name: name, IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
}

func dsetIn(t *nftables.Table, name string) *nftables.Set {
	return &nftables.Set{Table: t, Name: name, KeyType: nftables.TypeIPAddr, HasTimeout: true}
}

func (n *nftState) vmap(name string) *nftables.Set { return vmapIn(n.table, name) }

func (n *nftState) ifSet() *nftables.Set {
	return &nftables.Set{Table: n.table, Name: ifSetName, KeyType: nftables.TypeIFName}
}

// ensureBase creates the node table, its maps, set and base chains and
// rewrites the base chains' rules, all in one batch, so a restarted node
// neither duplicates rules nor opens a gap in enforcement.
func (n *nftState) ensureBase() error {
	c := n.c
	c.AddTable(n.table)
	out, in, ifs := n.vmap(outMapName), n.vmap(inMapName), n.ifSet()
	for _, s := range []*nftables.Set{out, in, ifs} {
		if err := c.AddSet(s, nil); err != nil {
			return fmt.Errorf("add nft set %s: %w", s.Name, err)
		}
	}
	accept := nftables.ChainPolicyAccept
	base := func(name string, hook *nftables.ChainHook, prio *nftables.ChainPriority, typ nftables.ChainType) *nftables.Chain {
		ch := c.AddChain(&nftables.Chain{Name: name, Table: n.table, Hooknum: hook, Priority: prio, Type: typ, Policy: &accept})
		c.FlushChain(ch)
		return ch
	}
	fwd := base("forward", nftables.ChainHookForward, nftables.ChainPriorityFilter, nftables.ChainTypeFilter)
	inp := base("input", nftables.ChainHookInput, nftables.ChainPriorityFilter, nftables.ChainTypeFilter)
	outp := base("output", nftables.ChainHookOutput, nftables.ChainPriorityFilter, nftables.ChainTypeFilter)
	post := base("postrouting", nftables.ChainHookPostrouting, nftables.ChainPriorityNATSource, nftables.ChainTypeNAT)
	ingress := c.AddChain(&nftables.Chain{Name: inChainName, Table: n.table})
	c.FlushChain(ingress)
	add := func(ch *nftables.Chain, ex ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: n.table, Chain: ch, Exprs: ex})
	}
	// Ingress of every sandbox: replies, and the node's port proxy;
	// nothing else.
	add(ingress, append(ctEstablished(), verdict(expr.VerdictAccept))...)
	add(ingress, &expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(ProxyMark)}, verdict(expr.VerdictAccept))
	add(ingress, verdict(expr.VerdictDrop))
	vmapRule := func(ch *nftables.Chain, key expr.MetaKey, m *nftables.Set) {
		add(ch, &expr.Meta{Key: key, Register: 1},
			&expr.Lookup{SourceRegister: 1, IsDestRegSet: true, DestRegister: 0, SetName: m.Name, SetID: m.ID})
	}
	inSet := func(key expr.MetaKey) []expr.Any {
		return []expr.Any{&expr.Meta{Key: key, Register: 1}, &expr.Lookup{SourceRegister: 1, SetName: ifs.Name, SetID: ifs.ID}}
	}
	// The maps hold sandboxes of the layout before shards.
	vmapRule(fwd, expr.MetaKeyIIFNAME, out)
	// A sandbox's egress is its shard's to judge; the ingress chain never
	// sees it.
	add(fwd, append(inSet(expr.MetaKeyIIFNAME), verdict(expr.VerdictAccept))...)
	vmapRule(fwd, expr.MetaKeyOIFNAME, in)
	add(fwd, append(inSet(expr.MetaKeyOIFNAME), &expr.Verdict{Kind: expr.VerdictJump, Chain: inChainName})...)
	vmapRule(inp, expr.MetaKeyIIFNAME, out)
	vmapRule(outp, expr.MetaKeyOIFNAME, in)
	add(outp, append(inSet(expr.MetaKeyOIFNAME), &expr.Verdict{Kind: expr.VerdictJump, Chain: inChainName})...)
	// Allowed egress leaves the node with the node's address.
	masq := []expr.Any{}
	masq = append(masq, nfproto(unix.NFPROTO_IPV4)...)
	masq = append(masq, matchPrefix(12, n.pool, expr.CmpOpEq)...)
	masq = append(masq, matchPrefix(16, n.pool, expr.CmpOpNeq)...)
	masq = append(masq, &expr.Masq{})
	add(post, masq...)
	if err := n.flush(); err != nil {
		return fmt.Errorf("install nft base table: %w", err)
	}
	return nil
}

// queueShard queues the creation of shard table t with its map and base
// chains (egress of its sandboxes, to the node and through it), once per
// connection: rewriting its base chains makes the commit validate the
// shard.
func (n *nftState) queueShard(t *nftables.Table) error {
	if n.shards[t.Name] {
		return nil
	}
	c := n.c
	c.AddTable(t)
	out := vmapIn(t, outMapName)
	if err := c.AddSet(out, nil); err != nil {
		return fmt.Errorf("add nft map: %w", err)
	}
	accept := nftables.ChainPolicyAccept
	for _, h := range []struct {
		name string
		hook *nftables.ChainHook
	}{{"forward", nftables.ChainHookForward}, {"input", nftables.ChainHookInput}} {
		ch := c.AddChain(&nftables.Chain{Name: h.name, Table: t, Hooknum: h.hook, Priority: nftables.ChainPriorityFilter, Type: nftables.ChainTypeFilter, Policy: &accept})
		c.FlushChain(ch)
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Lookup{SourceRegister: 1, IsDestRegSet: true, DestRegister: 0, SetName: out.Name, SetID: out.ID},
		}})
	}
	if n.shards == nil {
		n.shards = map[string]bool{}
	}
	n.shards[t.Name] = true
	return nil
}

func nfproto(p byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}},
	}
}

// matchPrefix compares the IPv4 address at network-header offset off
// (12 saddr, 16 daddr) with p.
func matchPrefix(off uint32, p netip.Prefix, op expr.CmpOp) []expr.Any {
	a := p.Addr().As4()
	if p.Bits() == 0 {
		if op == expr.CmpOpEq {
			return nil
		}
	}
	ex := []expr.Any{&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: 4}}
	if p.Bits() < 32 {
		m := netipMask(p.Bits())
		ex = append(ex, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: m[:], Xor: []byte{0, 0, 0, 0}})
	}
	return append(ex, &expr.Cmp{Op: op, Register: 1, Data: a[:]})
}

func netipMask(bits int) [4]byte {
	v := uint32(0)
	if bits > 0 {
		v = ^uint32(0) << (32 - bits)
	}
	return [4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}
}

func ctEstablished() []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED),
			Xor:  binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
	}
}

func verdict(k expr.VerdictKind) *expr.Verdict { return &expr.Verdict{Kind: k} }

var protoNums = map[string]byte{ProtoTCP: unix.IPPROTO_TCP, ProtoUDP: unix.IPPROTO_UDP, ProtoICMP: unix.IPPROTO_ICMP}

// ruleExprs expands one rule into nft rules (match expressions without the
// verdict), one per protocol it covers. dst matches the destination.
func ruleExprs(r rule, dst []expr.Any) [][]expr.Any {
	protos := []string{r.proto}
	if r.proto == ProtoAny && r.portHi != 0 {
		protos = []string{ProtoTCP, ProtoUDP}
	}
	var out [][]expr.Any
	for _, p := range protos {
		ex := append([]expr.Any{}, dst...)
		if p != ProtoAny {
			ex = append(ex,
				&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{protoNums[p]}})
		}
		if r.portHi != 0 {
			ex = append(ex, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2})
			if r.portLo == r.portHi {
				ex = append(ex, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(r.portLo)})
			} else {
				ex = append(ex, &expr.Range{Op: expr.CmpOpEq, Register: 1,
					FromData: binaryutil.BigEndian.PutUint16(r.portLo), ToData: binaryutil.BigEndian.PutUint16(r.portHi)})
			}
		}
		out = append(out, ex)
	}
	return out
}

func (n *nftState) protectedExplicit(r rule) bool { return protectedExplicit(n.pool, r) }

// sandboxSpec is what applySandbox needs about one sandbox.
type sandboxSpec struct {
	id     string
	index  int // allocation index: picks the shard
	hostIf string
	addr   netip.Addr
	rules  []rule
	// oldDomainSets is how many domain sets the sandbox had before; extra
	// ones are deleted.
	oldDomainSets int
	// flushSets empties domain sets before refilling them from seed (rules
	// changed); false keeps what the kernel holds (recovery).
	flushSets bool
	seed      []learned
}

func domainRules(rs []rule) []rule {
	var out []rule
	for _, r := range rs {
		if r.isDomain() {
			out = append(out, r)
		}
	}
	return out
}

// applySandbox installs or replaces a sandbox's chains, sets and map
// entries in one batch.
func (n *nftState) applySandbox(s sandboxSpec, now time.Time) error {
	if err := n.addSandbox(s, now); err != nil {
		return err
	}
	if err := n.flush(); err != nil {
		return fmt.Errorf("apply nft rules of sandbox %s: %w", s.id, err)
	}
	return nil
}

// addSandbox queues applySandbox's messages on the connection; the next
// Flush sends them, with whatever else is queued, as one transaction.
func (n *nftState) addSandbox(s sandboxSpec, now time.Time) error {
	t := n.shard(s.index)
	if err := n.queueShard(t); err != nil {
		return err
	}
	if err := n.queueEgress(t, s, now); err != nil {
		return err
	}
	if err := n.c.SetAddElements(n.ifSet(), []nftables.SetElement{{Key: ifnameKey(s.hostIf)}}); err != nil {
		return fmt.Errorf("add nft set element: %w", err)
	}
	return nil
}

// queueEgress queues a sandbox's egress chain, domain sets and map entry
// in table t.
func (n *nftState) queueEgress(t *nftables.Table, s sandboxSpec, now time.Time) error {
	c := n.c
	c.AddObj(&nftables.CounterObj{Table: t, Name: egressCounter(s.id)})
	o := c.AddChain(&nftables.Chain{Name: outChain(s.id), Table: t})
	c.FlushChain(o)
	doms := domainRules(s.rules)
	for k := len(doms); k < s.oldDomainSets; k++ {
		ds := dsetIn(t, domainSet(s.id, k))
		if err := c.AddSet(ds, nil); err != nil {
			return fmt.Errorf("add nft set: %w", err)
		}
		c.DelSet(ds)
	}
	sets := make([]*nftables.Set, len(doms))
	for k, d := range doms {
		ds := dsetIn(t, domainSet(s.id, k))
		if err := c.AddSet(ds, nil); err != nil {
			return fmt.Errorf("add nft set: %w", err)
		}
		if s.flushSets {
			c.FlushSet(ds)
		}
		var elems []nftables.SetElement
		for _, l := range s.seed {
			left := l.expires.Sub(now)
			if left > time.Second && d.matches(l.name) {
				a := l.addr.As4()
				elems = append(elems, nftables.SetElement{Key: a[:], Timeout: left.Truncate(time.Second)})
			}
		}
		if len(elems) > 0 {
			if err := c.SetAddElements(ds, elems); err != nil {
				return fmt.Errorf("add nft set elements: %w", err)
			}
		}
		sets[k] = ds
	}
	add := func(ch *nftables.Chain, ex ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: ex})
	}
	drop, accept := verdict(expr.VerdictDrop), verdict(expr.VerdictAccept)
	// Every packet from the veth is counted first, in a named counter that
	// lives from the sandbox's first rules to its teardown (a rewrite of the
	// chain keeps it: an existing counter is not reset by adding it again):
	// a sandbox that sent no packet has no conntrack entry on the node, and
	// its teardown skips the flush (egressPackets).
	add(o, &expr.Objref{Type: unix.NFT_OBJECT_COUNTER, Name: egressCounter(s.id)})
	// Egress: no IPv6, no spoofing, replies pass, the DNS proxy is reachable.
	add(o, append(nfproto(unix.NFPROTO_IPV6), drop)...)
	add(o, append(matchPrefix(12, netip.PrefixFrom(s.addr, 32), expr.CmpOpNeq), drop)...)
	add(o, append(ctEstablished(), accept)...)
	dnsDst := matchPrefix(16, netip.PrefixFrom(n.dns, 32), expr.CmpOpEq)
	for _, ex := range ruleExprs(rule{proto: ProtoAny, portLo: 53, portHi: 53}, dnsDst) {
		add(o, append(ex, accept)...)
	}
	var broad, callerExplicit []rule
	for _, r := range s.rules {
		switch {
		case r.isDomain():
		case !n.protectedExplicit(r):
			broad = append(broad, r)
		case !r.fromSet:
			callerExplicit = append(callerExplicit, r)
		default:
			// An administrator's rule set may open protected ranges,
			// the node's own addresses in them included.
			for _, ex := range ruleExprs(r, matchPrefix(16, r.prefix, expr.CmpOpEq)) {
				add(o, append(ex, accept)...)
			}
		}
	}
	// Protected destinations: the node's own addresses (the node end of
	// the veth and the DNS address too: DNS to the proxy is accepted above),
	// every sandbox, link-local and metadata. A caller's rule inside
	// link-local or the pool opens those ranges, never the node itself.
	add(o, &expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(unix.RTN_LOCAL)}, drop)
	// The guest's own /30 (its gateway stands for the node: only DNS to it
	// is forwarded, in the sandbox's namespace) never leaves the node.
	add(o, append(matchPrefix(16, guestPrefix.Masked(), expr.CmpOpEq), drop)...)
	for _, r := range callerExplicit {
		for _, ex := range ruleExprs(r, matchPrefix(16, r.prefix, expr.CmpOpEq)) {
			add(o, append(ex, accept)...)
		}
	}
	add(o, append(matchPrefix(16, n.pool, expr.CmpOpEq), drop)...)
	add(o, append(matchPrefix(16, linkLocal, expr.CmpOpEq), drop)...)
	for _, r := range broad {
		for _, ex := range ruleExprs(r, matchPrefix(16, r.prefix, expr.CmpOpEq)) {
			add(o, append(ex, accept)...)
		}
	}
	for k, d := range doms {
		dst := []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
			&expr.Lookup{SourceRegister: 1, SetName: sets[k].Name, SetID: sets[k].ID},
		}
		for _, ex := range ruleExprs(d, dst) {
			add(o, append(ex, accept)...)
		}
	}
	add(o, drop)
	key := ifnameKey(s.hostIf)
	if err := c.SetAddElements(vmapIn(t, outMapName), []nftables.SetElement{{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: o.Name}}}); err != nil {
		return fmt.Errorf("add nft map element: %w", err)
	}
	return nil
}

// removeSandbox deletes a sandbox's veth entries, chains and sets in one
// batch: from its shard (every shard when index is 0: unknown) and what
// the layout before shards left in the node table. Each object is added
// before it is deleted, so the batch succeeds whatever a crash left
// behind.
func (n *nftState) removeSandbox(id string, index int, hostIfs []string, domainSets int) error {
	tables := []*nftables.Table{n.table}
	if index > 0 {
		tables = append(tables, n.shard(index))
	} else {
		all, err := n.tables()
		if err != nil {
			return err
		}
		tables = all
	}
	for _, t := range tables {
		if err := n.queueRemove(t, id, hostIfs, domainSets); err != nil {
			return err
		}
	}
	if err := n.c.AddSet(n.ifSet(), nil); err != nil {
		return fmt.Errorf("add nft set: %w", err)
	}
	for _, hostIf := range hostIfs {
		el := []nftables.SetElement{{Key: ifnameKey(hostIf)}}
		if err := n.c.SetAddElements(n.ifSet(), el); err != nil {
			return fmt.Errorf("add nft set element: %w", err)
		}
		if err := n.c.SetDeleteElements(n.ifSet(), el); err != nil {
			return fmt.Errorf("delete nft set element: %w", err)
		}
	}
	if err := n.flush(); err != nil {
		return fmt.Errorf("remove nft rules of sandbox %s: %w", id, err)
	}
	return nil
}

// egressPackets returns how many packets the egress chain of sandbox id
// (allocation index index) counted since its first rules: every packet from
// the sandbox's veth that reached the node's filter hooks. One request for
// one object, not a dump.
func (n *nftState) egressPackets(id string, index int) (uint64, error) {
	o, err := n.c.GetObject(&nftables.CounterObj{Table: n.shard(index), Name: egressCounter(id)})
	if err != nil {
		return 0, fmt.Errorf("read nft egress counter of sandbox %s: %w", id, err)
	}
	c, ok := o.(*nftables.CounterObj)
	if !ok {
		return 0, fmt.Errorf("nft egress counter of sandbox %s is a %T", id, o)
	}
	return c.Packets, nil
}

// queueRemove queues the removal of a sandbox's map entries, chains and
// sets from table t (a shard, or a table of the layout before shards).
func (n *nftState) queueRemove(t *nftables.Table, id string, hostIfs []string, domainSets int) error {
	c := n.c
	c.AddTable(t)
	o := c.AddChain(&nftables.Chain{Name: outChain(id), Table: t})
	i := c.AddChain(&nftables.Chain{Name: inChain(id), Table: t})
	for _, hostIf := range hostIfs {
		key := ifnameKey(hostIf)
		for _, m := range []struct {
			set   string
			chain string
		}{{outMapName, o.Name}, {inMapName, i.Name}} {
			vm := vmapIn(t, m.set)
			if err := c.AddSet(vm, nil); err != nil {
				return fmt.Errorf("add nft map: %w", err)
			}
			el := []nftables.SetElement{{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: m.chain}}}
			if err := c.SetAddElements(vm, el); err != nil {
				return fmt.Errorf("add nft map element: %w", err)
			}
			if err := c.SetDeleteElements(vm, el); err != nil {
				return fmt.Errorf("delete nft map element: %w", err)
			}
		}
	}
	c.FlushChain(o)
	c.FlushChain(i)
	c.DelChain(o)
	c.DelChain(i)
	// After the rule that uses it is gone; added first, so that a table
	// without it (the layout before counters) takes the removal too.
	ctr := &nftables.CounterObj{Table: t, Name: egressCounter(id)}
	c.AddObj(ctr)
	c.DeleteObject(ctr)
	for k := 0; k < domainSets; k++ {
		ds := dsetIn(t, domainSet(id, k))
		if err := c.AddSet(ds, nil); err != nil {
			return fmt.Errorf("add nft set: %w", err)
		}
		c.DelSet(ds)
	}
	return nil
}

// tables lists the node table and its shards.
func (n *nftState) tables() ([]*nftables.Table, error) {
	ts, err := n.c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("list nft tables: %w", err)
	}
	out := []*nftables.Table{n.table}
	for _, t := range ts {
		if isShardOf(n.table.Name, t.Name) {
			out = append(out, &nftables.Table{Name: t.Name, Family: nftables.TableFamilyINet})
		}
	}
	return out, nil
}

// leftovers lists the sandbox IDs that own chains or domain sets in the
// node table or its shards, with the number of domain sets each has.
func (n *nftState) leftovers() (map[string]int, error) {
	tables, err := n.tables()
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, t := range tables {
		if err := n.leftoversIn(t, out); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// leftoversIn adds what table t holds to out (see leftovers).
func (n *nftState) leftoversIn(t *nftables.Table, out map[string]int) error {
	chains, err := n.c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return fmt.Errorf("list nft chains: %w", err)
	}
	for _, ch := range chains {
		if ch.Table.Name != t.Name {
			continue
		}
		if id, ok := idFromChain(ch.Name); ok {
			if _, seen := out[id]; !seen {
				out[id] = 0
			}
		}
	}
	sets, err := n.c.GetSets(t)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("list nft sets: %w", err)
	}
	for _, s := range sets {
		rest, ok := strings.CutPrefix(s.Name, chainPrefix)
		if !ok {
			continue
		}
		j := strings.LastIndex(rest, "-d")
		if j < 0 {
			continue
		}
		var k int
		if _, err := fmt.Sscanf(rest[j+2:], "%d", &k); err != nil {
			continue
		}
		id := rest[:j]
		if k+1 > out[id] {
			out[id] = k + 1
		}
	}
	return nil
}
