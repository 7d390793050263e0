package node

import (
	"context"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
)

// TapNetwork is implemented by a Network that can give a sandbox a tap
// instead of a veth (netpolicy's Manager); the node needs it for backends
// whose runtime.NetworkModeOf is NetworkTap (VMs).
type TapNetwork interface {
	PlannedWith(id string, opts netpolicy.SetupOptions) netpolicy.Network
	SetupWith(ctx context.Context, id string, rules netpolicy.Rules, opts netpolicy.SetupOptions) (netpolicy.Network, error)
}

// netPlanned is Network.Planned in the attachment mode rt needs.
func (n *Node) netPlanned(rt runtime.Runtime, id string) netpolicy.Network {
	if t, ok := n.cfg.Network.(TapNetwork); ok && runtime.NetworkModeOf(rt) == runtime.NetworkTap {
		return t.PlannedWith(id, netpolicy.SetupOptions{Mode: netpolicy.ModeTap})
	}
	return n.cfg.Network.Planned(id)
}

// netSetup is Network.Setup in the attachment mode rt needs.
func (n *Node) netSetup(ctx context.Context, rt runtime.Runtime, id string, rules netpolicy.Rules) (netpolicy.Network, error) {
	if runtime.NetworkModeOf(rt) != runtime.NetworkTap {
		return n.cfg.Network.Setup(ctx, id, rules)
	}
	t, ok := n.cfg.Network.(TapNetwork)
	if !ok {
		return netpolicy.Network{}, errdefs.New(errdefs.ErrFailedPrecondition, "the node's network cannot make the tap sandbox %s's backend needs", id)
	}
	return t.SetupWith(ctx, id, rules, netpolicy.SetupOptions{Mode: netpolicy.ModeTap})
}
