package netpolicy

import (
	"crypto/rand"
	"encoding/hex"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func TestDefaultDeny(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	a, err := w.m.Setup(ctx, id(t, "a"), Rules{})
	must(t, err)
	b, err := w.m.Setup(ctx, id(t, "b"), Rules{})
	must(t, err)
	if a.HostAddr == b.HostAddr || a.HostGateway.Next() != a.HostAddr || a.GuestAddr != b.GuestAddr {
		t.Fatalf("addresses: a %v (host %v via %v), b %v (host %v)", a.GuestAddr, a.HostAddr, a.HostGateway, b.GuestAddr, b.HostAddr)
	}
	// The world works from the node itself.
	var nodeNet = Network{NetNSPath: w.nodeNS}
	allowed(t, "node → internet tcp", func() error { return tcpFrom(nodeNet, apiIP+":443") })

	denied(t, "tcp out", tcpFrom(a, apiIP+":443"))
	denied(t, "udp out", udpFrom(a, apiIP+":9000"))
	denied(t, "icmp out", pingFrom(a, apiIP))
	if _, _, err := resolveFrom(a, upstreamIP+":53", "api.example.test"); err == nil {
		t.Error("dns to another server than the proxy: answered, want dropped")
	}
	rcode, _, err := resolveFrom(a, a.DNS.String()+":53", "api.example.test")
	must(t, err)
	if rcode != dns.RcodeNameError {
		t.Errorf("proxy answered %s for a name no rule allows, want NXDOMAIN", dns.RcodeToString[rcode])
	}
	if n := w.upstream.Load(); n != 0 {
		t.Errorf("upstream got %d queries, want 0", n)
	}
	// IPv6 is off inside.
	must(t, inNetNS(a.NetNSPath, func() error {
		v, err := os.ReadFile("/proc/sys/net/ipv6/conf/all/disable_ipv6")
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(v)) != "1" {
			t.Errorf("disable_ipv6 = %q, want 1", v)
		}
		return nil
	}))
	denied(t, "ipv6 out", inNetNS(a.NetNSPath, func() error {
		c, err := net.DialTimeout("tcp6", "[2001:db8::1]:443", denyWait)
		if err == nil {
			c.Close()
		}
		return err
	}))
	// Another sandbox and the node are unreachable.
	w.tcpEcho(b.NetNSPath, "0.0.0.0:8080")
	w.tcpEcho(w.nodeNS, "0.0.0.0:9999")
	denied(t, "sandbox → sandbox", tcpFrom(a, b.HostAddr.String()+":8080"))
	denied(t, "sandbox → its gateway", tcpFrom(a, a.GuestGateway.String()+":9999"))
	denied(t, "sandbox → node end of its veth", tcpFrom(a, a.HostGateway.String()+":9999"))
	denied(t, "sandbox → node uplink address", tcpFrom(a, nodeUplink+":9999"))
	denied(t, "sandbox → dns address other port", tcpFrom(a, a.DNS.String()+":9999"))
	denied(t, "sandbox → node dns address other port", tcpFrom(a, w.m.DNSAddr().String()+":9999"))
	denied(t, "sandbox → metadata", tcpFrom(a, "169.254.169.254:80"))
	// Control: the same probe passes once a rule allows it, so the denials
	// above are the policy and not broken plumbing.
	must(t, w.m.SetRules(ctx, a.ID, Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}}))
	allowed(t, "tcp out after allow", func() error { return tcpFrom(a, apiIP+":443") })
	// Even a rule for everything leaves other sandboxes and the node closed.
	must(t, w.m.SetRules(ctx, a.ID, Rules{Allow: []Rule{{CIDR: "0.0.0.0/0"}}}))
	allowed(t, "tcp out with 0.0.0.0/0", func() error { return tcpFrom(a, apiIP+":80") })
	allowed(t, "icmp out with 0.0.0.0/0", func() error { return pingFrom(a, apiIP) })
	denied(t, "sandbox → sandbox with 0.0.0.0/0", tcpFrom(a, b.HostAddr.String()+":8080"))
	denied(t, "sandbox → node with 0.0.0.0/0", tcpFrom(a, nodeUplink+":9999"))
}

