package gvisor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Networking. runsc --network=sandbox copies every interface of the
// namespace its sandbox runs in into gVisor's netstack (addresses, routes,
// permanent neighbours), takes the addresses off the host interfaces and
// sends and receives on them through AF_PACKET sockets. Packet sockets
// bypass the namespace's netfilter, so runsc in the node's sandbox
// namespace as a container uses it (veth mode) would skip its NAT: the
// guest's packets would reach the node with the guest address, which the
// node's rules drop.
//
// So the backend asks for a tap attachment (NetworkMode), the one VMs get:
// the node's namespace routes and NATs between the guest's gateway on
// Device (tap0) and eth0 to the node, under the node's rules, as for a VM.
// At Start the backend puts a veth in the tap's place with the tap's MAC,
// addresses and neighbours (its name too, which the namespace's NAT rules
// match), whose other end, eth0, is the only interface of a guest
// namespace of the sandbox's own (guestNetNS in the state dir) with the
// attachment's guest address, MAC, gateway and default route: what runsc
// copies. A restored or forked sandbox finds the same guest configuration
// in its own namespaces, so the netstack state in its checkpoint stays
// valid.

const (
	guestNetNS = "guest.netns"
	guestIf    = "eth0"
)

// NetworkMode is the attachment the backend needs from the node: a tap
// namespace (see above).
func (r *Runtime) NetworkMode() runtime.NetworkMode { return runtime.NetworkTap }

// validateNetwork checks what a tap attachment needs on top of
// runtime.ValidateSpec's checks: the guest configuration Start wires.
func validateNetwork(n runtime.NetworkAttachment) error {
	if n.Mode != runtime.NetworkTap {
		return nil
	}
	switch {
	case n.Device == "":
		return errdefs.Invalid("network.device", "is empty; give the tap in network.netns the gvisor backend takes the place of (tap0)")
	case !n.GuestAddr.IsValid() || !n.GuestAddr.Addr().Is4():
		return errdefs.Invalid("network.guest_addr", "must be an IPv4 address with its prefix, got %v", n.GuestAddr)
	case !n.Gateway.IsValid() || !n.Gateway.Is4():
		return errdefs.Invalid("network.gateway", "must be an IPv4 address, got %v", n.Gateway)
	case len(n.MAC) != 6:
		return errdefs.Invalid("network.mac", "must be a 6-byte MAC, got %q", n.MAC)
	}
	return nil
}

