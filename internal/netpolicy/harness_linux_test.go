package netpolicy

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"sync/atomic"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"

	"github.com/kernflux/opendsec/internal/testutil"
)

// The test's own internet, in a namespace it made and routed from the test's
// node namespace: nothing here is sent outside namespaces the test created.
const (
	apiIP      = "198.18.1.10" // api.example.test
	evilIP     = "198.18.1.11" // evil.example.test
	otherIP    = "198.18.1.12" // every other name
	upstreamIP = "198.18.1.53"
	nodeUplink = "198.18.0.1"
)

// world is a node namespace with a Manager, plus an internet namespace with
// TCP/UDP echo servers and a DNS server that counts queries.
type world struct {
	t        testing.TB
	dir      string
	nodeNS   string
	inetNS   string
	cfg      Config
	m        *Manager
	upstream atomic.Int64
}

func newWorld(t testing.TB) *world { return newWorldOf(t, "") }

// newWorldOf is newWorld with a Manager of node nodeID (Config.NodeID).
func newWorldOf(t testing.TB, nodeID string) *world {
	testutil.RequiresRoot(t)
	dir, err := os.MkdirTemp("", "netpolicy-test-")
	if err != nil {
		t.Fatal(err)
	}
	w := &world{t: t, dir: dir, nodeNS: filepath.Join(dir, "node"), inetNS: filepath.Join(dir, "inet")}
	t.Cleanup(func() {
		if w.m != nil {
			w.m.Close()
		}
		// Removing the namespaces removes everything inside them.
		filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
			if err == nil && !info.IsDir() {
				removeNetNS(p)
			}
			return nil
		})
		os.RemoveAll(dir)
	})
	loUp := func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.LinkSetUp(lo)
	}
	must(t, createNetNS(w.nodeNS, loUp))
	must(t, createNetNS(w.inetNS, loUp))
	inet, err := netns.GetFromPath(w.inetNS)
	must(t, err)
	defer inet.Close()
	must(t, inNetNS(w.nodeNS, func() error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "uplink"}, PeerName: "peer", PeerNamespace: netlink.NsFd(int(inet))}); err != nil {
			return err
		}
		l, err := netlink.LinkByName("uplink")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: prefixNet(netip.MustParsePrefix(nodeUplink + "/24"))}); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		_, dst, _ := net.ParseCIDR("198.18.1.0/24")
		return netlink.RouteAdd(&netlink.Route{Dst: dst, Gw: net.ParseIP("198.18.0.2")})
	}))
	must(t, inNetNS(w.inetNS, func() error {
		l, err := netlink.LinkByName("peer")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: prefixNet(netip.MustParsePrefix("198.18.0.2/24"))}); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		lo, _ := netlink.LinkByName("lo")
		for _, a := range []string{apiIP, evilIP, otherIP, upstreamIP} {
			if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: prefixNet(netip.MustParsePrefix(a + "/32"))}); err != nil {
				return err
			}
		}
		return nil
	}))
	nodeH, err := netlink.NewHandleAt(mustNS(t, w.nodeNS))
	must(t, err)
	must(t, waitOperUp(t.Context(), nodeH, "uplink"))
	nodeH.Close()
	for _, a := range []string{apiIP + ":443", apiIP + ":80", apiIP + ":8443", evilIP + ":443", otherIP + ":443"} {
		w.tcpEcho(w.inetNS, a)
	}
	w.udpEcho(apiIP + ":9000")
	w.dnsServer()
	w.cfg = Config{
		NetNSDir: filepath.Join(dir, "netns"),
		StateDir: filepath.Join(dir, "state"),
		Upstream: []string{upstreamIP + ":53"},
		RuleSets: map[string][]Rule{
			"example": {{Domain: "api.example.test", Protocol: "tcp", Ports: "443"}},
			"wild":    {{Domain: "*.example.test", Protocol: "tcp", Ports: "443"}},
		},
		NodeNetNS: w.nodeNS,
		NodeID:    nodeID,
	}
	w.m = w.newManager()
	return w
}

func (w *world) newManager() *Manager {
	m, err := New(w.t.Context(), w.cfg, "")
	must(w.t, err)
	return m
}

