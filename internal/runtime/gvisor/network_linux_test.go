package gvisor

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// The test's own internet, behind a node namespace the test made: nothing
// leaves namespaces the test created.
const (
	allowedIP = "198.18.1.10"
	deniedIP  = "198.18.1.11"
)

// TestNetworkPolicy: a gvisor sandbox on the node's real network policy
// (netpolicy, tap attachment, default deny) reaches an allowed server and
// not a denied one, and the node reaches a server in the sandbox through
// the sandbox's host address, as the node's port proxy does.
func TestNetworkPolicy(t *testing.T) {
	rt, tmpl := newFactory(t)(t)
	ctx := t.Context()
	dir := t.TempDir()
	nodeNS, inetNS := filepath.Join(dir, "node"), filepath.Join(dir, "inet")
	makeNS(t, nodeNS)
	makeNS(t, inetNS)
	link(t, nodeNS, inetNS)
	for _, ip := range []string{allowedIP, deniedIP} {
		serveHTTP(t, inetNS, ip+":80", "hello from "+ip)
	}
	m, err := netpolicy.New(ctx, netpolicy.Config{
		NetNSDir: filepath.Join(dir, "netns"), StateDir: filepath.Join(dir, "state"),
		Upstream: []string{"198.18.1.53:53"}, NodeNetNS: nodeNS,
	}, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })

	if got := runtime.NetworkModeOf(rt); got != runtime.NetworkTap {
		t.Fatalf("gvisor asks the node for a %q attachment, want tap", got)
	}
	spec := tmpl
	spec.ID = runtimetest.NewID("gvnet")
	spec.StateDir = filepath.Join(t.TempDir(), "sb")
	nw, err := m.SetupWith(ctx, spec.ID, netpolicy.Rules{Allow: []netpolicy.Rule{{CIDR: allowedIP, Protocol: "tcp", Ports: "80"}}},
		netpolicy.SetupOptions{Mode: netpolicy.ModeTap})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Teardown(context.Background(), spec.ID) })
	spec.Network = runtime.NetworkAttachment{Mode: runtime.NetworkTap, NetNS: nw.NetNSPath, Device: nw.GuestIf,
		GuestAddr: nw.GuestAddr, Gateway: nw.GuestGateway, MAC: nw.GuestMAC}
	sb, _ := runtimetest.StartSandbox(t, rt, spec)

	// busybox's static wget crashes under gVisor; nc does the GET.
	get := func(ip, timeout string) (runtimetest.Result, error) {
		return runtimetest.Run(ctx, rt, sb.ID, "", "/bin/sh", "-c", `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w `+timeout+` `+ip+` 80`)
	}
	res, err := get(allowedIP, "10")
	if err != nil || res.ExitCode != 0 || !strings.Contains(res.Stdout, "hello from "+allowedIP) {
		t.Fatalf("GET of the allowed server: %v %+v", err, res)
	}
	// Dropped by the node: the connection times out.
	res, err = get(deniedIP, "2")
	if err != nil || res.ExitCode == 0 || strings.Contains(res.Stdout, "hello") {
		t.Fatalf("GET of the denied server: %v %+v; want a failure", err, res)
	}
	// The guest sees the fixed guest address.
	res, err = runtimetest.Run(ctx, rt, sb.ID, "", "ip", "-4", "addr", "show", "eth0")
	if err != nil || !strings.Contains(res.Stdout, nw.GuestAddr.String()) {
		t.Fatalf("guest eth0: %v %+v; want %s", err, res, nw.GuestAddr)
	}

	// Inbound: the node dials the sandbox's host address.
	if res, err := runtimetest.Run(ctx, rt, sb.ID, "", "/bin/sh", "-c",
		`mkdir -p /tmp/www && echo inside > /tmp/www/index.html && httpd -p 8080 -h /tmp/www`); err != nil || res.ExitCode != 0 {
		t.Fatalf("start httpd: %v %+v", err, res)
	}
	var body string
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if body, err = getIn(nodeNS, netpolicy.ProxyMark, net.JoinHostPort(nw.HostAddr.String(), "8080"), "/index.html"); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.HasPrefix(body, "HTTP/1.1 200") || !strings.HasSuffix(body, "\r\n\r\ninside\n") {
		t.Fatalf("GET of the sandbox's server from the node's port proxy: %q %v", body, err)
	}
	// Anything else from the node is dropped.
	if body, err := getIn(nodeNS, 0, net.JoinHostPort(nw.HostAddr.String(), "8080"), "/index.html"); err == nil {
		t.Fatalf("GET of the sandbox's server from the node without the proxy's mark: %q; want it dropped", body)
	}
}

// getIn does an HTTP/1.0 GET of path at addr over a connection made on a
// thread in namespace ns (so nothing is dialled from the host's) with
// socket mark mark, and returns the whole response.
func getIn(ns string, mark int, addr, path string) (string, error) {
	var c net.Conn
	d := net.Dialer{Timeout: 2 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, mark) }); err != nil {
			return err
		}
		return serr
	}}
	if err := inNS(ns, func() (err error) { c, err = d.Dial("tcp4", addr); return err }); err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.0\r\n\r\n", path); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

func makeNS(t *testing.T, path string) {
	t.Helper()
	if err := createNetNS(path); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = removeNetNS(path) })
}

// link connects node and inet with a veth: 198.18.0.1/24 on the node's
// end, 198.18.0.2/24 on inet's, the test's servers' addresses on inet's lo
// and a route to them on the node.
func link(t *testing.T, node, inet string) {
	t.Helper()
	in, err := netns.GetFromPath(inet)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(inNS(node, func() error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "uplink"}, PeerName: "peer", PeerNamespace: netlink.NsFd(int(in))}); err != nil {
			return err
		}
		l, err := netlink.LinkByName("uplink")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, mustAddr("198.18.0.1/24")); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		_, dst, _ := net.ParseCIDR("198.18.1.0/24")
		return netlink.RouteAdd(&netlink.Route{Dst: dst, Gw: net.ParseIP("198.18.0.2")})
	}))
	must(inNS(inet, func() error {
		l, err := netlink.LinkByName("peer")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, mustAddr("198.18.0.2/24")); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		for _, a := range []string{allowedIP, deniedIP} {
			if err := netlink.AddrAdd(lo, mustAddr(a+"/32")); err != nil {
				return err
			}
		}
		// Replies go back to the node (and the sandboxes' pool behind it).
		return netlink.RouteAdd(&netlink.Route{Dst: &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}, Gw: net.ParseIP("198.18.0.1")})
	}))
	h, err := netlink.NewHandleAt(mustNS(t, node))
	must(err)
	defer h.Close()
	must(netpolicy.WaitOperUp(t.Context(), h, "uplink"))
}

func mustNS(t *testing.T, path string) netns.NsHandle {
	h, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

func mustAddr(s string) *netlink.Addr {
	a, err := netlink.ParseAddr(s)
	if err != nil {
		panic(err)
	}
	return a
}

// serveHTTP serves body at addr in namespace ns until the test ends.
func serveHTTP(t *testing.T, ns, addr, body string) {
	var ln net.Listener
	if err := inNS(ns, func() (err error) { ln, err = net.Listen("tcp4", addr); return err }); err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, body) }), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
}

func inNS(path string, fn func() error) error { return netpolicy.InNetNS(path, fn) }
