package node

import (
	"context"
	"errors"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
)

// tapNet records the modes the node asked for.
type tapNet struct {
	collectingNet
	modes []netpolicy.Mode
}

func (t *tapNet) PlannedWith(id string, o netpolicy.SetupOptions) netpolicy.Network {
	t.modes = append(t.modes, o.Mode)
	return netpolicy.Network{ID: id, Mode: o.Mode}
}

func (t *tapNet) SetupWith(_ context.Context, id string, _ netpolicy.Rules, o netpolicy.SetupOptions) (netpolicy.Network, error) {
	t.modes = append(t.modes, o.Mode)
	return netpolicy.Network{ID: id, Mode: o.Mode}, nil
}

type tapBackend struct{ runtime.Runtime }

func (tapBackend) NetworkMode() runtime.NetworkMode { return runtime.NetworkTap }

func TestNodeGivesTapBackendsATap(t *testing.T) {
	veth := runtimefake.New(runtimefake.Config{})
	tap := tapBackend{veth}
	tn := &tapNet{}
	n := &Node{cfg: Config{Network: tn}}
	if got := attachment(n.netPlanned(tap, "a")); got.Mode != runtime.NetworkTap {
		t.Fatalf("planned attachment for a tap backend: %q", got.Mode)
	}
	if nw, err := n.netSetup(context.Background(), tap, "a", netpolicy.Rules{}); err != nil || nw.Mode != netpolicy.ModeTap {
		t.Fatalf("setup for a tap backend: %+v %v", nw, err)
	}
	if len(tn.modes) != 2 || tn.modes[0] != netpolicy.ModeTap || tn.modes[1] != netpolicy.ModeTap {
		t.Fatalf("modes asked: %v", tn.modes)
	}
	// A node network without taps refuses a tap backend instead of giving it a veth.
	n = &Node{cfg: Config{Network: collectingNet{}}}
	if _, err := n.netSetup(context.Background(), tap, "a", netpolicy.Rules{}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("setup without tap support: %v", err)
	}
	if _, err := n.netSetup(context.Background(), veth, "a", netpolicy.Rules{}); err != nil {
		t.Fatalf("setup for a veth backend: %v", err)
	}
}
