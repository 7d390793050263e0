package netpolicy

import (
	"bufio"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// guestView is what a sandbox sees of its network from inside.
type guestView struct {
	addrs  []string // every IPv4 address on every interface but lo, "if addr/bits"
	mac    string   // of the guest interface
	routes []string // IPv4 routes of the main table, "dst via gw dev"
}

func viewFrom(t *testing.T, n Network, guestIf string) guestView {
	t.Helper()
	var v guestView
	must(t, inNetNS(n.NetNSPath, func() error {
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		names := map[int]string{}
		for _, l := range links {
			names[l.Attrs().Index] = l.Attrs().Name
			if l.Attrs().Name == guestIf {
				v.mac = l.Attrs().HardwareAddr.String()
			}
			if l.Attrs().Name == "lo" {
				continue
			}
			as, err := netlink.AddrList(l, netlink.FAMILY_V4)
			if err != nil {
				return err
			}
			for _, a := range as {
				v.addrs = append(v.addrs, l.Attrs().Name+" "+a.IPNet.String())
			}
		}
		rs, err := netlink.RouteList(nil, netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		for _, r := range rs {
			dst := "default"
			if r.Dst != nil && !(r.Dst.IP.IsUnspecified() && r.Dst.Mask.String() == "00000000") {
				dst = r.Dst.String()
			}
			v.routes = append(v.routes, fmt.Sprintf("%s via %v dev %s", dst, r.Gw, names[r.LinkIndex]))
		}
		slices.Sort(v.routes)
		return nil
	}))
	return v
}

// bannerServer answers every connection on addr inside ns with banner and
// closes it.
func (w *world) bannerServer(ns, addr, banner string) {
	var ln net.Listener
	must(w.t, inNetNS(ns, func() (err error) { ln, err = net.Listen("tcp4", addr); return err }))
	w.t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte(banner + "\n"))
			c.Close()
		}
	}()
}

// bannerFrom reads the first line a server at addr sends, dialling from
// the namespace at path with an optional socket mark.
func bannerFrom(path, addr string, mark int) (string, error) {
	var line string
	err := inNetNS(path, func() error {
		d := net.Dialer{Timeout: denyWait}
		if mark != 0 {
			d.Control = func(_, _ string, rc syscall.RawConn) error {
				var serr error
				if err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, mark) }); err != nil {
					return err
				}
				return serr
			}
		}
		c, err := d.Dial("tcp4", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(denyWait))
		line, err = bufio.NewReader(c).ReadString('\n')
		return err
	})
	return strings.TrimSpace(line), err
}

// nodeFlowSources returns the original source addresses of the node's
// conntrack entries towards dst:port.
func (w *world) flowSources(ns string, dst string, port uint16) []string {
	w.t.Helper()
	var out []string
	must(w.t, inNetNS(ns, func() error {
		flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
		if err != nil {
			return err
		}
		for _, f := range flows {
			if f.Forward.DstIP.String() == dst && f.Forward.DstPort == port && !slices.Contains(out, f.Forward.SrcIP.String()) {
				out = append(out, f.Forward.SrcIP.String())
			}
		}
		return nil
	}))
	slices.Sort(out)
	return out
}

