//go:build linux

package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	goruntime "runtime"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/bench/internal/benchns"
	"github.com/kernflux/opendsec/internal/netpolicy"
)

// The benchmark's own addresses, inside its namespaces only.
const (
	nodeUplink = "198.18.0.1" // node side of node <-> inet
	inetAddr   = "198.18.0.2" // the server, inet side
	directCli  = "198.19.0.1" // direct <-> inet
	directSrv  = "198.19.0.2"
	routedGw   = "198.19.1.1" // node side of routed <-> node
	routedCli  = "198.19.1.2"
	rrPort     = 5001
	bulkPort   = 5002
	bulkBuf    = 128 << 10
	warmupRR   = 200
)

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "unknown"
	}
	return unix.ByteSliceToString(u.Release[:])
}

// makeNS makes a network namespace with loopback up, bind-mounted at path.
func makeNS(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("create netns file: %w", err)
	}
	f.Close()
	err = func() error {
		goruntime.LockOSThread()
		defer goruntime.UnlockOSThread()
		orig, err := netns.Get()
		if err != nil {
			return err
		}
		defer orig.Close()
		ns, err := netns.New()
		if err != nil {
			return fmt.Errorf("new netns: %w", err)
		}
		defer ns.Close()
		merr := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", int(ns)), path, "", unix.MS_BIND, "")
		if err := netns.Set(orig); err != nil {
			panic("restore network namespace: " + err.Error())
		}
		if merr != nil {
			return fmt.Errorf("bind-mount netns: %w", merr)
		}
		return nil
	}()
	if err != nil {
		os.Remove(path)
		return err
	}
	return benchns.In(path, func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.LinkSetUp(lo)
	})
}

func removeNS(path string) {
	unix.Unmount(path, unix.MNT_DETACH)
	os.Remove(path)
}

// vethBetween joins namespaces a and b with a veth (aName in a with aAddr,
// bName in b with bAddr, both with prefix length bits) and brings both ends
// up.
func vethBetween(a, aName, aAddr, b, bName, bAddr string, bits int) error {
	bns, err := netns.GetFromPath(b)
	if err != nil {
		return err
	}
	defer bns.Close()
	up := func(name, addr string) error {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP(addr), Mask: net.CIDRMask(bits, 32)}}); err != nil {
			return fmt.Errorf("add %s to %s: %w", addr, name, err)
		}
		return netlink.LinkSetUp(l)
	}
	if err := benchns.In(a, func() error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: aName}, PeerName: bName, PeerNamespace: netlink.NsFd(int(bns))}); err != nil {
			return fmt.Errorf("add veth %s: %w", aName, err)
		}
		return up(aName, aAddr)
	}); err != nil {
		return err
	}
	return benchns.In(b, func() error { return up(bName, bAddr) })
}

// dialInNS connects to addr from the namespace at path.
func dialInNS(path, addr string) (net.Conn, error) {
	var c net.Conn
	err := benchns.In(path, func() (err error) {
		c, err = net.DialTimeout("tcp4", addr, 5*time.Second)
		return err
	})
	return c, err
}

func addRoute(ns, dst, gw string) error {
	return benchns.In(ns, func() error {
		_, d, err := net.ParseCIDR(dst)
		if err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{Dst: d, Gw: net.ParseIP(gw)})
	})
}

// path is one way from a client namespace to the server.
type path struct {
	res  *pathResult
	ns   string
	addr string
}

func (p path) dial(port int) (net.Conn, error) {
	var c net.Conn
	err := benchns.In(p.ns, func() (err error) {
		c, err = net.DialTimeout("tcp4", fmt.Sprintf("%s:%d", p.addr, port), 5*time.Second)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%s: dial: %w", p.res.name, err)
	}
	return c, nil
}

// dialWait dials until the path carries a connection (veths need a moment
// to come up) or the deadline passes.
func (p path) dialWait(ctx context.Context, port int) (net.Conn, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := p.dial(port)
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return c, err
		}
		time.Sleep(20 * time.Millisecond) // polling for carrier, bounded above
	}
}

func (p path) roundTrips(ctx context.Context, n, size int) error {
	c, err := p.dialWait(ctx, rrPort)
	if err != nil {
		return err
	}
	defer c.Close()
	req, resp := make([]byte, size), make([]byte, size)
	for i := 0; i < warmupRR+n; i++ {
		if i%1000 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		t0 := time.Now()
		if _, err := c.Write(req); err != nil {
			return fmt.Errorf("%s: write: %w", p.res.name, err)
		}
		if _, err := io.ReadFull(c, resp); err != nil {
			return fmt.Errorf("%s: read: %w", p.res.name, err)
		}
		if i >= warmupRR {
			p.res.rr = append(p.res.rr, time.Since(t0))
		}
	}
	return nil
}

