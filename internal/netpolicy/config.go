package netpolicy

import (
	"net/netip"
	"path/filepath"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Defaults for Config.
const (
	DefaultPool     = "100.96.0.0/12"
	DefaultNetNSDir = "/run/opendsec/netns"
	DefaultMinTTL   = 10
)

// Config configures the network policy of one node. It is meant to live in
// the node's part of the configuration file as "network".
type Config struct {
	// Pool is the IPv4 prefix sandbox addresses come from. Its first /31 is
	// the node's DNS proxy; each sandbox gets the next free /31 (gateway on
	// the node's side, sandbox on the other). Default 100.96.0.0/12.
	Pool string `json:"pool"`
	// NetNSDir holds one bind-mounted network namespace file per sandbox,
	// named by sandbox ID; runc joins it through the OCI spec's path.
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
		c.NetNSDir = DefaultNetNSDir
	}
	if c.StateDir == "" && dataDir != "" {
		c.StateDir = filepath.Join(dataDir, "netpolicy")
	}
	if c.MinTTLSeconds == 0 {
		c.MinTTLSeconds = DefaultMinTTL
	}
	return c
}

// sharedSpace is RFC 6598's shared address space; sandbox pools live in it.
var sharedSpace = netip.MustParsePrefix("100.64.0.0/10")

// Validate checks the configuration; errors name the field.
func (c Config) Validate() error {
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