// Two sandboxes see the same network from inside — address, gateway,
// resolver, MAC, routes — and nothing of the pool, yet each is policed by
// its own rules, reaches the internet from its own host address, gets its
// own DNS answers, and is reached by the node's port proxy at its own host
// address.
func TestSameGuestAddress(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	a, err := w.m.Setup(ctx, id(t, "a"), Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "tcp", Ports: "80"}, {Domain: "api.example.test", Protocol: "tcp", Ports: "443"}}})
	must(t, err)
	b, err := w.m.Setup(ctx, id(t, "b"), Rules{Allow: []Rule{{CIDR: evilIP, Protocol: "tcp", Ports: "443"}, {Domain: "other.example.test", Protocol: "tcp", Ports: "443"}}})
	must(t, err)

	// The attachment is the same but for the host side.
	if a.Mode != ModeVeth || a.GuestIf != "eth0" || a.GuestAddr.String() != "169.254.0.21/30" || a.GuestGateway.String() != "169.254.0.22" ||
		a.GuestMAC.String() != "02:0d:5e:00:00:21" || !slices.Equal(a.Nameservers, []netip.Addr{a.GuestGateway}) || a.DNS != a.GuestGateway {
		t.Errorf("attachment of a: %+v", a)
	}
	if b.GuestAddr != a.GuestAddr || b.GuestGateway != a.GuestGateway || b.GuestMAC.String() != a.GuestMAC.String() || b.DNS != a.DNS {
		t.Errorf("attachments differ inside: a %+v, b %+v", a, b)
	}
	if a.HostAddr == b.HostAddr || !w.m.pool.Contains(a.HostAddr) || !w.m.pool.Contains(b.HostAddr) {
		t.Errorf("host addresses: a %v, b %v, want distinct ones in %v", a.HostAddr, b.HostAddr, w.m.pool)
	}
	if p := w.m.Planned(a.ID); p.NetNSPath != a.NetNSPath || p.DNS != a.DNS || p.GuestAddr != a.GuestAddr || p.GuestMAC.String() != a.GuestMAC.String() {
		t.Errorf("Planned %+v does not match Setup %+v", p, a)
	}
	va, vb := viewFrom(t, a, "eth0"), viewFrom(t, b, "eth0")
	want := guestView{
		addrs:  []string{"eth0 169.254.0.21/30"},
		mac:    "02:0d:5e:00:00:21",
		routes: []string{"169.254.0.20/30 via <nil> dev eth0", "default via 169.254.0.22 dev eth0"},
	}
	for _, v := range []guestView{va, vb} {
		if !slices.Equal(v.addrs, want.addrs) || v.mac != want.mac || !slices.Equal(v.routes, want.routes) {
			t.Errorf("view from inside: %+v, want %+v", v, want)
		}
	}

	// Each reaches what its own rules allow and nothing of the other's.
	allowed(t, "a → api:80 (a's cidr rule)", func() error { return tcpFrom(a, apiIP+":80") })
	denied(t, "b → api:80 (a's rule only)", tcpFrom(b, apiIP+":80"))
	allowed(t, "b → evil:443 (b's cidr rule)", func() error { return tcpFrom(b, evilIP+":443") })
	denied(t, "a → evil:443 (b's rule only)", tcpFrom(a, evilIP+":443"))
	// Both sockets have the guest address; the node saw each flow come from
	// that sandbox's host address; the test host saw the node's uplink.
	for _, c := range []struct {
		n    Network
		addr string
	}{{a, apiIP + ":80"}, {b, evilIP + ":443"}} {
		must(t, inNetNS(c.n.NetNSPath, func() error {
			conn, err := net.DialTimeout("tcp4", c.addr, time.Second)
			if err != nil {
				return err
			}
			defer conn.Close()
			if got := conn.LocalAddr().(*net.TCPAddr).IP.String(); got != "169.254.0.21" {
				t.Errorf("local address of a guest socket: %s, want 169.254.0.21", got)
			}
			return roundTrip(conn)
		}))
	}
	if got := w.flowSources(w.nodeNS, apiIP, 80); !slices.Equal(got, []string{a.HostAddr.String()}) {
		t.Errorf("node saw flows to api:80 from %v, want only a's host address %v", got, a.HostAddr)
	}
	if got := w.flowSources(w.nodeNS, evilIP, 443); !slices.Equal(got, []string{b.HostAddr.String()}) {
		t.Errorf("node saw flows to evil:443 from %v, want only b's host address %v", got, b.HostAddr)
	}
	if got := w.flowSources(a.NetNSPath, apiIP, 80); !slices.Equal(got, []string{"169.254.0.21"}) {
		t.Errorf("a's namespace saw flows from %v, want the guest address", got)
	}

	// DNS: the same resolver address answers each by its own rules, and
	// what it admits opens only that sandbox.
	resolve := func(n Network, name string) (int, []string) {
		t.Helper()
		rcode, ips, err := resolveFrom(n, n.DNS.String()+":53", name)
		must(t, err)
		return rcode, ips
	}
	if rc, ips := resolve(a, "api.example.test"); rc != dns.RcodeSuccess || !slices.Equal(ips, []string{apiIP}) {
		t.Errorf("a resolves api: %s %v", dns.RcodeToString[rc], ips)
	}
	if rc, _ := resolve(b, "api.example.test"); rc != dns.RcodeNameError {
		t.Errorf("b resolves api: %s, want NXDOMAIN (a's rule only)", dns.RcodeToString[rc])
	}
	if rc, ips := resolve(b, "other.example.test"); rc != dns.RcodeSuccess || !slices.Equal(ips, []string{otherIP}) {
		t.Errorf("b resolves other: %s %v", dns.RcodeToString[rc], ips)
	}
	if rc, _ := resolve(a, "other.example.test"); rc != dns.RcodeNameError {
		t.Errorf("a resolves other: %s, want NXDOMAIN (b's rule only)", dns.RcodeToString[rc])
	}
	allowed(t, "a → api:443 after resolving", func() error { return tcpFrom(a, apiIP+":443") })
	denied(t, "b → api:443 (a resolved it, not b)", tcpFrom(b, apiIP+":443"))
	allowed(t, "b → other:443 after resolving", func() error { return tcpFrom(b, otherIP+":443") })
	denied(t, "a → other:443 (b resolved it, not a)", tcpFrom(a, otherIP+":443"))

	// Inbound: the node's port proxy reaches each guest at its host
	// address (translated to the guest address inside); nothing else does,
	// and loopback inside (the agent's path) is the sandbox's own.
	w.bannerServer(a.NetNSPath, "169.254.0.21:8080", "a")
	w.bannerServer(a.NetNSPath, "127.0.0.1:8081", "a-lo")
	w.bannerServer(b.NetNSPath, "0.0.0.0:8080", "b")
	for _, c := range []struct {
		n    Network
		want string
	}{{a, "a"}, {b, "b"}} {
		got, err := bannerFrom(w.nodeNS, c.n.HostAddr.String()+":8080", ProxyMark)
		if err != nil || got != c.want {
			t.Errorf("port proxy → %s host address: %q %v, want %q", c.want, got, err, c.want)
		}
		if got, err := bannerFrom(w.nodeNS, c.n.HostAddr.String()+":8080", 0); err == nil {
			t.Errorf("node without the proxy mark reached %s: %q", c.want, got)
		}
	}
	if got, err := bannerFrom(a.NetNSPath, "127.0.0.1:8081", 0); err != nil || got != "a-lo" {
		t.Errorf("loopback inside a: %q %v", got, err)
	}
	if got, err := bannerFrom(a.NetNSPath, "169.254.0.21:8080", 0); err != nil || got != "a" {
		t.Errorf("own guest address inside a: %q %v", got, err)
	}
	if _, err := bannerFrom(b.NetNSPath, a.HostAddr.String()+":8080", 0); err == nil {
		t.Error("b reached a at a's host address")
	}

	// After a node restart both keep their layout and policy.
	w.m.Close()
	w.m = w.newManager()
	_, err = w.m.Recover(ctx, func(string) bool { return true })
	must(t, err)
	if g, err := w.m.Get(a.ID); err != nil || g.HostAddr != a.HostAddr || g.GuestAddr != a.GuestAddr || g.Mode != ModeVeth {
		t.Errorf("Get after restart: %+v %v, want %+v", g, err, a)
	}
	allowed(t, "a → api:80 after restart", func() error { return tcpFrom(a, apiIP+":80") })
	denied(t, "b → api:80 after restart", tcpFrom(b, apiIP+":80"))
	if rc, _ := resolve(b, "other.example.test"); rc != dns.RcodeSuccess {
		t.Errorf("b resolves other after restart: %s", dns.RcodeToString[rc])
	}
}

func TestSetupModeInvalid(t *testing.T) {
	w := newWorld(t)
	before := w.count()
	_, err := w.m.SetupWith(t.Context(), id(t, "a"), Rules{}, SetupOptions{Mode: "bridge"})
	if err == nil || !strings.HasPrefix(err.Error(), "network.mode:") {
		t.Fatalf("SetupWith mode bridge: %v, want network.mode invalid", err)
	}
	if after := w.count(); after != before {
		t.Errorf("bad mode changed objects: before %+v after %+v", before, after)
	}
}