func TestDomainRule(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	s, err := w.m.Setup(ctx, id(t, "a"), Rules{RuleSets: []string{"example"}})
	must(t, err)
	dnsSrv := s.DNS.String() + ":53"
	denied(t, "allowed port before the name is resolved", tcpFrom(s, apiIP+":443"))

	rcode, ips, err := resolveFrom(s, dnsSrv, "api.example.test")
	must(t, err)
	if rcode != dns.RcodeSuccess || !slices.Equal(ips, []string{apiIP}) {
		t.Fatalf("api.example.test: %s %v, want NOERROR [%s]", dns.RcodeToString[rcode], ips, apiIP)
	}
	allowed(t, "resolved name, allowed port", func() error { return tcpFrom(s, apiIP+":443") })
	denied(t, "resolved address, other port", tcpFrom(s, apiIP+":8443"))
	denied(t, "resolved address, udp", udpFrom(s, apiIP+":9000"))
	denied(t, "sibling's address", tcpFrom(s, evilIP+":443"))
	if got := w.upstream.Load(); got != 1 {
		t.Fatalf("upstream queries = %d, want 1", got)
	}
	rcode, _, err = resolveFrom(s, dnsSrv, "evil.example.test")
	must(t, err)
	if rcode != dns.RcodeNameError {
		t.Errorf("evil.example.test: %s, want NXDOMAIN", dns.RcodeToString[rcode])
	}
	// A DNS tunnel: long random labels under an allowed parent.
	for range 20 {
		b := make([]byte, 30)
		rand.Read(b)
		name := hex.EncodeToString(b) + ".api.example.test"
		rcode, _, err := resolveFrom(s, dnsSrv, name)
		must(t, err)
		if rcode != dns.RcodeNameError {
			t.Fatalf("%s: %s, want NXDOMAIN", name, dns.RcodeToString[rcode])
		}
	}
	if got := w.upstream.Load(); got != 1 {
		t.Errorf("upstream queries after evil and tunnel = %d, want still 1", got)
	}
	// A suffix pattern allows names below it, not the suffix itself.
	must(t, w.m.SetRules(ctx, s.ID, Rules{RuleSets: []string{"wild"}}))
	rcode, ips, err = resolveFrom(s, dnsSrv, "evil.example.test")
	must(t, err)
	if rcode != dns.RcodeSuccess || !slices.Equal(ips, []string{evilIP}) {
		t.Fatalf("evil.example.test under *.example.test: %s %v", dns.RcodeToString[rcode], ips)
	}
	allowed(t, "wildcard-resolved address", func() error { return tcpFrom(s, evilIP+":443") })
	rcode, _, err = resolveFrom(s, dnsSrv, "example.test")
	must(t, err)
	if rcode != dns.RcodeNameError {
		t.Errorf("example.test under *.example.test: %s, want NXDOMAIN", dns.RcodeToString[rcode])
	}
	// A query from an address that is no sandbox is refused.
	rcode, _, err = resolveFrom(Network{NetNSPath: w.nodeNS}, w.m.DNSAddr().String()+":53", "api.example.test")
	must(t, err)
	if rcode != dns.RcodeRefused {
		t.Errorf("query from the node: %s, want REFUSED", dns.RcodeToString[rcode])
	}
}

