//go:build linux

package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/netpolicy"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/test/harness"
)

func (s *system) ports() opendsecv1connect.PortServiceClient {
	return opendsecv1connect.NewPortServiceClient(s.HTTPClient(), s.Endpoint(), s.Opts(s.Token())...)
}

func (s *system) client(t *testing.T) *opendsec.Client {
	t.Helper()
	c, err := opendsec.New(s.Endpoint(), opendsec.WithToken(s.Token()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// background runs a shell line in the sandbox until the test ends.
func (s *system) background(t *testing.T, id, line string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.exec(ctx, id, "/bin/sh", "-c", line)
	}()
	t.Cleanup(func() { cancel(); <-done })
}

var inetAddrRe = regexp.MustCompile(`inet (\d+\.\d+\.\d+\.\d+)/`)

// sandboxIP returns the sandbox's address on eth0.
func (s *system) sandboxIP(t *testing.T, id string) string {
	t.Helper()
	r := s.shell(t, id, "ip -4 -o addr show dev eth0")
	m := inetAddrRe.FindStringSubmatch(r.stdout)
	if m == nil {
		t.Fatalf("no IPv4 address on eth0 of %s: %q %q", id, r.stdout, r.stderr)
	}
	return m[1]
}

// hostIP returns the sandbox's host address: the odd end of the /31 on its
// node-side veth, which the sandbox's namespace translates to its guest
// address.
func (s *system) hostIP(t *testing.T, id string) string {
	t.Helper()
	var ip string
	harness.InNS(t, s.NodeNS(), func() error {
		l, err := netlink.LinkByName(netpolicy.HostIfName(id[:4], id))
		if err != nil {
			return err
		}
		as, err := netlink.AddrList(l, netlink.FAMILY_V4)
		if err != nil || len(as) != 1 {
			return fmt.Errorf("addresses of %s: %v %v", l.Attrs().Name, as, err)
		}
		gw := as[0].IPNet.IP.To4()
		ip = net.IPv4(gw[0], gw[1], gw[2], gw[3]+1).String()
		return nil
	})
	return ip
}

// dialFrom connects to addr from the namespace at path, optionally with a
// socket mark, and returns the first line the server sends after a GET.
func dialFrom(t *testing.T, path, addr string, mark int) (string, error) {
	t.Helper()
	var body string
	var derr error
	harness.InNS(t, path, func() error {
		d := net.Dialer{Timeout: time.Second}
		if mark != 0 {
			d.Control = func(_, _ string, rc syscall.RawConn) error {
				var serr error
				if err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, mark) }); err != nil {
					return err
				}
				return serr
			}
		}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			derr = err
			return nil
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprint(c, "GET /index.html HTTP/1.0\r\n\r\n")
		b, err := io.ReadAll(c)
		body, derr = string(b), err
		return nil
	})
	return body, derr
}

