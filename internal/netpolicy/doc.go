// Package netpolicy gives every sandbox its own network and polices it on the
// node: a network namespace joined by runc through its path (or holding a
// VM's tap), in which the guest has the same address, gateway, resolver and
// MAC as in every other sandbox (169.254.0.21/30 via 169.254.0.22); a veth
// pair to the node with a routed /31 from the node pool, whose odd address is
// the sandbox's own host address; NAT inside the namespace between the two;
// NAT for allowed egress on the node; nftables rules on the node keyed on the
// host address (default deny both ways, allow by CIDR, port range and
// protocol) and a per-node DNS proxy that answers only allowed names and
// admits their addresses into the sandbox's nftables sets before it replies.
//
// Everything a sandbox owns is named from its ID, so Teardown and Recover can
// find and remove it after a node crash. See docs/network.md.
package netpolicy
