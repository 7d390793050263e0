package e2b

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"regexp"
	"strconv"
	"strings"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// maxEgressEntries caps allowOut and denyOut, each.
const maxEgressEntries = 64

// allTraffic is E2B's "every destination" (the SDKs' ctx.all_traffic).
const allTraffic = "0.0.0.0/0"

// denyAllRule is how the gateway asks for "no egress at all" on create,
// where an empty OpenDsec policy means the node's default rule sets: one
// rule that matches no real destination.
var denyAllRule = &v1.NetworkRule{Cidr: "0.0.0.0/32"}

// networkJSON is E2B's SandboxNetworkConfig (create) and, with
// allow_internet_access, SandboxNetworkUpdateConfig (PUT .../network).
type networkJSON struct {
	AllowPublicTraffic  *bool           `json:"allowPublicTraffic"`
	AllowOut            []string        `json:"allowOut"`
	DenyOut             []string        `json:"denyOut"`
	EgressProxy         json.RawMessage `json:"egressProxy"`
	MaskRequestHost     *string         `json:"maskRequestHost"`
	HTTPSPorts          []uint32        `json:"httpsPorts"`
	Rules               json.RawMessage `json:"rules"`
	DNSServers          []string        `json:"dns_servers"`
	AllowInternetAccess *bool           `json:"allow_internet_access"`
}

func present(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s != "" && s != "null" && s != "{}"
}

// unsupported refuses the E2B network features OpenDsec has no equivalent
// for, naming the field.
func (n *networkJSON) unsupported(prefix string) error {
	switch {
	case present(n.EgressProxy):
		return errdefs.Invalid(prefix+"egressProxy", "is not supported by OpenDsec's E2B gateway; leave it unset")
	case present(n.Rules):
		return errdefs.Invalid(prefix+"rules", "(header transforms) are not supported by OpenDsec's E2B gateway; leave them unset")
	case len(n.DNSServers) > 0:
		return errdefs.Invalid(prefix+"dns_servers", "cannot be chosen: sandboxes resolve through their node's DNS proxy, which enforces domain rules; leave it unset")
	}
	for i, p := range n.HTTPSPorts {
		if p < 1 || p > 65535 || p == EnvdPort {
			return errdefs.Invalid(fmt.Sprintf("%shttpsPorts[%d]", prefix, i), "%d must be a port between 1 and 65535 other than %d", p, EnvdPort)
		}
	}
	return nil
}

// maxMaskLen bounds maskRequestHost (it is kept as a sandbox label).
const maxMaskLen = 253

// maskHostRe is what a maskRequestHost may hold once ${PORT} is replaced: a
// Host header's host[:port] (names, IPv4, bracketed IPv6).
var maskHostRe = regexp.MustCompile(`^[A-Za-z0-9._~\-]+(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?$`)

// checkMask validates network.maskRequestHost: the Host header requests to
// the sandbox's user ports carry, with ${PORT} replaced by the port.
func checkMask(field, mask string) error {
	if len(mask) > maxMaskLen {
		return errdefs.Invalid(field, "is %d bytes; at most %d are allowed", len(mask), maxMaskLen)
	}
	if !maskHostRe.MatchString(maskHost(mask, 1)) {
		return errdefs.Invalid(field, "%q is not a host[:port] for a Host header (${PORT} stands for the port), e.g. \"app.example.com:${PORT}\"", mask)
	}
	return nil
}

// maskHost is mask with ${PORT} replaced by port.
func maskHost(mask string, port int) string {
	return strings.ReplaceAll(mask, "${PORT}", strconv.Itoa(port))
}

