//go:build linux

package harness

import (
	"net"
	"net/netip"
	"os"
	goruntime "runtime"
	"strconv"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// MakeNetNS makes a network namespace with loopback up and bind-mounts it
// at path; it is removed when the test ends (after the system's cleanup,
// which is registered later).
func MakeNetNS(t testing.TB, path string) {
	t.Helper()
	ns := NewNS(t)
	defer ns.Close()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := unix.Mount("/proc/self/fd/"+strconv.Itoa(int(ns)), path, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind-mount netns: %v", err)
	}
	t.Cleanup(func() {
		unix.Unmount(path, unix.MNT_DETACH)
		os.Remove(path)
	})
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
}

// NewNS returns a handle to a new network namespace; the calling thread
// stays in its own.
func NewNS(t testing.TB) netns.NsHandle {
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	ns, err := netns.New()
	if err != nil {
		t.Fatal(err)
	}
	if err := netns.Set(orig); err != nil {
		t.Fatal(err)
	}
	return ns
}

// InNS runs fn on a thread in the namespace at path.
func InNS(t testing.TB, path string, fn func() error) {
	t.Helper()
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	ns, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if err := netns.Set(ns); err != nil {
		t.Fatal(err)
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		panic("restore network namespace: " + err.Error()) // the thread is unusable
	}
	if ferr != nil {
		t.Fatal(ferr)
	}
}

// Addresses of the test's "internet": a namespace joined to the node's by a
// veth, with servers on InetIP.
const (
	UplinkIP = "198.18.0.1"
	InetIP   = "198.18.0.2"
)

// MakeInternet builds the internet namespace next to the node's and returns
// its path.
func MakeInternet(t testing.TB, nodeNS string) string {
	t.Helper()
	path := nodeNS + "-inet"
	MakeNetNS(t, path)
	inet, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	defer inet.Close()
	up := func(name, addr string) error {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: netip.MustParseAddr(addr).AsSlice(), Mask: net.CIDRMask(24, 32)}}); err != nil {
			return err
		}
		return netlink.LinkSetUp(l)
	}
	InNS(t, nodeNS, func() error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "uplink"}, PeerName: "peer", PeerNamespace: netlink.NsFd(int(inet))}); err != nil {
			return err
		}
		return up("uplink", UplinkIP)
	})
	InNS(t, path, func() error { return up("peer", InetIP) })
	return path
}

// ListenIn opens a TCP listener in the namespace at path.
func ListenIn(t testing.TB, path, addr string) net.Listener {
	t.Helper()
	var l net.Listener
	InNS(t, path, func() error {
		var err error
		l, err = net.Listen("tcp", addr)
		return err
	})
	t.Cleanup(func() { l.Close() })
	return l
}