func TestCIDRRule(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	s, err := w.m.Setup(ctx, id(t, "a"), Rules{Allow: []Rule{{CIDR: "198.18.1.0/24", Protocol: "tcp", Ports: "440-450"}}})
	must(t, err)
	allowed(t, "cidr + port", func() error { return tcpFrom(s, apiIP+":443") })
	allowed(t, "cidr + port, other host", func() error { return tcpFrom(s, evilIP+":443") })
	denied(t, "cidr, other port", tcpFrom(s, apiIP+":80"))
	denied(t, "cidr, other port above range", tcpFrom(s, apiIP+":8443"))
	denied(t, "cidr, udp", udpFrom(s, apiIP+":9000"))
	denied(t, "cidr, icmp", pingFrom(s, apiIP))
	must(t, w.m.SetRules(ctx, s.ID, Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "icmp"}, {CIDR: apiIP + "/32", Protocol: "udp", Ports: "9000"}}}))
	allowed(t, "icmp rule", func() error { return pingFrom(s, apiIP) })
	allowed(t, "udp rule", func() error { return udpFrom(s, apiIP+":9000") })
	denied(t, "tcp after tcp rule removed", tcpFrom(s, apiIP+":443"))
}

func TestSetRulesWhileRunning(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	allow := Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}}
	s, err := w.m.Setup(ctx, id(t, "a"), allow)
	must(t, err)
	// An open connection made while allowed.
	var conn net.Conn
	must(t, inNetNS(s.NetNSPath, func() (err error) { conn, err = net.DialTimeout("tcp4", apiIP+":443", time.Second); return err }))
	defer conn.Close()
	must(t, roundTrip(conn))
	// A connection to a destination the new rules keep must survive.
	keepRules := Rules{Allow: []Rule{{CIDR: evilIP, Protocol: "tcp", Ports: "443"}}}
	must(t, w.m.SetRules(ctx, s.ID, Rules{Allow: append(allow.Allow, keepRules.Allow...)}))
	var kept net.Conn
	must(t, inNetNS(s.NetNSPath, func() (err error) { kept, err = net.DialTimeout("tcp4", evilIP+":443", time.Second); return err }))
	defer kept.Close()
	must(t, roundTrip(kept))

	start := time.Now()
	must(t, w.m.SetRules(ctx, s.ID, keepRules))
	took := eventually(t, time.Second, "open connection cut", func() error {
		if roundTrip(conn) == nil {
			return errNotYet
		}
		return nil
	})
	eventually(t, time.Second-time.Since(start)+took, "new connection refused", func() error {
		if tcpFrom(s, apiIP+":443") == nil {
			return errNotYet
		}
		return nil
	})
	t.Logf("deny verified %v after SetRules began (probe timeouts included)", time.Since(start))
	allowed(t, "connection the new rules allow survives", func() error { return roundTrip(kept) })
	if r, _ := w.m.Rules(s.ID); len(r.Allow) != 1 || r.Allow[0].CIDR != evilIP {
		t.Errorf("Rules() = %+v", r)
	}

	start = time.Now()
	must(t, w.m.SetRules(ctx, s.ID, allow))
	eventually(t, time.Second, "allow took effect", func() error { return tcpFrom(s, apiIP+":443") })
	t.Logf("allow took effect in %v", time.Since(start))
}

var errNotYet = errdefs.New(errdefs.ErrFailedPrecondition, "not yet")

