package node

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// failingNetwork is a Network whose Setup fails; it records the order of
// calls so the test can check that a failed create tears the network down
// only after Setup returned.
type failingNetwork struct {
	mu    sync.Mutex
	calls []string
}

func (f *failingNetwork) record(s string) {
	f.mu.Lock()
	f.calls = append(f.calls, s)
	f.mu.Unlock()
}

func (f *failingNetwork) Validate(netpolicy.Rules) error { return nil }
func (f *failingNetwork) Planned(id string) netpolicy.Network {
	return netpolicy.Network{ID: id, NetNSPath: "/nonexistent/netns/" + id, DNS: netip.MustParseAddr("100.96.0.1")}
}
func (f *failingNetwork) Setup(_ context.Context, id string, _ netpolicy.Rules) (netpolicy.Network, error) {
	f.record("setup " + id)
	return netpolicy.Network{}, errors.New("veth: no more addresses")
}
func (f *failingNetwork) SetRules(context.Context, string, netpolicy.Rules) error { return nil }
func (f *failingNetwork) Teardown(_ context.Context, id string) error {
	f.record("teardown " + id)
	return nil
}
func (f *failingNetwork) Recover(context.Context, func(string) bool) (netpolicy.RecoverReport, error) {
	return netpolicy.RecoverReport{}, nil
}

// The network is set up while the backend prepares the bundle; when it
// fails, the create fails with the network's error and leaves nothing.
func TestCreateWithFailingNetworkLeavesNothing(t *testing.T) {
	f := newFixture(t)
	nw := &failingNetwork{}
	f.cfg.Network = nw
	n := f.open(t)
	id := sandboxid.New(f.cfg.ID)
	_, err := n.Create(t.Context(), CreateRequest{ID: id, Spec: specRecord{Image: "root/busybox"}})
	if err == nil || !strings.Contains(err.Error(), "set up sandbox network") || !strings.Contains(err.Error(), "no more addresses") {
		t.Fatalf("create: err = %v, want the network's error", err)
	}
	nw.mu.Lock()
	calls := strings.Join(nw.calls, ",")
	nw.mu.Unlock()
	if calls != "setup "+id+",teardown "+id {
		t.Fatalf("network calls = %q, want setup then teardown", calls)
	}
	if _, err := f.rt.Status(t.Context(), id); !errdefs.IsNotFound(err) {
		t.Fatalf("backend still knows the sandbox: %v", err)
	}
	if recs, _ := n.table.all(); len(recs) != 0 {
		t.Fatalf("table has %d records after a failed create", len(recs))
	}
	if h := f.cfg.Images.(images).held(); h != 0 {
		t.Fatalf("%d image holds after a failed create", h)
	}
	if _, err := os.Stat(f.cfg.StateDir + "/sandboxes/" + id); !os.IsNotExist(err) {
		t.Fatalf("sandbox dir left behind: %v", err)
	}
	if _, _, err := n.Get(t.Context(), id); !errdefs.IsNotFound(err) {
		t.Fatalf("node still lists the sandbox: %v", err)
	}
}

// The backend gets the guest side of the network the node plans: the
// device, address, gateway and MAC every sandbox has, and the mode.
func TestAttachmentCarriesGuestConfig(t *testing.T) {
	mac := net.HardwareAddr{0x02, 0x0d, 0x5e, 0, 0, 0x21}
	nw := netpolicy.Network{ID: "x", NetNSPath: "/run/ns/x", Mode: netpolicy.ModeVeth, GuestIf: "eth0",
		GuestAddr: netip.MustParsePrefix("169.254.0.21/30"), GuestGateway: netip.MustParseAddr("169.254.0.22"), GuestMAC: mac}
	a := attachment(nw)
	if a.Mode != runtime.NetworkVeth || a.NetNS != nw.NetNSPath || a.Device != "eth0" || a.GuestAddr != nw.GuestAddr ||
		a.Gateway != nw.GuestGateway || a.MAC.String() != mac.String() {
		t.Errorf("attachment(%+v) = %+v", nw, a)
	}
	nw.Mode, nw.GuestIf = netpolicy.ModeTap, "tap0"
	if a := attachment(nw); a.Mode != runtime.NetworkTap || a.Device != "tap0" {
		t.Errorf("tap attachment = %+v", a)
	}
}
