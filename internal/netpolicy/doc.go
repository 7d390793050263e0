// Package netpolicy gives every sandbox its own network and polices it on the
// node: a network namespace joined by runc through its path, a veth pair with
// a routed /31 from the node pool, NAT for allowed egress, nftables rules
// (default deny both ways, allow by CIDR, port range and protocol) and a
// per-node DNS proxy that answers only allowed names and admits their
// addresses into the sandbox's nftables sets before it replies.
//
// Everything a sandbox owns is named from its ID, so Teardown and Recover can
// find and remove it after a node crash. See docs/network.md.
package netpolicy