// setupGuestNet makes the guest namespace at path and wires it to the
// node's namespace in place of its tap. It is idempotent for a Start that
// failed after it.
func setupGuestNet(ctx context.Context, n runtime.NetworkAttachment, path string) (retErr error) {
	if _, err := os.Stat(n.NetNS); err != nil {
		return errdefs.New(errdefs.ErrFailedPrecondition, "network.netns %s: the sandbox's network namespace is not there: %v", n.NetNS, err)
	}
	if err := createNetNS(path); err != nil {
		return err
	}
	defer func() {
		if retErr != nil {
			_ = removeNetNS(path)
		}
	}()
	router, err := netns.GetFromPath(n.NetNS)
	if err != nil {
		return fmt.Errorf("open sandbox netns: %w", err)
	}
	defer router.Close()
	guest, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open guest netns: %w", err)
	}
	defer guest.Close()
	rh, err := netlink.NewHandleAt(router)
	if err != nil {
		return fmt.Errorf("open sandbox netlink: %w", err)
	}
	defer rh.Close()
	gh, err := netlink.NewHandleAt(guest)
	if err != nil {
		return fmt.Errorf("open guest netlink: %w", err)
	}
	defer gh.Close()

	tap, err := rh.LinkByName(n.Device)
	if err != nil {
		return errdefs.New(errdefs.ErrFailedPrecondition, "network.device %s in %s: %v", n.Device, n.NetNS, err)
	}
	gwMAC := tap.Attrs().HardwareAddr
	if tap.Type() == "veth" {
		// A Start that failed after the swap: the veth's peer went with
		// the old guest namespace, so make it again.
		if err := rh.LinkDel(tap); err != nil {
			return fmt.Errorf("delete old guest veth: %w", err)
		}
	}
	addrs, err := rh.AddrList(tap, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("read %s addresses: %w", n.Device, err)
	}
	neighs, err := rh.NeighList(tap.Attrs().Index, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("read %s neighbours: %w", n.Device, err)
	}
	if tap.Type() != "veth" {
		if err := rh.LinkDel(tap); err != nil {
			return fmt.Errorf("delete %s: %w", n.Device, err)
		}
	}
	veth := &netlink.Veth{
		LinkAttrs:        netlink.LinkAttrs{Name: n.Device, HardwareAddr: gwMAC},
		PeerName:         guestIf,
		PeerHardwareAddr: n.MAC,
		PeerNamespace:    netlink.NsFd(int(guest)),
	}
	if err := rh.LinkAdd(veth); err != nil {
		return fmt.Errorf("add guest veth: %w", err)
	}
	gw, err := rh.LinkByName(n.Device)
	if err != nil {
		return fmt.Errorf("find guest veth: %w", err)
	}
	for _, a := range addrs {
		if err := rh.AddrAdd(gw, &netlink.Addr{IPNet: a.IPNet}); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("address guest veth: %w", err)
		}
	}
	for _, ne := range neighs {
		if ne.State&netlink.NUD_PERMANENT == 0 {
			continue
		}
		ne.LinkIndex = gw.Attrs().Index
		if err := rh.NeighSet(&ne); err != nil {
			return fmt.Errorf("add guest neighbour: %w", err)
		}
	}
	if err := rh.LinkSetUp(gw); err != nil {
		return fmt.Errorf("set guest veth up: %w", err)
	}

	eth, err := gh.LinkByName(guestIf)
	if err != nil {
		return fmt.Errorf("find guest eth0: %w", err)
	}
	if err := gh.AddrAdd(eth, &netlink.Addr{IPNet: &net.IPNet{IP: n.GuestAddr.Addr().AsSlice(), Mask: net.CIDRMask(n.GuestAddr.Bits(), 32)}}); err != nil {
		return fmt.Errorf("address guest eth0: %w", err)
	}
	if err := gh.LinkSetUp(eth); err != nil {
		return fmt.Errorf("set guest eth0 up: %w", err)
	}
	if len(gwMAC) == 6 {
		// runsc copies permanent neighbours: the guest never waits for ARP.
		if err := gh.NeighSet(&netlink.Neigh{LinkIndex: eth.Attrs().Index, Family: unix.AF_INET, State: netlink.NUD_PERMANENT,
			IP: n.Gateway.AsSlice(), HardwareAddr: gwMAC}); err != nil {
			return fmt.Errorf("add gateway neighbour: %w", err)
		}
	}
	if err := gh.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: n.Gateway.AsSlice()}); err != nil {
		return fmt.Errorf("add guest default route: %w", err)
	}
	// A veth drops what it sends until its carrier is seen on both ends.
	if err := netpolicy.WaitOperUp(ctx, gh, guestIf); err != nil {
		return err
	}
	return netpolicy.WaitOperUp(ctx, rh, n.Device)
}

// createNetNS makes a new network namespace with lo up and IPv6 off (as
// the node's sandbox namespaces) bind-mounted at path; an existing one
// there is replaced.
func createNetNS(path string) error {
	_ = netpolicy.RemoveNetNS(path)
	return netpolicy.CreateNetNS(path, func() error {
		for _, k := range []string{"all", "default"} {
			if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+k+"/disable_ipv6", []byte("1"), 0o644); err != nil {
				return fmt.Errorf("disable ipv6 in guest netns: %w", err)
			}
		}
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return fmt.Errorf("find lo: %w", err)
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			return fmt.Errorf("set lo up: %w", err)
		}
		return nil
	})
}

func removeNetNS(path string) error { return netpolicy.RemoveNetNS(path) }
