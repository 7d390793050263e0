package netpolicy

import (
	"net"
	"net/netip"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Mode is how a sandbox's guest attaches to its network namespace.
type Mode string

const (
	// ModeVeth: the guest's processes run in the namespace (containers).
	// The guest configuration is on eth0, the namespace's end of the veth
	// to the node.
	ModeVeth Mode = "veth"
	// ModeTap: a VM's NIC is backed by tap0 inside the namespace and
	// carries the guest configuration itself; tap0 is its gateway, and the
	// namespace routes between tap0 and eth0 (the veth to the node).
	ModeTap Mode = "tap"
)

// Interface names inside a sandbox's namespace.
const (
	sandboxIf = "eth0" // the veth end
	tapIf     = "tap0"
)

// The guest side of every sandbox: the same in every namespace, so a guest
// restored from another sandbox's memory finds the network it knew. It is
// link-local (RFC 3927), which no router forwards, so no destination a
// caller can name collides with it, and it stays clear of the metadata
// addresses (169.254.169.0/24).
var (
	guestPrefix  = netip.MustParsePrefix("169.254.0.21/30")
	guestGateway = netip.MustParseAddr("169.254.0.22")
)

// Fixed, locally administered MACs: the guest's NIC, its gateway (the
// node's end of the veth, or tap0), and the namespace's eth0 in tap mode.
var (
	guestMAC     = [6]byte{0x02, 0x0d, 0x5e, 0x00, 0x00, 0x21}
	gatewayMAC   = [6]byte{0x02, 0x0d, 0x5e, 0x00, 0x00, 0x22}
	transportMAC = [6]byte{0x02, 0x0d, 0x5e, 0x00, 0x00, 0x20}
)

func hw(m [6]byte) net.HardwareAddr { return append(net.HardwareAddr(nil), m[:]...) }

// SetupOptions choose how a sandbox's guest attaches to its namespace.
type SetupOptions struct {
	// Mode is ModeVeth (the default when empty) or ModeTap.
	Mode Mode
}

func (o SetupOptions) mode() (Mode, error) {
	switch o.Mode {
	case "", ModeVeth:
		return ModeVeth, nil
	case ModeTap:
		return ModeTap, nil
	}
	return "", errdefs.Invalid("network.mode", "%q is not a network mode; use %q or %q", o.Mode, ModeVeth, ModeTap)
}

// Network is what a backend needs to put a sandbox on its network.
//
// The guest fields are the same for every sandbox; the host fields are the
// sandbox's own. Inside the namespace, NAT translates between them: the
// guest's traffic leaves with HostAddr, and what the node sends to HostAddr
// reaches the guest. The node's rules key on HostAddr and HostIf.
type Network struct {
	ID string
	// NetNSPath is the namespace to join (OCI linux.namespaces type
	// "network", path NetNSPath), or to open the tap in.
	NetNSPath string
	// Mode says where the guest configuration lives: on eth0 in the
	// namespace (veth) or on the VM's NIC behind tap0 (tap).
	Mode Mode
	// GuestIf is the interface in the namespace the guest uses: "eth0"
	// (veth: configured as below) or "tap0" (tap: the VM attaches to it
	// and configures its own NIC as below; tap0 holds GuestGateway).
	GuestIf string
	// GuestAddr is the guest's address with its prefix (169.254.0.21/30),
	// GuestGateway its default gateway, GuestMAC the MAC of its NIC.
	GuestAddr    netip.Prefix
	GuestGateway netip.Addr
	GuestMAC     net.HardwareAddr
	// Nameservers are the guest's resolvers (its gateway, which the
	// namespace forwards to the node's DNS proxy).
	Nameservers []netip.Addr
	// DNS is Nameservers[0], for /etc/resolv.conf.
	DNS netip.Addr
	// HostIf is the node-side veth.
	HostIf string
	// HostAddr is the sandbox's unique address on the node's side: its
	// traffic reaches the node from it, and the node reaches the guest
	// through it. HostGateway is the node's end of the veth.
	HostAddr    netip.Addr
	HostGateway netip.Addr
}

// guestNetwork is the part of a Network that is known before Setup.
func guestNetwork(id, nsPath string, mode Mode) Network {
	n := Network{
		ID: id, NetNSPath: nsPath, Mode: mode, GuestIf: sandboxIf,
		GuestAddr: guestPrefix, GuestGateway: guestGateway, GuestMAC: hw(guestMAC),
		Nameservers: []netip.Addr{guestGateway}, DNS: guestGateway,
	}
	if mode == ModeTap {
		n.GuestIf = tapIf
	}
	return n
}
