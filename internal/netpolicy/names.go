package netpolicy

import (
	"crypto/sha256"
	"encoding/base32"
	"path/filepath"
	"strings"
)

// Host-wide names. Several nodes may share one machine and even one network
// namespace (tests of several nodes do): everything a node makes outside
// its own state directory carries its node ID (4 characters of [a-z0-9],
// Config.NodeID), and a node's recovery removes only what carries its own:
//
//   - the nftables table "opendsec-<node>" (inet) in the node's namespace;
//   - each sandbox's node-side veth "od<node>" plus 9 characters of a
//     hash of the sandbox ID (15 characters, Linux's limit);
//   - the namespace files in /run/opendsec/<node>/netns (network.netns_dir
//     overrides it).
//
// A Config without a node ID (only this package's tests) keeps the names
// of before node IDs were in them: table "opendsec", veths "od" plus 13
// characters of the hash, /run/opendsec/netns.
//
// Collisions: two nodes' veth names differ in the node part. Within one
// node, 9 base32 characters are 45 bits: with 32768 sandboxes on the node
// the chance that two share a name is about 1.5e-5, and a shared name makes
// the second create fail (the veth exists), never joins two sandboxes.
// Sandbox IDs themselves start with their node's ID, so state keyed by ID
// never collides between nodes either.
const (
	// tableName is the node table without a node ID, and the NAT table in
	// every sandbox's own namespace (one per namespace, so it never
	// collides).
	tableName   = "opendsec"
	vethPrefix  = "od"
	legacyIfLen = 13 // hash characters of a veth name without a node ID
	nodeIfLen   = 9  // hash characters of a veth name with a node ID
)

// TableName is the nftables table (family inet) of node in its network
// namespace.
func TableName(node string) string {
	if node == "" {
		return tableName
	}
	return tableName + "-" + node
}

// DefaultNetNSDirOf is network.netns_dir's default for node.
func DefaultNetNSDirOf(node string) string {
	if node == "" {
		return DefaultNetNSDir
	}
	return filepath.Join("/run/opendsec", node, "netns")
}

// HostIfName is the node-side veth name of sandbox id on node: "od", the
// node ID and 9 characters of a hash of the sandbox ID; without a node ID,
// "od" and 13 characters of the hash (interface names have at most 15).
func HostIfName(node, id string) string {
	h := sha256.Sum256([]byte(id))
	s := strings.ToLower(base32.StdEncoding.EncodeToString(h[:]))
	if node == "" {
		return vethPrefix + s[:legacyIfLen]
	}
	return vethPrefix + node + s[:nodeIfLen]
}
