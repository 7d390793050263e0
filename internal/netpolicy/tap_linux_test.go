package netpolicy

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// fakeVM is a VM's NIC on a sandbox's tap0, as a VMM holds it: the tap's
// file, from which it sends and receives whole Ethernet frames. It speaks
// just enough IPv4 and UDP for the tests.
type fakeVM struct {
	f *os.File
}

func attachVM(t *testing.T, n Network) *fakeVM {
	t.Helper()
	var f *os.File
	must(t, inNetNS(n.NetNSPath, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return err
		}
		var req [unix.IFNAMSIZ + 64]byte
		copy(req[:], n.GuestIf)
		binary.NativeEndian.PutUint16(req[unix.IFNAMSIZ:], unix.IFF_TAP|unix.IFF_NO_PI)
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TUNSETIFF, uintptr(unsafe.Pointer(&req[0]))); errno != 0 {
			unix.Close(fd)
			return errno
		}
		f = os.NewFile(uintptr(fd), "tap")
		return nil
	}))
	t.Cleanup(func() { f.Close() })
	return &fakeVM{f: f}
}

func csum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s > 0xffff {
		s = s>>16 + s&0xffff
	}
	return ^uint16(s)
}

// sendUDP sends one datagram from the guest address.
func (v *fakeVM) sendUDP(n Network, srcPort uint16, dst netip.AddrPort, payload []byte) error {
	frame := make([]byte, 14+20+8+len(payload))
	copy(frame[0:6], hw(gatewayMAC)) // the gateway's MAC, as the guest learned it
	copy(frame[6:12], n.GuestMAC)
	binary.BigEndian.PutUint16(frame[12:], 0x0800)
	ip := frame[14:34]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(20+8+len(payload)))
	ip[8] = 64
	ip[9] = unix.IPPROTO_UDP
	src := n.GuestAddr.Addr().As4()
	d := dst.Addr().As4()
	copy(ip[12:16], src[:])
	copy(ip[16:20], d[:])
	binary.BigEndian.PutUint16(ip[10:], csum(ip))
	udp := frame[34:]
	binary.BigEndian.PutUint16(udp[0:], srcPort)
	binary.BigEndian.PutUint16(udp[2:], dst.Port())
	binary.BigEndian.PutUint16(udp[4:], uint16(8+len(payload)))
	copy(udp[8:], payload) // checksum 0: none, which IPv4 allows
	_, err := v.f.Write(frame)
	return err
}

var errNoReply = errors.New("no reply")

// recvUDP waits up to denyWait for a datagram to the guest's dstPort from
// src and returns its payload; other frames are skipped.
func (v *fakeVM) recvUDP(n Network, src netip.AddrPort, dstPort uint16) ([]byte, error) {
	v.f.SetReadDeadline(time.Now().Add(denyWait))
	buf := make([]byte, 65536)
	for {
		k, err := v.f.Read(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, errNoReply
		}
		if err != nil {
			return nil, err
		}
		fr := buf[:k]
		if len(fr) < 42 || binary.BigEndian.Uint16(fr[12:]) != 0x0800 || !slices.Equal(fr[0:6], n.GuestMAC) {
			continue
		}
		ip := fr[14:]
		ihl := int(ip[0]&0xf) * 4
		if ip[9] != unix.IPPROTO_UDP || len(ip) < ihl+8 {
			continue
		}
		s, _ := netip.AddrFromSlice(ip[12:16])
		d, _ := netip.AddrFromSlice(ip[16:20])
		udp := ip[ihl:]
		if s != src.Addr() || binary.BigEndian.Uint16(udp[0:]) != src.Port() || d != n.GuestAddr.Addr() || binary.BigEndian.Uint16(udp[2:]) != dstPort {
			continue
		}
		l := int(binary.BigEndian.Uint16(udp[4:]))
		return append([]byte(nil), udp[8:l]...), nil
	}
}

// udpEcho sends payload to dst and waits for it to come back.
func (v *fakeVM) udpEcho(n Network, dst netip.AddrPort, srcPort uint16) error {
	if err := v.sendUDP(n, srcPort, dst, []byte("hello")); err != nil {
		return err
	}
	got, err := v.recvUDP(n, dst, srcPort)
	if err != nil {
		return err
	}
	if string(got) != "hello" {
		return errors.New("echo returned " + string(got))
	}
	return nil
}

// resolve asks the guest's resolver for name's A record.
func (v *fakeVM) resolve(n Network, name string, srcPort uint16) (*dns.Msg, error) {
	q := new(dns.Msg)
	q.SetQuestion(dns.Fqdn(name), dns.TypeA)
	b, err := q.Pack()
	if err != nil {
		return nil, err
	}
	srv := netip.AddrPortFrom(n.Nameservers[0], 53)
	for range 5 { // a stalled proxy must not read as a lost answer
		if err := v.sendUDP(n, srcPort, srv, b); err != nil {
			return nil, err
		}
		got, err := v.recvUDP(n, srv, srcPort)
		if errors.Is(err, errNoReply) {
			continue
		}
		if err != nil {
			return nil, err
		}
		r := new(dns.Msg)
		return r, r.Unpack(got)
	}
	return nil, errNoReply
}