var domainRe = regexp.MustCompile(`^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// parseIPv4 parses an IPv4 address or prefix; ok is false for anything
// else (a domain).
func parseIPv4(s string) (netip.Prefix, bool, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, true, err
		}
		if !p.Addr().Is4() {
			return netip.Prefix{}, true, fmt.Errorf("is IPv6; IPv6 is off in sandboxes")
		}
		return p.Masked(), true, nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, false, nil
	}
	if !a.Is4() {
		return netip.Prefix{}, true, fmt.Errorf("is IPv6; IPv6 is off in sandboxes")
	}
	return netip.PrefixFrom(a, 32), true, nil
}

// reservedRanges are the destinations the gateway never puts in a policy:
// link-local (cloud metadata at 169.254.169.254), the shared address space
// that holds the nodes' sandbox pools (default 100.96.0.0/12; the gateway
// does not know each node's pool, so it keeps out all of 100.64.0.0/10),
// loopback, "this network", multicast and the reserved class E. The node
// blocks its own addresses, other sandboxes and link-local for broad rules
// anyway; but a rule that lies inside one of these ranges opens it on purpose
// (docs/network.md), and a complement of denyOut would produce exactly such
// rules (denying 169.254.169.255 would allow 169.254.169.254/32).
var reservedRanges = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

// reservedNames says what each of reservedRanges is, for errors.
var reservedNames = map[netip.Prefix]string{
	reservedRanges[0]: "\"this network\" (0.0.0.0/8)",
	reservedRanges[1]: "the shared address space 100.64.0.0/10, which holds the sandboxes and their nodes",
	reservedRanges[2]: "loopback (127.0.0.0/8)",
	reservedRanges[3]: "link-local 169.254.0.0/16, which holds cloud metadata",
	reservedRanges[4]: "multicast (224.0.0.0/4)",
	reservedRanges[5]: "reserved (240.0.0.0/4)",
}

// privateRanges are the private networks (RFC 1918): E2B's "internet" is
// the public one, so allowing all egress leaves them out like
// reservedRanges. An explicit allowOut entry may still name one (a
// database on the operator's LAN, say), and an admin's rule set can open
// them for everyone.
var privateRanges = []netip.Prefix{
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.168.0.0/16"),
}

// notInternet is what "all egress" leaves out.
var notInternet = append(append([]netip.Prefix{}, reservedRanges...), privateRanges...)

// maxPolicyRules is the most rules the node takes in one policy
// (netpolicy's limit).
const maxPolicyRules = 256

// egressPolicy maps E2B's egress settings onto an OpenDsec network policy.
// E2B allows all egress unless denied; denyOut holds CIDRs and IPs, allowOut
// CIDRs, IPs and domains, and an allowOut entry wins over a denyOut one.
// OpenDsec policies only allow, so "everything but denyOut" becomes the
// complement of denyOut and of reservedRanges as a list of prefixes. The
// node still blocks what it always blocks (itself, other sandboxes, metadata
// addresses). allowOut entries inside a reserved range are refused; wider
// ones are clipped to leave the reserved ranges out. prefix names the
// request's fields in errors ("network.").
func egressPolicy(prefix string, allowInternet *bool, allowOut, denyOut []string) (*v1.NetworkPolicy, error) {
	if len(allowOut) > maxEgressEntries {
		return nil, errdefs.Invalid(prefix+"allowOut", "has %d entries; at most %d are allowed", len(allowOut), maxEgressEntries)
	}
	if len(denyOut) > maxEgressEntries {
		return nil, errdefs.Invalid(prefix+"denyOut", "has %d entries; at most %d are allowed", len(denyOut), maxEgressEntries)
	}
	internet := allowInternet == nil || *allowInternet
	var denies []netip.Prefix
	for i, s := range denyOut {
		p, isIP, err := parseIPv4(strings.TrimSpace(s))
		if !isIP || err != nil {
			msg := "is not an IPv4 address or CIDR (like \"10.0.0.0/8\"); denyOut takes no domains"
			if err != nil {
				msg = err.Error()
			}
			return nil, errdefs.Invalid(fmt.Sprintf("%sdenyOut[%d]", prefix, i), "%q %s", s, msg)
		}
		if p.Bits() == 0 {
			internet = false
		}
		denies = append(denies, p)
	}
	pol := &v1.NetworkPolicy{}
	for i, s := range allowOut {
		s = strings.ToLower(strings.TrimSpace(s))
		field := fmt.Sprintf("%sallowOut[%d]", prefix, i)
		p, isIP, err := parseIPv4(s)
		switch {
		case err != nil:
			return nil, errdefs.Invalid(field, "%q %s", s, err.Error())
		case isIP:
			for _, r := range reservedRanges {
				if r.Bits() <= p.Bits() && r.Contains(p.Addr()) {
					return nil, errdefs.Invalid(field, "%q lies in %s; sandboxes cannot reach it through the E2B gateway: remove the entry", s, reservedNames[r])
				}
			}
			for _, c := range complement(p, reservedRanges) {
				pol.Allow = append(pol.Allow, &v1.NetworkRule{Cidr: c.String()})
			}
		case !domainRe.MatchString(s) || len(s) > 253:
			return nil, errdefs.Invalid(field, "%q is not an IPv4 address, CIDR or domain (like \"pypi.org\" or \"*.example.com\")", s)
		case internet:
			return nil, errdefs.Invalid(field, "domain %q needs all other egress denied: add %q to denyOut (or set allow_internet_access to false)", s, allTraffic)
		default:
			pol.Allow = append(pol.Allow, &v1.NetworkRule{Domain: s})
		}
	}
	if internet {
		// The public internet: everything but denyOut, the reserved and
		// the private ranges (the node keeps its protected destinations
		// closed under any rule too).
		for _, p := range complement(netip.MustParsePrefix(allTraffic), append(denies, notInternet...)) {
			pol.Allow = append(pol.Allow, &v1.NetworkRule{Cidr: p.String()})
		}
	}
	if len(pol.Allow) > maxPolicyRules {
		field := prefix + "denyOut"
		if !internet {
			field = prefix + "allowOut"
		}
		return nil, errdefs.Invalid(field, "needs %d OpenDsec rules, more than the %d a sandbox may have: merge entries into wider CIDRs", len(pol.Allow), maxPolicyRules)
	}
	if len(pol.Allow) == 0 {
		pol.Allow = []*v1.NetworkRule{denyAllRule}
	}
	return pol, nil
}

// complement returns the prefixes covering p minus every prefix in out, in
// address order (at most 32 per excluded prefix).
func complement(p netip.Prefix, out []netip.Prefix) []netip.Prefix {
	overlaps := false
	for _, o := range out {
		if o.Bits() <= p.Bits() && o.Contains(p.Addr()) {
			return nil // p is wholly excluded
		}
		if p.Overlaps(o) {
			overlaps = true
		}
	}
	if !overlaps {
		return []netip.Prefix{p}
	}
	lo := netip.PrefixFrom(p.Addr(), p.Bits()+1)
	a := p.Addr().As4()
	bit := p.Bits()
	a[bit/8] |= 0x80 >> (bit % 8)
	hi := netip.PrefixFrom(netip.AddrFrom4(a), p.Bits()+1)
	return append(complement(lo, out), complement(hi, out)...)
}

// internetAllowed reports whether a policy made by egressPolicy lets the
// sandbox reach the internet at large (nil: the node's default).
func internetAllowed(pol *v1.NetworkPolicy) *bool {
	if pol == nil {
		return nil
	}
	// The complement of a denyOut list always holds a prefix of /7 or
	// shorter; explicit allowOut entries (and the deny-all rule) never do
	// unless they name most of the internet.
	allowed := false
	for _, r := range pol.GetAllow() {
		if p, err := netip.ParsePrefix(r.GetCidr()); err == nil && p.Bits() < 8 {
			allowed = true
		}
	}
	return &allowed
}

// createNetwork maps a create request's allow_internet_access and network
// onto a policy. Neither given: the public internet when defaultInternet
// (E2B's default), else nil, the node's default rule sets.
func createNetwork(allowInternet *bool, n *networkJSON, defaultInternet bool) (*v1.NetworkPolicy, error) {
	if n != nil {
		if err := n.unsupported("network."); err != nil {
			return nil, err
		}
	}
	if allowInternet == nil && (n == nil || (n.AllowOut == nil && n.DenyOut == nil)) {
		if !defaultInternet {
			return nil, nil
		}
		return egressPolicy("network.", nil, nil, nil)
	}
	var allowOut, denyOut []string
	if n != nil {
		allowOut, denyOut = n.AllowOut, n.DenyOut
	}
	return egressPolicy("network.", allowInternet, allowOut, denyOut)
}

// updateNetwork serves PUT /sandboxes/{id}/network: the body replaces the
// sandbox's whole egress configuration (omitted fields are cleared, so {}
// allows all egress, as in E2B).
func (g *Gateway) updateNetwork(w http.ResponseWriter, r *http.Request) {
	var body networkJSON
	if err := decode(r, &body); err != nil {
		writeErr(w, err)
		return
	}
	if err := body.unsupported(""); err != nil {
		writeErr(w, err)
		return
	}
	if body.AllowPublicTraffic != nil || body.HTTPSPorts != nil || body.MaskRequestHost != nil {
		writeError(w, http.StatusBadRequest, "allowPublicTraffic, httpsPorts and maskRequestHost can only be set when the sandbox is created")
		return
	}
	pol, err := egressPolicy("", body.AllowInternetAccess, body.AllowOut, body.DenyOut)
	if err != nil {
		writeErr(w, err)
		return
	}
	sb, err := g.lookup(r.Context(), sandboxID(r))
	if err != nil {
		writeErr(w, err)
		return
	}
	if stateOf(sb) != "running" {
		writeError(w, http.StatusConflict, "sandbox %s is %s; its network can be changed only while it runs", sb.GetId(), stateOf(sb))
		return
	}
	if _, err := g.cfg.API.SetNetwork(r.Context(), connect.NewRequest(&v1.SetNetworkRequest{Id: sb.GetId(), Network: pol})); err != nil {
		writeErr(w, fmt.Errorf("set network: %w", errdefs.FromConnect(err)))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// trafficToken is the traffic access token of sandbox id: what requests to
// its user ports must carry when it was created with allowPublicTraffic
// false.
func (g *Gateway) trafficToken(id string) string {
	m := hmac.New(sha256.New, g.cfg.Secret)
	m.Write([]byte("e2b traffic access token\x00" + id))
	return hex.EncodeToString(m.Sum(nil))
}

// checkTrafficToken reports whether r carries sandbox id's traffic token.
func (g *Gateway) checkTrafficToken(r *http.Request, id string) bool {
	tok := r.Header.Get("E2b-Traffic-Access-Token")
	return tok != "" && subtle.ConstantTimeCompare([]byte(tok), []byte(g.trafficToken(id))) == 1
}