func (p path) connects(ctx context.Context, n, size int) error {
	req, resp := make([]byte, size), make([]byte, size)
	return benchns.In(p.ns, func() error {
		for range n {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			t0 := time.Now()
			c, err := net.DialTimeout("tcp4", fmt.Sprintf("%s:%d", p.addr, rrPort), 5*time.Second)
			if err != nil {
				return fmt.Errorf("%s: dial: %w", p.res.name, err)
			}
			_, err = c.Write(req)
			if err == nil {
				_, err = io.ReadFull(c, resp)
			}
			c.Close()
			if err != nil {
				return fmt.Errorf("%s: round trip: %w", p.res.name, err)
			}
			p.res.conn = append(p.res.conn, time.Since(t0))
		}
		return nil
	})
}

func (p path) bulk(ctx context.Context, d time.Duration) error {
	c, err := p.dialWait(ctx, bulkPort)
	if err != nil {
		return err
	}
	defer c.Close()
	buf := make([]byte, bulkBuf)
	var sent int64
	t0 := time.Now()
	end := t0.Add(d)
	for time.Now().Before(end) && ctx.Err() == nil {
		k, err := c.Write(buf)
		sent += int64(k)
		if err != nil {
			return fmt.Errorf("%s: bulk write: %w", p.res.name, err)
		}
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return err
	}
	var got [8]byte
	if _, err := io.ReadFull(c, got[:]); err != nil {
		return fmt.Errorf("%s: bulk count: %w", p.res.name, err)
	}
	el := time.Since(t0)
	if n := int64(binary.BigEndian.Uint64(got[:])); n != sent {
		return fmt.Errorf("%s: server counted %d bytes, sent %d", p.res.name, n, sent)
	}
	p.res.mbps = append(p.res.mbps, float64(sent)/el.Seconds()/1e6)
	return nil
}

// serve starts the echo (rrPort) and byte-counting sink (bulkPort) servers
// in ns; closing the returned listeners stops them.
func serve(ns string) ([]net.Listener, error) {
	var ls []net.Listener
	err := benchns.In(ns, func() error {
		for _, port := range []int{rrPort, bulkPort} {
			l, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port))
			if err != nil {
				return err
			}
			ls = append(ls, l)
		}
		return nil
	})
	if err != nil {
		for _, l := range ls {
			l.Close()
		}
		return nil, err
	}
	accept := func(l net.Listener, fn func(net.Conn)) {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); fn(c) }()
		}
	}
	go accept(ls[0], func(c net.Conn) { io.Copy(c, c) })
	go accept(ls[1], func(c net.Conn) {
		n, _ := io.Copy(io.Discard, c)
		var b [8]byte
		binary.BigEndian.PutUint64(b[:], uint64(n))
		c.Write(b[:])
	})
	return ls, nil
}

// chainRules counts the rules in a sandbox's egress and ingress chains.
func chainRules(nodeNS, id string) (int, error) {
	ns, err := netns.GetFromPath(nodeNS)
	if err != nil {
		return 0, err
	}
	defer ns.Close()
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return 0, err
	}
	table := &nftables.Table{Name: "opendsec", Family: nftables.TableFamilyINet}
	n := 0
	for _, suf := range []string{"-o", "-i"} { // netpolicy's chain names: sb-<id>-o, sb-<id>-i
		rules, err := conn.GetRules(table, &nftables.Chain{Name: "sb-" + id + suf, Table: table})
		if err != nil {
			return 0, fmt.Errorf("list rules: %w", err)
		}
		n += len(rules)
	}
	return n, nil
}