// TestInbound: a server in a sandbox on 0.0.0.0:8000 is reachable through
// the API (HTTPRequest, ConnectPort) and from nowhere else: not from the
// node's namespace by the sandbox's address, not from another sandbox that
// may connect anywhere, not from the test's internet.
func TestInbound(t *testing.T) {
	s := newSystem(t)
	inet := harness.MakeInternet(t, s.NodeNS())
	l := harness.ListenIn(t, inet, harness.InetIP+":8080")
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "hello "+harness.InetIP+":8080") }))
	s.Start()

	srv := s.create(t, nil)
	open := s.create(t, &opendsecv1.SandboxSpec{Network: &opendsecv1.NetworkPolicy{
		Allow: []*opendsecv1.NetworkRule{{Cidr: "0.0.0.0/0"}},
	}})
	s.shell(t, srv.GetId(), "mkdir -p /tmp/www && echo hello-inbound > /tmp/www/index.html")
	s.background(t, srv.GetId(), "exec httpd -f -p 0.0.0.0:8000 -h /tmp/www")

	// Through the API: HTTPRequest...
	var resp *connect.Response[opendsecv1.HTTPRequestResponse]
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err error
		resp, err = s.ports().HTTPRequest(t.Context(), connect.NewRequest(&opendsecv1.HTTPRequestRequest{SandboxId: srv.GetId(), Port: 8000, Path: "/index.html"}))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("HTTPRequest to the server in the sandbox: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // polling for the server to listen
	}
	if resp.Msg.GetStatus() != 200 || string(resp.Msg.GetBody()) != "hello-inbound\n" {
		t.Fatalf("HTTPRequest: %d %q", resp.Msg.GetStatus(), resp.Msg.GetBody())
	}
	// ...and ConnectPort, with a half-close.
	c := s.client(t)
	pc, err := c.ConnectPort(t.Context(), srv.GetId(), 8000)
	if err != nil {
		t.Fatalf("ConnectPort: %v", err)
	}
	fmt.Fprint(pc, "GET /index.html HTTP/1.0\r\n\r\n")
	if err := pc.CloseWrite(); err != nil {
		t.Fatalf("close write: %v", err)
	}
	raw, err := io.ReadAll(pc)
	pc.Close()
	if err != nil || !bytes.HasPrefix(raw, []byte("HTTP/1.")) || !bytes.HasSuffix(raw, []byte("\r\n\r\nhello-inbound\n")) {
		t.Fatalf("ConnectPort: %q, %v", raw, err)
	}
	_, err = c.ConnectPort(t.Context(), srv.GetId(), 8001)
	if !opendsec.IsUnavailable(err) || !strings.Contains(err.Error(), "connection refused in sandbox") {
		t.Errorf("ConnectPort to a closed port: %v, want unavailable: connection refused in sandbox", err)
	}
	_, err = c.ConnectPort(t.Context(), srv.GetId(), 0)
	if !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "port") {
		t.Errorf("ConnectPort to port 0: %v", err)
	}
	st := s.ports().ConnectPort(t.Context())
	st.Send(&opendsecv1.ConnectPortRequest{Msg: &opendsecv1.ConnectPortRequest_Start{Start: &opendsecv1.ConnectPortStart{SandboxId: srv.GetId(), Port: 70000}}})
	_, err = st.Receive()
	wantErr(t, "ConnectPort to port 70000", err, connect.CodeInvalidArgument, "port: 70000 must be between 1 and 65535")
	st.CloseResponse()

	ip := s.sandboxIP(t, srv.GetId())
	if ip != "169.254.0.21" {
		t.Errorf("guest address on eth0: %s, want 169.254.0.21 (the same in every sandbox)", ip)
	}
	// The server listens on the sandbox's address: it answers there from
	// inside the sandbox itself.
	if r := s.shell(t, srv.GetId(), `printf 'GET /index.html HTTP/1.0\r\n\r\n' | nc -w 2 `+ip+" 8000"); !strings.HasSuffix(r.stdout, "hello-inbound\n") {
		t.Fatalf("from inside the sandbox to %s:8000: %q %q", ip, r.stdout, r.stderr)
	}
	// From outside, the sandbox is its host address.
	target := s.hostIP(t, srv.GetId()) + ":8000"

	// Not from the node's namespace...
	if body, err := dialFrom(t, s.NodeNS(), target, 0); err == nil {
		t.Errorf("node namespace reached %s (%q); the policy should block it", target, body)
	}
	// ...although the path is there: the node's port-proxy mark may pass.
	if body, err := dialFrom(t, s.NodeNS(), target, netpolicy.ProxyMark); err != nil || !strings.HasSuffix(body, "hello-inbound\n") {
		t.Errorf("control: node namespace with the proxy mark: %q, %v", body, err)
	}
	// Not from another sandbox, though it may connect anywhere else.
	s.reaches(t, open.GetId(), harness.InetIP+":8080")
	s.blocked(t, open.GetId(), target)
	// Not from the internet, even with a route to the sandbox pool.
	harness.InNS(t, inet, func() error {
		_, pool, _ := net.ParseCIDR(netpolicy.DefaultPool)
		return netlink.RouteAdd(&netlink.Route{Dst: pool, Gw: net.ParseIP(harness.UplinkIP)})
	})
	if body, err := dialFrom(t, inet, target, 0); err == nil {
		t.Errorf("internet reached %s (%q); the policy should block it", target, body)
	}
	// The API path still works after all that.
	if _, err := s.ports().HTTPRequest(t.Context(), connect.NewRequest(&opendsecv1.HTTPRequestRequest{SandboxId: srv.GetId(), Port: 8000, Path: "/index.html"})); err != nil {
		t.Errorf("HTTPRequest after the probes: %v", err)
	}
}

