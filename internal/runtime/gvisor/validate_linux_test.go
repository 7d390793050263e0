package gvisor

import (
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// TestValidateSpec: the shared checks and the tap attachment's own, each
// an invalid argument naming its field (unprivileged).
func TestValidateSpec(t *testing.T) {
	mac, _ := net.ParseMAC("02:0d:5e:00:00:21")
	tap := runtime.NetworkAttachment{Mode: runtime.NetworkTap, NetNS: "/run/netns/x", Device: "tap0",
		GuestAddr: netip.MustParsePrefix("169.254.0.21/30"), Gateway: netip.MustParseAddr("169.254.0.22"), MAC: mac}
	good := runtime.Spec{ID: "sb1", StateDir: t.TempDir(), Rootfs: runtime.Rootfs{Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: t.TempDir()}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 256, DiskMB: 64}, Network: tap}
	if err := validateSpec(good); err != nil {
		t.Fatalf("good spec: %v", err)
	}
	for _, c := range []struct {
		field  string
		mutate func(*runtime.Spec)
	}{
		{"id", func(s *runtime.Spec) { s.ID = "../x" }},
		{"resources.memory_mb", func(s *runtime.Spec) { s.Resources.MemoryMB = 16 }},
		{"resources.disk_mb", func(s *runtime.Spec) { s.Resources.DiskMB = -1 }},
		{"network.mode", func(s *runtime.Spec) { s.Network.Mode = runtime.NetworkVeth }},
		{"network.netns", func(s *runtime.Spec) { s.Network.NetNS = "" }},
		{"network.device", func(s *runtime.Spec) { s.Network.Device = "" }},
		{"network.guest_addr", func(s *runtime.Spec) { s.Network.GuestAddr = netip.Prefix{} }},
		{"network.gateway", func(s *runtime.Spec) { s.Network.Gateway = netip.Addr{} }},
		{"network.mac", func(s *runtime.Spec) { s.Network.MAC = nil }},
	} {
		s := good
		c.mutate(&s)
		var fe *errdefs.FieldError
		if err := validateSpec(s); !errors.Is(err, errdefs.ErrInvalidArgument) || !errors.As(err, &fe) || fe.Field != c.field {
			t.Errorf("%s: err = %v, want an invalid argument naming %s", c.field, err, c.field)
		}
	}
}
