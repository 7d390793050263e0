package netpolicy

import (
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Names of the node-wide nftables objects, in the node's table
// (TableName).
const (
	outMapName  = "sandbox_out" // host ifname → jump sb-<id>-o
	inMapName   = "sandbox_in"  // host ifname → jump sb-<id>-i
	chainPrefix = "sb-"
	// ProxyMark is the socket mark (SO_MARK) of the node's port proxy: the
	// only traffic the node may open towards a sandbox.
	ProxyMark = 0x0d5ec001
)

func outChain(id string) string         { return chainPrefix + id + "-o" }
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
}

func (n *nftState) vmap(name string) *nftables.Set {
	return &nftables.Set{Table: n.table, Name: name, IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
}

func (n *nftState) dset(name string) *nftables.Set {
	return &nftables.Set{Table: n.table, Name: name, KeyType: nftables.TypeIPAddr, HasTimeout: true}
}

// ensureBase creates the table, maps and base chains and rewrites the base
// chains' rules, all in one batch, so a restarted node neither duplicates
// rules nor opens a gap in enforcement.
func (n *nftState) ensureBase() error {
	c := n.c
	c.AddTable(n.table)
	out, in := n.vmap(outMapName), n.vmap(inMapName)
	if err := c.AddSet(out, nil); err != nil {
		return fmt.Errorf("add nft map: %w", err)
	}
	if err := c.AddSet(in, nil); err != nil {
		return fmt.Errorf("add nft map: %w", err)
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
	vmapRule := func(ch *nftables.Chain, key expr.MetaKey, m *nftables.Set) {
		c.AddRule(&nftables.Rule{Table: n.table, Chain: ch, Exprs: []expr.Any{
			&expr.Meta{Key: key, Register: 1},
			&expr.Lookup{SourceRegister: 1, IsDestRegSet: true, DestRegister: 0, SetName: m.Name, SetID: m.ID},
		}})
	}
	vmapRule(fwd, expr.MetaKeyIIFNAME, out)
	vmapRule(fwd, expr.MetaKeyOIFNAME, in)
	vmapRule(inp, expr.MetaKeyIIFNAME, out)
	vmapRule(outp, expr.MetaKeyOIFNAME, in)
	// Allowed egress leaves the node with the node's address.
	masq := []expr.Any{}
	masq = append(masq, nfproto(unix.NFPROTO_IPV4)...)
	masq = append(masq, matchPrefix(12, n.pool, expr.CmpOpEq)...)
	masq = append(masq, matchPrefix(16, n.pool, expr.CmpOpNeq)...)
	masq = append(masq, &expr.Masq{})
	c.AddRule(&nftables.Rule{Table: n.table, Chain: post, Exprs: masq})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("install nft base table: %w", err)
	}
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
	if err := n.c.Flush(); err != nil {
		return fmt.Errorf("apply nft rules of sandbox %s: %w", s.id, err)
	}
	return nil
}

// addSandbox queues applySandbox's messages on the connection; the next
// Flush sends them, with whatever else is queued, as one transaction.
func (n *nftState) addSandbox(s sandboxSpec, now time.Time) error {
	c := n.c
	o := c.AddChain(&nftables.Chain{Name: outChain(s.id), Table: n.table})
	i := c.AddChain(&nftables.Chain{Name: inChain(s.id), Table: n.table})
	c.FlushChain(o)
	c.FlushChain(i)
	doms := domainRules(s.rules)
	for k := len(doms); k < s.oldDomainSets; k++ {
		ds := n.dset(domainSet(s.id, k))
		if err := c.AddSet(ds, nil); err != nil {
			return fmt.Errorf("add nft set: %w", err)
		}
		c.DelSet(ds)
	}
	sets := make([]*nftables.Set, len(doms))
	for k, d := range doms {
		ds := n.dset(domainSet(s.id, k))
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
		c.AddRule(&nftables.Rule{Table: n.table, Chain: ch, Exprs: ex})
	}
	drop, accept := verdict(expr.VerdictDrop), verdict(expr.VerdictAccept)
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
	// Ingress: replies, and the node's port proxy; nothing else.
	add(i, append(ctEstablished(), accept)...)
	add(i, &expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(ProxyMark)}, accept)
	add(i, drop)
	key := ifnameKey(s.hostIf)
	if err := c.SetAddElements(n.vmap(outMapName), []nftables.SetElement{{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: o.Name}}}); err != nil {
		return fmt.Errorf("add nft map element: %w", err)
	}
	if err := c.SetAddElements(n.vmap(inMapName), []nftables.SetElement{{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: i.Name}}}); err != nil {
		return fmt.Errorf("add nft map element: %w", err)
	}
	return nil
}

// removeSandbox deletes a sandbox's map entries, chains and sets in one
// batch. Each object is added before it is deleted, so the batch succeeds
// whatever a crash left behind.
func (n *nftState) removeSandbox(id string, hostIfs []string, domainSets int) error {
	c := n.c
	o := c.AddChain(&nftables.Chain{Name: outChain(id), Table: n.table})
	i := c.AddChain(&nftables.Chain{Name: inChain(id), Table: n.table})
	for _, hostIf := range hostIfs {
		key := ifnameKey(hostIf)
		for _, m := range []struct {
			set   string
			chain string
		}{{outMapName, o.Name}, {inMapName, i.Name}} {
			el := []nftables.SetElement{{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: m.chain}}}
			if err := c.SetAddElements(n.vmap(m.set), el); err != nil {
				return fmt.Errorf("add nft map element: %w", err)
			}
			if err := c.SetDeleteElements(n.vmap(m.set), el); err != nil {
				return fmt.Errorf("delete nft map element: %w", err)
			}
		}
	}
	c.FlushChain(o)
	c.FlushChain(i)
	c.DelChain(o)
	c.DelChain(i)
	for k := 0; k < domainSets; k++ {
		ds := n.dset(domainSet(id, k))
		if err := c.AddSet(ds, nil); err != nil {
			return fmt.Errorf("add nft set: %w", err)
		}
		c.DelSet(ds)
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("remove nft rules of sandbox %s: %w", id, err)
	}
	return nil
}

// leftovers lists the sandbox IDs that own chains or domain sets in the
// table, with the number of domain sets each has.
func (n *nftState) leftovers() (map[string]int, error) {
	out := map[string]int{}
	chains, err := n.c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("list nft chains: %w", err)
	}
	for _, ch := range chains {
		if ch.Table.Name != n.table.Name {
			continue
		}
		if id, ok := idFromChain(ch.Name); ok {
			if _, seen := out[id]; !seen {
				out[id] = 0
			}
		}
	}
	sets, err := n.c.GetSets(n.table)
	if err != nil {
		return nil, fmt.Errorf("list nft sets: %w", err)
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
	return out, nil
}