// TestIPv6OffInSandbox: a container sandbox has no IPv6, cannot turn it on
// (/proc/sys is read-only), and cannot reach an IPv6 address the test's
// internet has. internal/netpolicy's TestIPv6Off shows the node's rules
// drop IPv6 even from a sandbox that did turn it on.
func TestIPv6OffInSandbox(t *testing.T) {
	s := newSystem(t)
	inet := harness.MakeInternet(t, s.NodeNS())
	const inet6 = "fd00:7::2"
	harness.InNS(t, s.NodeNS(), func() error {
		l, err := netlink.LinkByName("uplink")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP("fd00:7::1"), Mask: net.CIDRMask(64, 128)}, Flags: unix.IFA_F_NODAD})
	})
	harness.InNS(t, inet, func() error {
		l, err := netlink.LinkByName("peer")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP(inet6), Mask: net.CIDRMask(64, 128)}, Flags: unix.IFA_F_NODAD})
	})
	l := harness.ListenIn(t, inet, "["+inet6+"]:8080")
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "hello v6") }))
	s.Start()
	// Even with every IPv4 destination allowed.
	sb := s.create(t, &opendsecv1.SandboxSpec{Network: &opendsecv1.NetworkPolicy{Allow: []*opendsecv1.NetworkRule{{Cidr: "0.0.0.0/0"}}}})
	id := sb.GetId()

	if r := s.shell(t, id, "cat /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/eth0/disable_ipv6"); r.stdout != "1\n1\n" {
		t.Errorf("disable_ipv6 = %q, want 1 for all and eth0", r.stdout)
	}
	for _, line := range []string{
		"echo 0 > /proc/sys/net/ipv6/conf/all/disable_ipv6",
		"echo 0 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6",
		"sysctl -w net.ipv6.conf.all.disable_ipv6=0",
	} {
		r := s.shell(t, id, line)
		if r.exit.GetExitCode() == 0 {
			t.Errorf("%q succeeded in the sandbox; /proc/sys must be read-only", line)
		} else if !strings.Contains(strings.ToLower(r.stderr+r.stdout), "read-only") {
			t.Logf("%q failed (exit %d): %s", line, r.exit.GetExitCode(), strings.TrimSpace(r.stderr))
		}
	}
	if r := s.shell(t, id, "cat /proc/sys/net/ipv6/conf/all/disable_ipv6"); r.stdout != "1\n" {
		t.Errorf("after the attempts disable_ipv6 = %q, want 1", r.stdout)
	}
	if r := s.shell(t, id, "ip -6 addr"); strings.TrimSpace(r.stdout) != "" {
		t.Errorf("sandbox has IPv6 addresses: %q", r.stdout)
	}
	if r := s.shell(t, id, "ip -6 addr add fd00:6::2/64 dev eth0"); r.exit.GetExitCode() == 0 {
		t.Errorf("the sandbox could add an IPv6 address")
	}
	if r := s.shell(t, id, `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 2 `+inet6+` 8080 2>&1`); strings.Contains(r.stdout, "hello v6") {
		t.Errorf("sandbox reached [%s]:8080 over IPv6 (%q)", inet6, r.stdout)
	}
	// Control: the IPv6 server answers from the node's namespace.
	if body, err := dialFrom(t, s.NodeNS(), "["+inet6+"]:8080", 0); err != nil || !strings.HasSuffix(body, "hello v6") {
		t.Errorf("control: node → [%s]:8080 = %q, %v", inet6, body, err)
	}
}