func mustNS(t testing.TB, path string) netns.NsHandle {
	h, err := netns.GetFromPath(path)
	must(t, err)
	t.Cleanup(func() { h.Close() })
	return h
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// tcpEcho serves line echo at addr inside ns until the test ends.
func (w *world) tcpEcho(ns, addr string) net.Listener {
	var ln net.Listener
	must(w.t, inNetNS(ns, func() (err error) { ln, err = net.Listen("tcp4", addr); return err }))
	w.t.Cleanup(func() { ln.Close() })
	go serveEcho(ln)
	return ln
}

// serveEcho echoes lines on every connection ln accepts until it is closed.
func serveEcho(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			r := bufio.NewReader(c)
			for {
				l, err := r.ReadString('\n')
				if err != nil {
					return
				}
				if _, err := c.Write([]byte(l)); err != nil {
					return
				}
			}
		}()
	}
}

func (w *world) udpEcho(addr string) {
	var pc net.PacketConn
	must(w.t, inNetNS(w.inetNS, func() (err error) { pc, err = net.ListenPacket("udp4", addr); return err }))
	w.t.Cleanup(func() { pc.Close() })
	go func() {
		b := make([]byte, 1500)
		for {
			n, a, err := pc.ReadFrom(b)
			if err != nil {
				return
			}
			pc.WriteTo(b[:n], a)
		}
	}()
}

// dnsServer is the fake upstream: it counts every query it receives.
func (w *world) dnsServer() {
	var pc net.PacketConn
	must(w.t, inNetNS(w.inetNS, func() (err error) { pc, err = net.ListenPacket("udp4", upstreamIP+":53"); return err }))
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(rw dns.ResponseWriter, req *dns.Msg) {
		w.upstream.Add(1)
		r := new(dns.Msg)
		r.SetReply(req)
		q := req.Question[0]
		ip := otherIP
		switch strings.ToLower(q.Name) {
		case "api.example.test.":
			ip = apiIP
		case "evil.example.test.":
			ip = evilIP
		}
		if q.Qtype == dns.TypeA {
			r.Answer = append(r.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 30}, A: net.ParseIP(ip)})
		}
		rw.WriteMsg(r)
	})}
	go srv.ActivateAndServe()
	w.t.Cleanup(func() { srv.Shutdown() })
}

// In a sandbox: the probes the tests use. Each opens its socket inside the
// sandbox's namespace.

const denyWait = 400 * time.Millisecond

// tcp connects to addr and round-trips a line.
func tcpFrom(n Network, addr string) error {
	return inNetNS(n.NetNSPath, func() error {
		c, err := net.DialTimeout("tcp4", addr, denyWait)
		if err != nil {
			return err
		}
		defer c.Close()
		return roundTrip(c)
	})
}

func roundTrip(c net.Conn) error {
	c.SetDeadline(time.Now().Add(denyWait))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	l, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if l != "ping\n" {
		return fmt.Errorf("echo returned %q", l)
	}
	return nil
}

func udpFrom(n Network, addr string) error {
	return inNetNS(n.NetNSPath, func() error {
		c, err := net.Dial("udp4", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(denyWait))
		if _, err := c.Write([]byte("hello")); err != nil {
			return err
		}
		b := make([]byte, 16)
		k, err := c.Read(b)
		if err != nil {
			return err
		}
		if string(b[:k]) != "hello" {
			return fmt.Errorf("udp echo returned %q", b[:k])
		}
		return nil
	})
}

func pingFrom(n Network, addr string) error {
	return inNetNS(n.NetNSPath, func() error {
		c, err := icmp.ListenPacket("ip4:icmp", "0.0.0.0")
		if err != nil {
			return err
		}
		defer c.Close()
		msg := icmp.Message{Type: ipv4.ICMPTypeEcho, Body: &icmp.Echo{ID: 7, Seq: 1, Data: []byte("x")}}
		b, _ := msg.Marshal(nil)
		if _, err := c.WriteTo(b, &net.IPAddr{IP: net.ParseIP(addr)}); err != nil {
			return err
		}
		c.SetDeadline(time.Now().Add(denyWait))
		buf := make([]byte, 1500)
		for {
			k, from, err := c.ReadFrom(buf)
			if err != nil {
				return err
			}
			m, err := icmp.ParseMessage(1, buf[:k])
			if err == nil && m.Type == ipv4.ICMPTypeEchoReply && from.String() == addr {
				return nil
			}
		}
	})
}

