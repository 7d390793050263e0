package netpolicy

import (
	"net/netip"
	"path/filepath"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// Defaults for Config.
const (
	DefaultPool = "100.96.0.0/12"
	// DefaultNetNSDir is netns_dir's default without a node ID; a node's
	// is DefaultNetNSDirOf(its ID).
	DefaultNetNSDir = "/run/opendsec/netns"
	DefaultMinTTL   = 10
	// DefaultMaxTTL caps how long one DNS answer keeps an address open.
	DefaultMaxTTL = 3600
	// DefaultMaxDNSEntries is how many (name, address) pairs the DNS proxy
	// remembers per sandbox; past it the ones closest to expiry go.
	DefaultMaxDNSEntries = 4096
	// DefaultDNSQueriesPerSecond and DefaultDNSQueryBurst are each
	// sandbox's token bucket for queries to the DNS proxy.
	DefaultDNSQueriesPerSecond = 200
	DefaultDNSQueryBurst       = 500
)

// Config configures the network policy of one node. It is meant to live in
// the node's part of the configuration file as "network".
type Config struct {
	// NodeID is the node's ID (node.id, set by the node, not a field of
	// the network section). It is in the name of everything the node makes
	// outside its state directory (names.go), so nodes sharing a machine
	// or a network namespace never touch each other's. Empty (tests only)
	// keeps the names of before node IDs were in them.
	NodeID string `json:"-"`
	// Pool is the IPv4 prefix sandbox addresses come from. Its first /31 is
	// the node's DNS proxy; each sandbox gets the next free /31 (gateway on
	// the node's side, sandbox on the other). Default 100.96.0.0/12.
	Pool string `json:"pool"`
	// NetNSDir holds one bind-mounted network namespace file per sandbox,
	// named by sandbox ID; runc joins it through the OCI spec's path.
	// Default /run/opendsec/<node id>/netns.
	NetNSDir string `json:"netns_dir"`
	// StateDir holds the address allocations and each sandbox's rules, so a
	// restarted node neither reuses an address nor forgets a policy.
	StateDir string `json:"state_dir"`
	// Upstream are the DNS servers ("host:port") allowed queries go to.
	Upstream []string `json:"dns_upstream"`
	// RuleSets are the administrator's named rule sets, e.g. "pypi".
	RuleSets map[string][]Rule `json:"rule_sets"`
	// DefaultRuleSets apply to a sandbox created without network rules.
	DefaultRuleSets []string `json:"default_rule_sets"`
	// MinTTLSeconds is the shortest time an address learned through DNS
	// stays allowed, so a client can connect after a TTL-0 answer.
	MinTTLSeconds int `json:"min_dns_ttl_seconds"`
	// MaxTTLSeconds is the longest time one answer keeps an address
	// allowed, whatever TTL upstream gave. Default 3600.
	MaxTTLSeconds int `json:"max_dns_ttl_seconds"`
	// MaxDNSEntries bounds the (name, address) pairs remembered per
	// sandbox (and so the elements of its domain sets); past it the pairs
	// closest to expiry are dropped, from nftables too. Default 4096.
	MaxDNSEntries int `json:"max_dns_entries"`
	// DNSQueriesPerSecond and DNSQueryBurst are each sandbox's token bucket
	// for DNS queries; a query over it is answered REFUSED. Defaults 200
	// and 500.
	DNSQueriesPerSecond float64 `json:"dns_queries_per_second"`
	DNSQueryBurst       int     `json:"dns_query_burst"`
	// RefusePrivateDNSAnswers drops A records in private, shared, loopback,
	// link-local, multicast and reserved ranges (and the pool) from the
	// answers for domain rules, so an allowed name cannot open an internal
	// address (DNS rebinding). A CIDR rule of the sandbox that covers such
	// an address still lets it through. Off by default; the quickstart
	// turns it on.
	RefusePrivateDNSAnswers bool `json:"refuse_private_dns_answers"`
	// NodeNetNS is the network namespace (a path) that plays the node: where
	// veths' host ends, nftables and the DNS proxy live. Empty means the
	// namespace of the calling process (production). Tests use their own.
	NodeNetNS string `json:"node_netns,omitempty"`
}

// withDefaults fills empty fields; dataDir roots StateDir.
func (c Config) withDefaults(dataDir string) Config {
	if c.Pool == "" {
		c.Pool = DefaultPool
	}
	if c.NetNSDir == "" {
		c.NetNSDir = DefaultNetNSDirOf(c.NodeID)
	}
	if c.StateDir == "" && dataDir != "" {
		c.StateDir = filepath.Join(dataDir, "netpolicy")
	}
	if c.MinTTLSeconds == 0 {
		c.MinTTLSeconds = DefaultMinTTL
	}
	if c.MaxTTLSeconds == 0 {
		c.MaxTTLSeconds = max(DefaultMaxTTL, c.MinTTLSeconds)
	}
	if c.MaxDNSEntries == 0 {
		c.MaxDNSEntries = DefaultMaxDNSEntries
	}
	if c.DNSQueriesPerSecond == 0 {
		c.DNSQueriesPerSecond = DefaultDNSQueriesPerSecond
	}
	if c.DNSQueryBurst == 0 {
		c.DNSQueryBurst = max(DefaultDNSQueryBurst, int(c.DNSQueriesPerSecond))
	}
	return c
}

// sharedSpace is RFC 6598's shared address space; sandbox pools live in it.
var sharedSpace = netip.MustParsePrefix("100.64.0.0/10")

// Validate checks the configuration; errors name the field.
func (c Config) Validate() error {
	if c.NodeID != "" {
		if err := sandboxid.ValidNode(c.NodeID); err != nil {
			return errdefs.Invalid("node.id", "%q must be exactly 4 characters of [a-z0-9], e.g. \"n001\"", c.NodeID)
		}
	}
	p, err := netip.ParsePrefix(c.Pool)
	if err != nil || !p.Addr().Is4() || p.Bits() > 29 || p != p.Masked() {
		return errdefs.Invalid("network.pool", "%q must be an IPv4 prefix of /29 or larger like %q", c.Pool, DefaultPool)
	}
	// The apiserver and the E2B gateway keep callers' rules out of every
	// node's pool without knowing it: they refuse (or subtract) all of
	// 100.64.0.0/10. A pool elsewhere would escape that.
	if !sharedSpace.Contains(p.Addr()) || p.Bits() < sharedSpace.Bits() {
		return errdefs.Invalid("network.pool", "%q must lie inside the shared address space 100.64.0.0/10 (like %q), which the apiserver and the E2B gateway keep callers' rules out of", c.Pool, DefaultPool)
	}
	if !filepath.IsAbs(c.NetNSDir) {
		return errdefs.Invalid("network.netns_dir", "%q must be an absolute path", c.NetNSDir)
	}
	if !filepath.IsAbs(c.StateDir) {
		return errdefs.Invalid("network.state_dir", "%q must be an absolute path", c.StateDir)
	}
	for i, u := range c.Upstream {
		if _, err := netip.ParseAddrPort(u); err != nil {
			return errdefs.Invalid("network.dns_upstream", "entry %d %q must be ip:port like \"192.0.2.53:53\"", i, u)
		}
	}
	if c.MinTTLSeconds < 1 {
		return errdefs.Invalid("network.min_dns_ttl_seconds", "must be positive")
	}
	if c.MaxTTLSeconds < c.MinTTLSeconds {
		return errdefs.Invalid("network.max_dns_ttl_seconds", "%d must be at least min_dns_ttl_seconds (%d)", c.MaxTTLSeconds, c.MinTTLSeconds)
	}
	if c.MaxDNSEntries < 1 {
		return errdefs.Invalid("network.max_dns_entries", "%d must be positive (default %d)", c.MaxDNSEntries, DefaultMaxDNSEntries)
	}
	if !(c.DNSQueriesPerSecond > 0) {
		return errdefs.Invalid("network.dns_queries_per_second", "%v must be positive (default %d)", c.DNSQueriesPerSecond, DefaultDNSQueriesPerSecond)
	}
	if c.DNSQueryBurst < 1 {
		return errdefs.Invalid("network.dns_query_burst", "%d must be positive (default %d)", c.DNSQueryBurst, DefaultDNSQueryBurst)
	}
	if err := ValidateRuleSets(c.RuleSets); err != nil {
		return err
	}
	for i, n := range c.DefaultRuleSets {
		if _, ok := c.RuleSets[n]; !ok {
			return errdefs.Invalid("network.default_rule_sets", "entry %d %q is not in rule_sets", i, n)
		}
	}
	return nil
}