// A VM's sandbox: tap0 in the namespace is its gateway, the VM's NIC has
// the same guest configuration a container has, and the node polices it the
// same way, by its host address.
func TestTapMode(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	rules := Rules{Allow: []Rule{{Domain: "api.example.test", Protocol: "udp", Ports: "9000"}}}
	opts := SetupOptions{Mode: ModeTap}
	a, err := w.m.SetupWith(ctx, id(t, "a"), rules, opts)
	must(t, err)
	c, err := w.m.Setup(ctx, id(t, "c"), Rules{})
	must(t, err)
	if a.Mode != ModeTap || a.GuestIf != "tap0" || a.GuestAddr != c.GuestAddr || a.GuestGateway != c.GuestGateway ||
		a.GuestMAC.String() != c.GuestMAC.String() || a.DNS != c.DNS || a.HostAddr == c.HostAddr {
		t.Errorf("tap attachment %+v, veth attachment %+v", a, c)
	}
	if p := w.m.PlannedWith(a.ID, opts); p.GuestIf != "tap0" || p.Mode != ModeTap || p.NetNSPath != a.NetNSPath || p.DNS != a.DNS {
		t.Errorf("PlannedWith tap: %+v", p)
	}
	// Inside the namespace: tap0 holds the gateway with the gateway MAC the
	// node's veth has in veth mode; eth0 has no address; IPv6 is off.
	must(t, inNetNS(a.NetNSPath, func() error {
		tap, err := netlink.LinkByName("tap0")
		if err != nil {
			return err
		}
		if tap.Type() != "tuntap" || tap.Attrs().HardwareAddr.String() != "02:0d:5e:00:00:22" || tap.Attrs().Flags&net.FlagUp == 0 {
			t.Errorf("tap0: type %s mac %s flags %v", tap.Type(), tap.Attrs().HardwareAddr, tap.Attrs().Flags)
		}
		for name, want := range map[string][]string{"tap0": {"169.254.0.22/30"}, "eth0": nil} {
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			as, err := netlink.AddrList(l, netlink.FAMILY_V4)
			if err != nil {
				return err
			}
			var got []string
			for _, a := range as {
				got = append(got, a.IPNet.String())
			}
			if !slices.Equal(got, want) {
				t.Errorf("%s addresses %v, want %v", name, got, want)
			}
			v, err := os.ReadFile("/proc/sys/net/ipv6/conf/" + name + "/disable_ipv6")
			if err != nil {
				return err
			}
			if strings.TrimSpace(string(v)) != "1" {
				t.Errorf("%s disable_ipv6 = %q", name, v)
			}
		}
		return nil
	}))

	vm := attachVM(t, a)
	api := netip.MustParseAddrPort(apiIP + ":9000")
	// Denied until the name is resolved through the guest's resolver.
	if err := vm.udpEcho(a, api, 40000); err == nil {
		t.Error("vm → api udp before resolving: allowed, want denied")
	}
	r, err := vm.resolve(a, "evil.example.test", 40053)
	must(t, err)
	if r.Rcode != dns.RcodeNameError {
		t.Errorf("vm resolves evil: %s, want NXDOMAIN", dns.RcodeToString[r.Rcode])
	}
	r, err = vm.resolve(a, "api.example.test", 40054)
	must(t, err)
	if r.Rcode != dns.RcodeSuccess || len(r.Answer) != 1 || r.Answer[0].(*dns.A).A.String() != apiIP {
		t.Fatalf("vm resolves api: %v", r)
	}
	var echoErr error
	for range 5 {
		if echoErr = vm.udpEcho(a, api, 40001); echoErr == nil {
			break
		}
	}
	if echoErr != nil {
		t.Errorf("vm → api udp after resolving: %v", echoErr)
	}
	// The other sandbox on the same guest address is not opened by it.
	denied(t, "veth sandbox → api udp", udpFrom(c, api.String()))
	if got := w.flowSources(w.nodeNS, apiIP, 9000); !slices.Equal(got, []string{a.HostAddr.String()}) {
		t.Errorf("node saw flows to api:9000 from %v, want the tap sandbox's host address %v", got, a.HostAddr)
	}
	// Rule changes apply to the VM like to a container.
	must(t, w.m.SetRules(ctx, a.ID, Rules{}))
	if err := vm.udpEcho(a, api, 40002); err == nil {
		t.Error("vm → api udp after SetRules deny: allowed")
	}

	// Teardown leaves nothing; a restarted node keeps the tap sandbox's mode.
	must(t, w.m.SetRules(ctx, a.ID, Rules{Allow: []Rule{{CIDR: apiIP, Protocol: "udp", Ports: "9000"}}}))
	w.m.Close()
	w.m = w.newManager()
	_, err = w.m.Recover(ctx, func(id string) bool { return id == a.ID })
	must(t, err)
	if g, err := w.m.Get(a.ID); err != nil || g.Mode != ModeTap || g.GuestIf != "tap0" || g.HostAddr != a.HostAddr {
		t.Errorf("Get after restart: %+v %v", g, err)
	}
	for range 5 {
		if echoErr = vm.udpEcho(a, api, 40003); echoErr == nil {
			break
		}
	}
	if echoErr != nil {
		t.Errorf("vm → api udp after restart: %v", echoErr)
	}
	must(t, w.m.Teardown(ctx, a.ID))
	if got := w.count(); got.veths != 0 || got.netns != 0 || got.states != 0 || got.allocs != 0 {
		t.Errorf("after teardown and recover: %+v", got)
	}
}