// resolve asks server (ip:53) for name's A record from inside the sandbox.
func resolveFrom(n Network, server, name string) (int, []string, error) {
	var rcode int
	var ips []string
	err := inNetNS(n.NetNSPath, func() error {
		c, err := net.Dial("udp4", server)
		if err != nil {
			return err
		}
		defer c.Close()
		m := new(dns.Msg)
		m.SetQuestion(dns.Fqdn(name), dns.TypeA)
		cl := &dns.Client{Timeout: 5 * time.Second}
		r, _, err := cl.ExchangeWithConn(m, &dns.Conn{Conn: c})
		if err != nil {
			return err
		}
		rcode = r.Rcode
		for _, rr := range r.Answer {
			if a, ok := rr.(*dns.A); ok {
				ips = append(ips, a.A.String())
			}
		}
		return nil
	})
	return rcode, ips, err
}

// eventually polls cond until it returns nil or d passes.
func eventually(t testing.TB, d time.Duration, what string, cond func() error) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		err := cond()
		if err == nil {
			return time.Since(start)
		}
		if time.Since(start) > d {
			t.Fatalf("%s: still failing after %v: %v", what, d, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func denied(t testing.TB, what string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: allowed, want denied", what)
	}
}

// allowed retries probe for a while: a loaded CI machine can stall one
// probe past its short timeout, which must not read as a denial.
func allowed(t testing.TB, what string, probe func() error) {
	t.Helper()
	var err error
	for range 5 {
		if err = probe(); err == nil {
			return
		}
	}
	t.Errorf("%s: denied, want allowed: %v", what, err)
}

// counts are the objects the package leaves in the node namespace and on
// disk.
type counts struct {
	veths, chains, sets, baseRules, mapElems, netns, allocs, states int
}

func (w *world) count() counts {
	w.t.Helper()
	var c counts
	must(w.t, inNetNS(w.nodeNS, func() error {
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, l := range links {
			if l.Type() == "veth" && strings.HasPrefix(l.Attrs().Name, vethPrefix) {
				c.veths++
			}
		}
		return nil
	}))
	ns, err := netns.GetFromPath(w.nodeNS)
	must(w.t, err)
	defer ns.Close()
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	must(w.t, err)
	nodeTable := func(name string) bool { return name == tableName || isShardOf(tableName, name) }
	chains, err := conn.ListChainsOfTableFamily(nftables.TableFamilyINet)
	must(w.t, err)
	for _, ch := range chains {
		if !nodeTable(ch.Table.Name) {
			continue
		}
		if strings.HasPrefix(ch.Name, chainPrefix) {
			c.chains++
		}
		// The node table's base rules (shards' are one vmap rule each).
		if ch.Hooknum != nil && ch.Table.Name == tableName {
			rules, err := conn.GetRules(ch.Table, ch)
			must(w.t, err)
			c.baseRules += len(rules)
		}
	}
	tables, err := conn.ListTablesOfFamily(nftables.TableFamilyINet)
	must(w.t, err)
	for _, table := range tables {
		if !nodeTable(table.Name) {
			continue
		}
		sets, err := conn.GetSets(table)
		must(w.t, err)
		for _, s := range sets {
			if strings.HasPrefix(s.Name, chainPrefix) {
				c.sets++
			}
			// Dispatch entries: verdict maps and the node's veth set.
			if s.IsMap || s.Name == ifSetName {
				el, err := conn.GetSetElements(s)
				must(w.t, err)
				c.mapElems += len(el)
			}
		}
	}
	dirCount := func(d string) int {
		e, err := os.ReadDir(d)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			w.t.Fatal(err)
		}
		n := 0
		for _, x := range e {
			if !strings.HasSuffix(x.Name(), ".tmp") {
				n++
			}
		}
		return n
	}
	c.netns = dirCount(w.cfg.NetNSDir)
	c.allocs = dirCount(filepath.Join(w.cfg.StateDir, "addrs"))
	c.states = dirCount(filepath.Join(w.cfg.StateDir, "sandboxes"))
	return c
}

// id returns a fresh sandbox ID for the test.
func id(t testing.TB, name string) string {
	s := strings.ToLower(strings.NewReplacer("/", "", "_", "").Replace(t.Name()))
	if len(s) > 20 {
		s = s[len(s)-20:]
	}
	return s + name
}