func TestBadInput(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	good := Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "443"}}}
	s, err := w.m.Setup(ctx, id(t, "a"), good)
	must(t, err)
	before := w.count()
	cases := []struct {
		name  string
		rules Rules
		field string
	}{
		{"invalid cidr", Rules{Allow: []Rule{{CIDR: "10.0.0.300/8"}}}, "allow[0].cidr"},
		{"ipv6 cidr", Rules{Allow: []Rule{{CIDR: "2001:db8::/32"}}}, "allow[0].cidr"},
		{"port 0", Rules{Allow: []Rule{{CIDR: "10.0.0.0/8", Ports: "0"}}}, "allow[0].ports"},
		{"port 65536", Rules{Allow: []Rule{{CIDR: "10.0.0.0/8", Ports: "80-65536"}}}, "allow[0].ports"},
		{"backwards range", Rules{Allow: []Rule{{CIDR: "10.0.0.0/8", Ports: "90-80"}}}, "allow[0].ports"},
		{"domain with spaces", Rules{Allow: []Rule{{CIDR: "10.0.0.0/8"}, {Domain: "evil .example.test"}}}, "allow[1].domain"},
		{"unknown rule set", Rules{RuleSets: []string{"example", "nope"}}, "rule_sets[1]"},
		{"unknown protocol", Rules{Allow: []Rule{{CIDR: "10.0.0.0/8", Protocol: "sctp"}}}, "allow[0].protocol"},
		{"icmp with ports", Rules{Allow: []Rule{{CIDR: "10.0.0.0/8", Protocol: "icmp", Ports: "1"}}}, "allow[0].ports"},
		{"cidr and domain", Rules{Allow: []Rule{{CIDR: "10.0.0.0/8", Domain: "a.test"}}}, "allow[0]"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := w.m.Setup(ctx, id(t, "x"), c.rules)
			check := func(op string, err error) {
				if !errdefs.IsInvalidArgument(err) {
					t.Fatalf("%s: error %v, want invalid argument", op, err)
				}
				if !strings.HasPrefix(err.Error(), c.field+":") {
					t.Errorf("%s: error %q does not name field %s", op, err, c.field)
				}
			}
			check("Setup", err)
			check("SetRules", w.m.SetRules(ctx, s.ID, c.rules))
		})
	}
	if after := w.count(); after != before {
		t.Errorf("bad input changed objects: before %+v after %+v", before, after)
	}
	if r, _ := w.m.Rules(s.ID); len(r.Allow) != 1 || r.Allow[0] != good.Allow[0] {
		t.Errorf("rules changed by bad input: %+v", r)
	}
	allowed(t, "old rules still enforced", func() error { return tcpFrom(s, apiIP+":443") })
	denied(t, "old rules still enforced", tcpFrom(s, apiIP+":80"))
	if err := w.m.SetRules(ctx, "nosuchsandbox", good); !errdefs.IsNotFound(err) {
		t.Errorf("SetRules of unknown sandbox: %v, want not found", err)
	}
	if _, err := w.m.Setup(ctx, s.ID, good); err == nil {
		t.Error("second Setup of one sandbox succeeded")
	}
	if _, err := w.m.Setup(ctx, "Bad-ID", good); !errdefs.IsInvalidArgument(err) {
		t.Errorf("bad id: %v", err)
	}
}

