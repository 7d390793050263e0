package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/vmchan"
)

// guestIf is the VM's NIC (virtio-net on the sandbox's tap).
const guestIf = "eth0"

// setupLoopback brings lo up.
func setupLoopback() error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("lo: %w", err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("lo up: %w", err)
	}
	return nil
}

// configureNet gives eth0 its MAC (when set), address and default route.
// It is idempotent: the identity route runs it again after a restore.
func configureNet(mac, addr, gw string) error {
	var (
		hw  net.HardwareAddr
		pfx netip.Prefix
		gwa netip.Addr
		err error
	)
	if mac != "" {
		if hw, err = net.ParseMAC(mac); err != nil {
			return fmt.Errorf("mac %q: %w", mac, err)
		}
	}
	if pfx, err = netip.ParsePrefix(addr); err != nil {
		return fmt.Errorf("address %q: want addr/prefix: %w", addr, err)
	}
	if gw != "" {
		if gwa, err = netip.ParseAddr(gw); err != nil {
			return fmt.Errorf("gateway %q: %w", gw, err)
		}
	}
	// virtio_net registers eth0 while its module loads; wait a little in
	// case the probe is still running.
	var link netlink.Link
	for i := 0; ; i++ {
		if link, err = netlink.LinkByName(guestIf); err == nil {
			break
		}
		if i == 100 {
			return fmt.Errorf("%s: %w (is virtio_net loaded and a NIC on the qemu command line?)", guestIf, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if hw != nil && !bytes.Equal(link.Attrs().HardwareAddr, hw) {
		if err := netlink.LinkSetHardwareAddr(link, hw); err != nil {
			return fmt.Errorf("%s mac %s: %w", guestIf, hw, err)
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("%s up: %w", guestIf, err)
	}
	ipn := &net.IPNet{IP: pfx.Addr().AsSlice(), Mask: net.CIDRMask(pfx.Bits(), pfx.Addr().BitLen())}
	if err := netlink.AddrReplace(link, &netlink.Addr{IPNet: ipn}); err != nil {
		return fmt.Errorf("%s address %s: %w", guestIf, pfx, err)
	}
	if gwa.IsValid() {
		r := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: gwa.AsSlice(), Dst: nil}
		if err := netlink.RouteReplace(r); err != nil {
			return fmt.Errorf("default route via %s: %w", gwa, err)
		}
	}
	return nil
}

// readConfig reads the configuration disk dev (JSON, NUL-padded).
func readConfig(dev string) (vmchan.GuestConfig, error) {
	var c vmchan.GuestConfig
	f, err := os.Open(dev)
	if err != nil {
		return c, fmt.Errorf("config disk: %w", err)
	}
	defer func() { _ = f.Close() }()
	b := make([]byte, 1<<20)
	n, err := f.Read(b)
	if err != nil && n == 0 {
		return c, fmt.Errorf("config disk %s: %w", dev, err)
	}
	b = bytes.TrimRight(b[:n], "\x00")
	if err := json.Unmarshal(b, &c); err != nil {
		return c, fmt.Errorf("config disk %s: %w", dev, err)
	}
	return c, nil
}

// writeResolvConf writes /etc/resolv.conf for the nameservers (nothing when none).
func writeResolvConf(ns []string) error {
	if len(ns) == 0 {
		return nil
	}
	var b strings.Builder
	for _, s := range ns {
		b.WriteString("nameserver " + s + "\n")
	}
	if err := os.MkdirAll("/etc", 0o755); err != nil {
		return err
	}
	// An image's resolv.conf may be a symlink (systemd-resolved's): replace it.
	_ = os.Remove("/etc/resolv.conf")
	return os.WriteFile("/etc/resolv.conf", []byte(b.String()), 0o644)
}

// applyIdentity sets what id gives: hostname, eth0, RNG, clock.
func applyIdentity(id vmchan.Identity) error {
	var errs []error
	if id.Hostname != "" {
		if err := unix.Sethostname([]byte(id.Hostname)); err != nil {
			errs = append(errs, fmt.Errorf("hostname: %w", err))
		}
	}
	if id.Addr != "" {
		if err := configureNet(id.MAC, id.Addr, id.Gateway); err != nil {
			errs = append(errs, err)
		}
	}
	if len(id.Entropy) > 0 {
		if err := reseed(id.Entropy); err != nil {
			errs = append(errs, err)
		}
	}
	if id.TimeNS > 0 {
		ts := unix.NsecToTimespec(id.TimeNS)
		if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
			errs = append(errs, fmt.Errorf("clock: %w", err))
		}
	}
	return errors.Join(errs...)
}

// reseed mixes b into the kernel's entropy pool, credited, and makes the
// CRNG reseed from it at once: a restored VM must not repeat the random
// numbers of every other restore of the same snapshot.
func reseed(b []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("rng: %w", err)
	}
	defer func() { _ = f.Close() }()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+len(b)+3)
	*(*int32)(unsafe.Pointer(&info[0])) = int32(len(b) * 8)
	*(*int32)(unsafe.Pointer(&info[4])) = int32(len(b))
	copy(info[8:], b)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&info[0]))); e != 0 {
		return fmt.Errorf("rng RNDADDENTROPY: %w", e)
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDRESEEDCRNG, 0); e != 0 {
		return fmt.Errorf("rng RNDRESEEDCRNG: %w", e)
	}
	return nil
}
