//go:build linux

package security

import (
	"strings"
	"testing"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

// Finding 6 (its e2e half): with node.network.refuse_private_dns_answers,
// a domain rule for a name that resolves to a private address (RFC 1918)
// gives the sandbox no answer, while a name resolving to a public address
// resolves and opens it. The fake upstream is in the test's own namespace.
// The memory bounds of the finding (dedup, expiry, entry cap, rate limit)
// are package tests: internal/netpolicy TestSecurityDNSAnswersBounded,
// TestSecurityDNSExpiry, TestSecurityDNSEntryCap, TestSecurityDNSRateLimit,
// TestSecurityDNSPrivateAnswers.
func checkDNSPrivateAnswers(t *testing.T, e *env) {
	id := e.create(t, &opendsecv1.SandboxSpec{Network: &opendsecv1.NetworkPolicy{Allow: []*opendsecv1.NetworkRule{
		{Domain: publicName, Protocol: "tcp", Ports: "8080"},
		{Domain: privateName},
	}}})
	e.withProbe(t, id)
	got := e.runProbe(t, id, "", "lookup", privateName, publicName)
	if v := got["lookup "+privateName]; strings.Contains(v, "10.9.9.9") || !strings.Contains(v, "server misbehaving") && !strings.Contains(v, "no such host") {
		t.Errorf("lookup %s (private answer): %q, want refused", privateName, v)
	}
	if v := got["lookup "+publicName]; v != harness.InetIP {
		t.Fatalf("lookup %s: %q, want %s", publicName, v, harness.InetIP)
	}
	if v := e.runProbe(t, id, "", "dial", publicName+":8080")["dial "+publicName+":8080"]; v != "ok" {
		t.Errorf("dial %s:8080 after resolving it: %q, want ok", publicName, v)
	}
}

// Held in the red-team pass: DNS cannot carry data out. A query for a name
// no rule allows is answered by the node's proxy and never forwarded
// upstream, and a query sent straight to a resolver outside does not get
// through. The fake upstream records every name it is asked.
// freshName is allowed but asked only by checkDNSExfiltration (so no cache
// hides the query from the upstream): the control that the record works.
const freshName = "fresh.sec.test"

func checkDNSExfiltration(t *testing.T, e *env) {
	id := e.create(t, &opendsecv1.SandboxSpec{Network: &opendsecv1.NetworkPolicy{Allow: []*opendsecv1.NetworkRule{
		{Domain: publicName, Protocol: "tcp", Ports: "8080"},
		{Domain: freshName, Protocol: "tcp", Ports: "8080"},
	}}})
	e.withProbe(t, id)
	e.dns.drainAsked()
	secret := "c2VjcmV0LWRhdGE." + exfilZone
	got := e.runProbe(t, id, "", "lookup", secret, "x."+secret, publicName, freshName)
	if v := got["lookup "+secret]; !strings.Contains(v, "no such host") && !strings.Contains(v, "server misbehaving") {
		t.Errorf("lookup of a name no rule allows: %q, want it refused", v)
	}
	if v := got["lookup "+publicName]; v != harness.InetIP {
		t.Fatalf("lookup %s: %q; the proxy does not forward even allowed names", publicName, v)
	}
	// Straight to the upstream (an address the sandbox may reach on 8080
	// only).
	if v := e.runProbe(t, id, "", "dns-direct", harness.InetIP+":53", "y."+secret)["dns-direct"]; v == "ok" {
		t.Errorf("a DNS query sent straight to %s:53 was answered", harness.InetIP)
	}
	asked := e.dns.drainAsked()
	for _, n := range asked {
		if strings.Contains(n, exfilZone) {
			t.Errorf("the upstream was asked %q", n)
		}
	}
	if !strings.Contains(strings.Join(asked, " "), freshName) {
		t.Errorf("the upstream saw no query for the allowed %s (%v); the check would miss a leak", freshName, asked)
	}
}