func TestTeardownAndRecover(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	empty := w.count()
	if empty.chains+empty.sets+empty.veths+empty.netns+empty.allocs+empty.states+empty.mapElems != 0 {
		t.Fatalf("fresh node not empty: %+v", empty)
	}
	rules := Rules{RuleSets: []string{"example"}, Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "80"}}}
	var nets []Network
	for _, n := range []string{"a", "b", "c"} {
		s, err := w.m.Setup(ctx, id(t, n), rules)
		must(t, err)
		nets = append(nets, s)
	}
	full := w.count()
	want := counts{veths: 3, chains: 3, sets: 3, baseRules: empty.baseRules, mapElems: 6, netns: 3, allocs: 3, states: 3}
	if full != want {
		t.Fatalf("after 3 setups: %+v, want %+v", full, want)
	}
	// One file per sandbox: its state file is its address allocation.
	for _, n := range nets {
		st, err := os.Stat(filepath.Join(w.cfg.StateDir, "sandboxes", n.ID+".json"))
		must(t, err)
		var found bool
		for idx, owner := range must2(t, w.m.alloc.list) {
			if owner == n.ID {
				a, err := os.Stat(w.m.alloc.path(idx))
				must(t, err)
				found = os.SameFile(st, a)
			}
		}
		if !found {
			t.Errorf("state file of %s is not its allocation file", n.ID)
		}
	}
	must(t, w.m.Teardown(ctx, nets[2].ID))
	must(t, w.m.Teardown(ctx, nets[2].ID)) // twice is fine
	want = counts{veths: 2, chains: 2, sets: 2, baseRules: empty.baseRules, mapElems: 4, netns: 2, allocs: 2, states: 2}
	if got := w.count(); got != want {
		t.Fatalf("after teardown: %+v, want %+v", got, want)
	}
	// The node dies (its kernel state stays) and starts again: nothing is
	// duplicated, and the running sandbox keeps its policy.
	_, _, err := resolveFrom(nets[0], nets[0].DNS.String()+":53", "api.example.test")
	must(t, err)
	w.m.Close()
	w.m = w.newManager()
	if got := w.count(); got != want {
		t.Fatalf("after restart: %+v, want %+v", got, want)
	}
	rep, err := w.m.Recover(ctx, func(id string) bool { return id == nets[0].ID })
	must(t, err)
	sort.Strings(rep.Removed)
	if !slices.Equal(rep.Kept, []string{nets[0].ID}) || !slices.Equal(rep.Removed, []string{nets[1].ID}) {
		t.Errorf("recover report %+v", rep)
	}
	want = counts{veths: 1, chains: 1, sets: 1, baseRules: empty.baseRules, mapElems: 2, netns: 1, allocs: 1, states: 1}
	if got := w.count(); got != want {
		t.Fatalf("after recover: %+v, want %+v", got, want)
	}
	allowed(t, "kept sandbox, address admitted before the crash", func() error { return tcpFrom(nets[0], apiIP+":443") })
	allowed(t, "kept sandbox, cidr rule", func() error { return tcpFrom(nets[0], apiIP+":80") })
	denied(t, "kept sandbox, deny", tcpFrom(nets[0], apiIP+":8443"))
	rcode, _, err := resolveFrom(nets[0], nets[0].DNS.String()+":53", "evil.example.test")
	must(t, err)
	if rcode != dns.RcodeNameError {
		t.Errorf("restarted proxy answered %s for evil", dns.RcodeToString[rcode])
	}
	// A new sandbox after restart gets a fresh address.
	d, err := w.m.Setup(ctx, id(t, "d"), Rules{})
	must(t, err)
	if d.HostAddr == nets[0].HostAddr {
		t.Errorf("restarted node reused address %v", d.HostAddr)
	}
	must(t, w.m.Teardown(ctx, d.ID))
	// Leftovers with no state at all (a crash between steps) are found too.
	must(t, os.Remove(filepath.Join(w.cfg.StateDir, "sandboxes", nets[0].ID+".json")))
	w.m.Close()
	w.m = w.newManager()
	rep, err = w.m.Recover(ctx, func(string) bool { return false })
	must(t, err)
	if !slices.Equal(rep.Removed, []string{nets[0].ID}) {
		t.Errorf("second recover report %+v", rep)
	}
	if got := w.count(); got != empty {
		t.Fatalf("after recovering with nothing alive: %+v, want %+v", got, empty)
	}
}

func must2[T any](t *testing.T, f func() (T, error)) T {
	t.Helper()
	v, err := f()
	must(t, err)
	return v
}

// BenchmarkSetup measures Setup of one sandbox network (netns, veth,
// addresses, route, nftables) and reports its p50; bench/ runs it.
func BenchmarkSetup(b *testing.B) {
	w := newWorld(b)
	ctx := b.Context()
	var durs []time.Duration
	for i := 0; b.Loop(); i++ {
		sid := "bench" + strings.Repeat("0", 3) + string(rune('a'+i%26)) + hex.EncodeToString([]byte{byte(i >> 8), byte(i)})
		start := time.Now()
		if _, err := w.m.Setup(ctx, sid, Rules{RuleSets: []string{"example"}}); err != nil {
			b.Fatal(err)
		}
		durs = append(durs, time.Since(start))
		b.StopTimer()
		if err := w.m.Teardown(ctx, sid); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	slices.Sort(durs)
	b.ReportMetric(float64(durs[len(durs)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(durs[len(durs)*95/100].Microseconds())/1000, "p95-ms")
}
