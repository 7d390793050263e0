package netpolicy

import (
	"fmt"
	"net/netip"
	"sort"
	"strconv"
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// Protocols a rule can name. The empty protocol means TCP and UDP when the
// rule has ports, and every IPv4 protocol when it has none.
const (
	ProtoAny  = ""
	ProtoTCP  = "tcp"
	ProtoUDP  = "udp"
	ProtoICMP = "icmp"
)

// Rule allows one kind of egress. Exactly one of CIDR and Domain is set.
// It is the spec's type (sandboxspec is the one shape of a sandbox spec).
type Rule = sandboxspec.NetworkRule

// Rules is a sandbox's policy: named rule sets plus direct rules.
type Rules = sandboxspec.NetworkRules

// rule is a validated Rule.
type rule struct {
	prefix   netip.Prefix // valid for CIDR rules
	domain   string       // exact name, or ".suffix" for a pattern
	proto    string
	portLo   uint16
	portHi   uint16 // 0 means every port
	original Rule
	// fromSet: the rule comes from a rule set of the node configuration
	// (the administrator's), not from the caller's allow list.
	fromSet bool
}

func (r rule) isDomain() bool { return r.domain != "" }

// matches reports whether name (lowercase, no trailing dot) is allowed by a
// domain rule.
func (r rule) matches(name string) bool {
	if strings.HasPrefix(r.domain, ".") {
		return strings.HasSuffix(name, r.domain) && len(name) > len(r.domain)
	}
	return name == r.domain
}

// validateRule checks one rule; field names the rule in errors
// ("allow[2]" or "rule_sets.pypi[0]").
func validateRule(field string, in Rule) (rule, error) {
	r := rule{original: in}
	switch {
	case in.CIDR != "" && in.Domain != "":
		return r, errdefs.Invalid(field, "has both cidr %q and domain %q; give one per rule", in.CIDR, in.Domain)
	case in.CIDR == "" && in.Domain == "":
		return r, errdefs.Invalid(field, "needs a cidr (\"10.0.0.0/8\") or a domain (\"pypi.org\", \"*.example.com\")")
	case in.CIDR != "":
		p, err := parseCIDR(in.CIDR)
		if err != nil {
			return r, errdefs.Invalid(field+".cidr", "%q is not an IPv4 address or prefix (like \"10.0.0.0/8\" or \"192.0.2.1\"); IPv6 is off in sandboxes", in.CIDR)
		}
		r.prefix = p
	default:
		d, err := normalizeDomain(in.Domain)
		if err != nil {
			return r, errdefs.Invalid(field+".domain", "%q %v", in.Domain, err)
		}
		r.domain = d
	}
	switch p := strings.ToLower(in.Protocol); p {
	case ProtoAny, ProtoTCP, ProtoUDP, ProtoICMP:
		r.proto = p
	default:
		return r, errdefs.Invalid(field+".protocol", "%q is unknown; use tcp, udp, icmp or leave it empty for tcp and udp", in.Protocol)
	}
	if in.Ports != "" {
		if r.proto == ProtoICMP {
			return r, errdefs.Invalid(field+".ports", "icmp has no ports; drop ports or use tcp/udp")
		}
		lo, hi, err := parsePorts(in.Ports)
		if err != nil {
			return r, errdefs.Invalid(field+".ports", "%q %v", in.Ports, err)
		}
		r.portLo, r.portHi = lo, hi
	}
	return r, nil
}

func parseCIDR(s string) (netip.Prefix, error) {
	var p netip.Prefix
	if strings.Contains(s, "/") {
		var err error
		p, err = netip.ParsePrefix(s)
		if err != nil {
			return p, err
		}
	} else {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return p, err
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	if !p.Addr().Is4() {
		return p, fmt.Errorf("not IPv4")
	}
	return p.Masked(), nil
}

func parsePorts(s string) (lo, hi uint16, err error) {
	a, b, isRange := strings.Cut(s, "-")
	if !isRange {
		b = a
	}
	pl, err1 := parsePort(a)
	ph, err2 := parsePort(b)
	if err1 != nil {
		return 0, 0, err1
	}
	if err2 != nil {
		return 0, 0, err2
	}
	if pl > ph {
		return 0, 0, fmt.Errorf("is a range that ends before it starts; write low-high")
	}
	return pl, ph, nil
}

func parsePort(s string) (uint16, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return 0, fmt.Errorf("is not a port or range like \"443\" or \"8000-8100\"")
	}
	if n < 1 || n > 65535 {
		return 0, fmt.Errorf("has port %d; ports are 1 to 65535", n)
	}
	return uint16(n), nil
}

// normalizeDomain lowercases d and checks it is a DNS name or "*.suffix";
// it returns the exact name or ".suffix".
func normalizeDomain(d string) (string, error) {
	d = strings.TrimSuffix(strings.ToLower(d), ".")
	wild := strings.HasPrefix(d, "*.")
	name := strings.TrimPrefix(d, "*.")
	if name == "" || len(name) > 253 {
		return "", fmt.Errorf("is not a domain name; write it like \"pypi.org\" or \"*.example.com\"")
	}
	for _, label := range strings.Split(name, ".") {
		if label == "" || len(label) > 63 {
			return "", fmt.Errorf("has an empty or over-long label; write it like \"pypi.org\" or \"*.example.com\"")
		}
		for _, c := range label {
			ok := c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_'
			if !ok {
				return "", fmt.Errorf("contains %q; a domain has only letters, digits, '-' and '.', with an optional leading \"*.\"", c)
			}
		}
	}
	if wild {
		return "." + name, nil
	}
	return name, nil
}

// ValidateRuleSets checks the named rule sets of the node configuration.
func ValidateRuleSets(sets map[string][]Rule) error {
	names := make([]string, 0, len(sets))
	for n := range sets {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if n == "" {
			return errdefs.Invalid("rule_sets", "has an empty name; name every rule set")
		}
		for i, r := range sets[n] {
			if _, err := validateRule(fmt.Sprintf("rule_sets.%s[%d]", n, i), r); err != nil {
				return err
			}
		}
	}
	return nil
}

// resolve validates rs against the named rule sets and returns the flat rule
// list: rule sets first, in the order given, then the direct rules.
func resolve(rs Rules, sets map[string][]Rule) ([]rule, error) {
	var out []rule
	seen := map[string]bool{}
	for i, name := range rs.RuleSets {
		defs, ok := sets[name]
		if !ok {
			known := make([]string, 0, len(sets))
			for n := range sets {
				known = append(known, n)
			}
			sort.Strings(known)
			return nil, errdefs.Invalid(fmt.Sprintf("rule_sets[%d]", i), "%q is not a rule set of this node; known: %s", name, strings.Join(known, ", "))
		}
		if seen[name] {
			continue
		}
		seen[name] = true
		for j, r := range defs {
			v, err := validateRule(fmt.Sprintf("rule_sets.%s[%d]", name, j), r)
			if err != nil {
				return nil, err
			}
			v.fromSet = true
			out = append(out, v)
		}
	}
	for i, r := range rs.Allow {
		v, err := validateRule(fmt.Sprintf("allow[%d]", i), r)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	const maxRules = 256
	if len(out) > maxRules {
		return nil, errdefs.Invalid("allow", "has %d rules with its rule sets; at most %d", len(out), maxRules)
	}
	return out, nil
}