func run(ctx context.Context, c config) (_ *report, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("bench/network must run as root (network namespaces, veths, nftables)")
	}
	r := &report{cfg: c, machine: machineInfo(), started: time.Now()}
	dir, err := os.MkdirTemp("", "odbench-net-")
	if err != nil {
		return nil, err
	}
	node, inet, direct, routed := filepath.Join(dir, "node"), filepath.Join(dir, "inet"), filepath.Join(dir, "direct"), filepath.Join(dir, "routed")
	var m *netpolicy.Manager
	var listeners []net.Listener
	var made []string // sandbox IDs to tear down
	defer func() {
		cctx := context.WithoutCancel(ctx)
		for _, l := range listeners {
			l.Close()
		}
		if m != nil {
			for _, id := range made {
				if terr := m.Teardown(cctx, id); terr != nil {
					err = errors.Join(err, terr)
				}
			}
			m.Close()
		}
		// Removing the namespaces removes the veths, routes and the
		// nftables table inside them.
		for _, ns := range []string{node, inet, direct, routed} {
			removeNS(ns)
		}
		os.RemoveAll(dir)
	}()
	for _, ns := range []string{node, inet, direct, routed} {
		if err := makeNS(ns); err != nil {
			return nil, err
		}
	}
	if err := vethBetween(node, "uplink", nodeUplink, inet, "peer", inetAddr, 24); err != nil {
		return nil, err
	}
	if err := vethBetween(direct, "d0", directCli, inet, "d1", directSrv, 30); err != nil {
		return nil, err
	}
	if err := vethBetween(routed, "r0", routedCli, node, "r1", routedGw, 30); err != nil {
		return nil, err
	}
	if err := addRoute(routed, "0.0.0.0/0", routedGw); err != nil {
		return nil, err
	}
	if err := addRoute(inet, routedCli+"/32", nodeUplink); err != nil {
		return nil, err
	}
	m, err = netpolicy.New(ctx, netpolicy.Config{NetNSDir: filepath.Join(dir, "netns"), StateDir: filepath.Join(dir, "state"), NodeNetNS: node}, "")
	if err != nil {
		return nil, fmt.Errorf("start netpolicy: %w", err)
	}
	const flowID = "benchflow0"
	sb, err := m.Setup(ctx, flowID, netpolicy.Rules{Allow: []netpolicy.Rule{{CIDR: inetAddr + "/32", Protocol: "tcp", Ports: fmt.Sprintf("%d-%d", rrPort, bulkPort)}}})
	if err != nil {
		return nil, fmt.Errorf("set up the sandbox network: %w", err)
	}
	made = append(made, flowID)
	if r.nftRules, err = chainRules(node, flowID); err != nil {
		return nil, err
	}
	if listeners, err = serve(inet); err != nil {
		return nil, err
	}

	fmt.Fprintf(os.Stderr, "== setup x%d\n", c.setups)
	ids := make([]string, c.setups)
	for i := range ids {
		ids[i] = fmt.Sprintf("benchnet%05d", i)
	}
	for _, id := range ids {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		t0 := time.Now()
		_, err := m.Setup(ctx, id, netpolicy.Rules{Allow: []netpolicy.Rule{{CIDR: inetAddr + "/32", Protocol: "tcp", Ports: "443"}}})
		if err != nil {
			return nil, fmt.Errorf("set up %s: %w", id, err)
		}
		r.setup = append(r.setup, time.Since(t0))
		made = append(made, id)
	}
	// SetRules cuts flows the new rules forbid by walking the node's
	// conntrack table: time it with the table nearly empty and again after
	// the TCP phase has filled it.
	setRules := func(ports string) (series, int, error) {
		n, err := conntrackEntries(node)
		if err != nil {
			return nil, 0, err
		}
		var s series
		for _, id := range ids {
			t0 := time.Now()
			if err := m.SetRules(ctx, id, netpolicy.Rules{Allow: []netpolicy.Rule{{CIDR: inetAddr + "/32", Protocol: "tcp", Ports: ports}}}); err != nil {
				return nil, 0, fmt.Errorf("set rules of %s: %w", id, err)
			}
			s = append(s, time.Since(t0))
		}
		return s, n, nil
	}
	if r.change, r.ctBefore, err = setRules("80"); err != nil {
		return nil, err
	}

	paths := []path{
		{res: &pathResult{name: "direct veth", what: "client netns ↔ veth ↔ server netns; no node, no nftables"}, ns: direct, addr: directSrv},
		{res: &pathResult{name: "routed, unpoliced", what: "client netns ↔ veth ↔ node netns (routing, forwarding; the opendsec table's base chains miss) ↔ veth ↔ server"}, ns: routed, addr: inetAddr},
		{res: &pathResult{name: "sandbox, policed", what: "netpolicy sandbox: guest address, SNAT to its host address in its netns ↔ veth ↔ node (sandbox chains: anti-spoof, allow rule, protected destinations; masquerade) ↔ veth ↔ server"}, ns: sb.NetNSPath, addr: inetAddr},
	}
	for _, p := range paths {
		r.paths = append(r.paths, p.res)
	}
	for round := range c.rounds {
		fmt.Fprintf(os.Stderr, "== round %d/%d\n", round+1, c.rounds)
		for i := range paths {
			p := paths[(i+round)%len(paths)]
			if err := p.roundTrips(ctx, c.rr, c.msg); err != nil {
				return nil, err
			}
			if err := p.connects(ctx, c.conns, c.msg); err != nil {
				return nil, err
			}
			if err := p.bulk(ctx, c.bulk); err != nil {
				return nil, err
			}
		}
	}

	fmt.Fprintf(os.Stderr, "== set rules and tear down x%d\n", c.setups)
	if r.changeFull, r.ctAfter, err = setRules("8080"); err != nil {
		return nil, err
	}
	for _, id := range ids {
		t0 := time.Now()
		if err := m.Teardown(ctx, id); err != nil {
			return nil, fmt.Errorf("tear down %s: %w", id, err)
		}
		r.down = append(r.down, time.Since(t0))
		made = slicesDelete(made, id)
	}
	r.elapsed = time.Since(r.started)
	return r, nil
}

// conntrackEntries counts the IPv4 conntrack entries in the namespace at path.
func conntrackEntries(path string) (int, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return 0, err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return 0, err
	}
	defer h.Close()
	flows, err := h.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		return 0, fmt.Errorf("list conntrack: %w", err)
	}
	return len(flows), nil
}

func slicesDelete(s []string, v string) []string {
	for i, x := range s {
		if x == v {
			return append(s[:i], s[i+1:]...)
		}
	}
	return s
}
