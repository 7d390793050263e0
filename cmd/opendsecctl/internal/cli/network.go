package cli

import (
	"fmt"
	"strings"
	"unicode"

	"github.com/spf13/cobra"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// networkFlags are the policy flags shared by create and set-network.
type networkFlags struct {
	allow, allowDomain, ruleSets []string
}

func (n *networkFlags) register(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringArrayVar(&n.allow, "allow", nil, "allow egress to CIDR[:PORTS][/PROTO], e.g. 10.0.0.0/8:443/tcp (repeatable)")
	f.StringArrayVar(&n.allowDomain, "allow-domain", nil, "allow egress to NAME[:PORTS][/PROTO], e.g. pypi.org:443 or *.pythonhosted.org (repeatable)")
	f.StringArrayVar(&n.ruleSets, "rule-set", nil, "enable a rule set of the node, e.g. pypi (repeatable)")
}

// set reports whether any policy flag was given.
func (n *networkFlags) set() bool {
	return len(n.allow)+len(n.allowDomain)+len(n.ruleSets) > 0
}

// policy builds the policy the flags describe. The server validates the
// values in depth; here only the shape of each flag is checked.
func (n *networkFlags) policy() (*opendsecv1.NetworkPolicy, error) {
	p := &opendsecv1.NetworkPolicy{}
	for _, name := range n.ruleSets {
		if strings.TrimSpace(name) == "" {
			return nil, usagef("--rule-set: empty name; give a rule set of the node, e.g. --rule-set pypi")
		}
		p.RuleSets = append(p.RuleSets, name)
	}
	for _, s := range n.allow {
		r, err := parseRule("allow", s)
		if err != nil {
			return nil, err
		}
		r.Cidr, r.Domain = r.Domain, ""
		p.Allow = append(p.Allow, r)
	}
	for _, s := range n.allowDomain {
		r, err := parseRule("allow-domain", s)
		if err != nil {
			return nil, err
		}
		p.Allow = append(p.Allow, r)
	}
	return p, nil
}

// parseRule parses TARGET[:PORTS][/PROTO] into a rule with Domain = TARGET.
// A CIDR's own "/8" (or "/8:443") is told from a protocol by having no letters.
func parseRule(flag, s string) (*opendsecv1.NetworkRule, error) {
	r := &opendsecv1.NetworkRule{}
	rest := s
	if i := strings.LastIndexByte(rest, '/'); i >= 0 {
		switch tail := rest[i+1:]; {
		case tail == "tcp" || tail == "udp" || tail == "icmp":
			r.Protocol, rest = tail, rest[:i]
		case tail == "" || strings.ContainsFunc(tail, unicode.IsLetter):
			return nil, usagef("--%s: %q has protocol %q; use tcp, udp or icmp, e.g. 10.0.0.0/8:443/tcp", flag, s, tail)
		}
	}
	if i := strings.LastIndexByte(rest, ':'); i >= 0 {
		r.Ports, rest = rest[i+1:], rest[:i]
		if r.Ports == "" {
			return nil, usagef("--%s: %q has an empty port after ':'; give a port or range, e.g. :443 or :8000-8100", flag, s)
		}
	}
	if rest == "" {
		return nil, usagef("--%s: %q names no address; e.g. --allow 10.0.0.0/8:443 or --allow-domain pypi.org:443", flag, s)
	}
	r.Domain = rest
	return r, nil
}

// fmtNetwork renders a policy on one line, in the flags' syntax.
func fmtNetwork(p *opendsecv1.NetworkPolicy) string {
	var parts []string
	for _, s := range p.GetRuleSets() {
		parts = append(parts, "rule-set "+s)
	}
	for _, r := range p.GetAllow() {
		t := r.GetCidr() + r.GetDomain()
		if r.GetPorts() != "" {
			t += ":" + r.GetPorts()
		}
		if r.GetProtocol() != "" {
			t += "/" + r.GetProtocol()
		}
		parts = append(parts, t)
	}
	if len(parts) == 0 {
		return "none (everything denied)"
	}
	return strings.Join(parts, ", ")
}

func (a *app) setNetworkCommand() *cobra.Command {
	var (
		n       networkFlags
		denyAll bool
	)
	cmd := &cobra.Command{
		Use:   "set-network ID [--allow CIDR[:PORTS][/PROTO]]... [--allow-domain NAME[:PORTS]]... [--rule-set NAME]... | --deny-all",
		Short: "Replace a running sandbox's network policy atomically",
		Example: `  opendsecctl sandbox set-network n001sb0001 --rule-set pypi --allow 10.0.0.0/8:443/tcp
  opendsecctl sandbox set-network n001sb0001 --deny-all`,
		Args: exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if n.set() == denyAll {
				return usagef("set-network: give rules (--allow, --allow-domain, --rule-set) or --deny-all, not both or neither")
			}
			policy, err := n.policy()
			if err != nil {
				return err
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			sb, err := c.SetNetwork(cmd.Context(), args[0], policy)
			if err != nil {
				return err
			}
			if a.output == "json" {
				return printJSON(a.stdout, sb)
			}
			fmt.Fprintf(a.stdout, "%s network: %s\n", sb.GetId(), fmtNetwork(sb.GetSpec().GetNetwork()))
			return nil
		},
	}
	n.register(cmd)
	cmd.Flags().BoolVar(&denyAll, "deny-all", false, "deny all network traffic")
	return cmd
}
