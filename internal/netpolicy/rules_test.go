package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func TestValidateRule(t *testing.T) {
	good := []Rule{
		{CIDR: "10.0.0.0/8"},
		{CIDR: "192.0.2.7", Protocol: "udp", Ports: "53"},
		{CIDR: "0.0.0.0/0", Protocol: "TCP", Ports: "1-65535"},
		{Domain: "pypi.org", Protocol: "tcp", Ports: "443"},
		{Domain: "*.Pythonhosted.org."},
		{CIDR: "198.51.100.0/24", Protocol: "icmp"},
	}
	for _, r := range good {
		if _, err := validateRule("allow[0]", r); err != nil {
			t.Errorf("%+v: %v", r, err)
		}
	}
	bad := map[string]Rule{
		"allow[0].cidr":     {CIDR: "10.0.0.0/33"},
		"allow[0].domain":   {Domain: "a b.test"},
		"allow[0].ports":    {CIDR: "10.0.0.0/8", Ports: "65536"},
		"allow[0].protocol": {CIDR: "10.0.0.0/8", Protocol: "gre"},
		"allow[0]":          {},
	}
	for field, r := range bad {
		_, err := validateRule("allow[0]", r)
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), field+":") {
			t.Errorf("%+v: %v, want invalid %s", r, err, field)
		}
	}
	for _, d := range []string{"*.", "a..b", "*.*.a.test", strings.Repeat("a", 64) + ".test", "a/b"} {
		if _, err := validateRule("x", Rule{Domain: d}); err == nil {
			t.Errorf("domain %q accepted", d)
		}
	}
}

func TestDomainMatch(t *testing.T) {
	exact, _ := validateRule("x", Rule{Domain: "api.example.test"})
	wild, _ := validateRule("x", Rule{Domain: "*.example.test"})
	cases := []struct {
		r    rule
		name string
		want bool
	}{
		{exact, "api.example.test", true},
		{exact, "evil.example.test", false},
		{exact, "x.api.example.test", false},
		{wild, "a.b.example.test", true},
		{wild, "example.test", false},
		{wild, "badexample.test", false},
	}
	for _, c := range cases {
		if got := c.r.matches(c.name); got != c.want {
			t.Errorf("%q matches %q = %v", c.r.domain, c.name, got)
		}
	}
}

func TestResolveRuleSets(t *testing.T) {
	sets := map[string][]Rule{"pypi": {{Domain: "pypi.org"}, {Domain: "*.pythonhosted.org"}}}
	rs, err := resolve(Rules{RuleSets: []string{"pypi", "pypi"}, Allow: []Rule{{CIDR: "10.0.0.1"}}}, sets)
	if err != nil || len(rs) != 3 {
		t.Fatalf("resolve: %v %d rules", err, len(rs))
	}
	_, err = resolve(Rules{RuleSets: []string{"npm"}}, sets)
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "known: pypi") {
		t.Errorf("unknown rule set: %v", err)
	}
	if err := ValidateRuleSets(map[string][]Rule{"bad": {{CIDR: "x"}}}); err == nil || !strings.HasPrefix(err.Error(), "rule_sets.bad[0].cidr") {
		t.Errorf("ValidateRuleSets: %v", err)
	}
}

func TestConfigValidate(t *testing.T) {
	base := Config{}.withDefaults("/var/lib/opendsec")
	if err := base.Validate(); err != nil {
		t.Fatal(err)
	}
	for field, mut := range map[string]func(*Config){
		"network.pool":              func(c *Config) { c.Pool = "100.96.0.1/12" },
		"network.pool outside":      func(c *Config) { c.Pool = "10.0.0.0/16" },
		"network.pool wider":        func(c *Config) { c.Pool = "100.0.0.0/8" },
		"network.dns_upstream":      func(c *Config) { c.Upstream = []string{"dns.example"} },
		"network.default_rule_sets": func(c *Config) { c.DefaultRuleSets = []string{"nope"} },
		"network.netns_dir":         func(c *Config) { c.NetNSDir = "rel" },
	} {
		c := base
		mut(&c)
		if err := c.Validate(); err == nil || !strings.HasPrefix(err.Error(), strings.Fields(field)[0]) {
			t.Errorf("%s: %v", field, err)
		}
	}
}

func TestAllocatorPersists(t *testing.T) {
	dir := t.TempDir()
	pool := netip.MustParsePrefix("100.96.0.0/29") // indices 1..3
	a, err := newAllocator(dir, pool)
	if err != nil {
		t.Fatal(err)
	}
	i1, _ := a.alloc("s1")
	i2, _ := a.alloc("s2")
	gw, sb := a.pair(i1)
	if gw.String() != "100.96.0.2" || sb.String() != "100.96.0.3" || a.dnsAddr().String() != "100.96.0.1" {
		t.Errorf("pair(%d) = %v %v, dns %v", i1, gw, sb, a.dnsAddr())
	}
	if a.indexOf(sb) != i1 || a.indexOf(gw) != -1 {
		t.Errorf("indexOf")
	}
	// A restarted node (a new allocator) never hands out a used index.
	b, _ := newAllocator(dir, pool)
	i3, err := b.alloc("s3")
	if err != nil || i3 == i1 || i3 == i2 {
		t.Fatalf("after restart got %d (%v), used %d %d", i3, err, i1, i2)
	}
	if _, err := b.alloc("s4"); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("4th address from a pool of 3: %v, want resource exhausted", err)
	}
	if err := b.release(i1, "other"); err != nil {
		t.Fatal(err)
	}
	if all, _ := b.list(); all[i1] != "s1" {
		t.Error("release by a non-owner freed the address")
	}
	b.release(i1, "s1")
	if i, err := b.alloc("s5"); err != nil || i != i1 {
		t.Errorf("freed index not reused: %d %v", i, err)
	}
}

// TestAllocatorRecords: an allocation holding a JSON record (the
// sandbox's network state) belongs to the record's id; a torn record to
// nobody, so a restart never frees another sandbox's address by it.
func TestAllocatorRecords(t *testing.T) {
	dir := t.TempDir()
	a, err := newAllocator(dir, netip.MustParsePrefix("100.96.0.0/29"))
	if err != nil {
		t.Fatal(err)
	}
	var gotIdx int
	i1, err := a.allocWith("s1", func(idx int) ([]byte, error) {
		gotIdx = idx
		return []byte(fmt.Sprintf(`{"id":"s1","index":%d}`, idx)), nil
	})
	if err != nil || i1 != gotIdx {
		t.Fatalf("allocWith = %d, %v; record made for %d", i1, err, gotIdx)
	}
	if b, _ := os.ReadFile(a.path(i1)); !strings.Contains(string(b), `"index":`+strconv.Itoa(i1)) {
		t.Errorf("allocation file holds %q, want the record", b)
	}
	i2, _ := a.alloc("s2")
	if err := os.WriteFile(filepath.Join(dir, "3"), []byte(`{"id":"s3`), 0o600); err != nil {
		t.Fatal(err)
	}
	all, err := a.list()
	if err != nil || all[i1] != "s1" || all[i2] != "s2" || all[3] != "" {
		t.Fatalf("list = %v, %v", all, err)
	}
	if err := a.release(i1, "s2"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a.path(i1)); err != nil {
		t.Error("release by a non-owner freed a record")
	}
	if err := a.release(i1, "s1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a.path(i1)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("release by the owner left the record: %v", err)
	}
	if _, err := a.allocWith("s4", func(int) ([]byte, error) { return nil, errors.New("boom") }); err == nil {
		t.Error("allocWith succeeded with a failing record")
	}
}

func fromSet(r rule) rule { r.fromSet = true; return r }

func TestFlowPolicy(t *testing.T) {
	must := func(r Rule) rule {
		v, err := validateRule("x", r)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	pool := netip.MustParsePrefix("100.96.0.0/12")
	now := time.Now()
	p := flowPolicy{
		rules: []rule{must(Rule{CIDR: "10.0.0.0/8", Protocol: "tcp", Ports: "80-90"}), must(Rule{Domain: "*.example.test", Ports: "443"}),
			must(Rule{CIDR: "0.0.0.0/0", Protocol: "udp"}), must(Rule{CIDR: "169.254.169.254", Protocol: "tcp", Ports: "80"}),
			must(Rule{CIDR: "100.96.0.0/24", Protocol: "tcp", Ports: "8080"}), fromSet(must(Rule{CIDR: "100.96.1.0/24", Protocol: "tcp"})),
			fromSet(must(Rule{CIDR: "169.254.10.0/24", Protocol: "tcp"})), must(Rule{CIDR: "169.254.0.20/30", Protocol: "tcp"}),
			fromSet(must(Rule{CIDR: "169.254.0.21", Protocol: "udp", Ports: "7"}))},
		learned:  []learned{{name: "a.example.test", addr: netip.MustParseAddr("192.0.2.1"), expires: now.Add(time.Minute)}},
		dns:      netip.MustParseAddr("100.96.0.1"),
		pool:     pool,
		explicit: func(r rule) bool { return protectedExplicit(pool, r) },
	}
	cases := []struct {
		dst   string
		proto uint8
		port  uint16
		want  bool
	}{
		{"10.1.2.3", 6, 85, true},
		{"10.1.2.3", 6, 91, false},
		{"192.0.2.1", 6, 443, true},
		{"192.0.2.1", 17, 443, true},
		{"192.0.2.1", 6, 80, false},
		{"192.0.2.2", 6, 443, false},
		{"100.96.0.1", 17, 53, true},
		{"100.96.0.5", 17, 53, false},      // another sandbox, despite 0.0.0.0/0 udp
		{"169.254.169.254", 17, 53, false}, // metadata
		{"169.254.169.254", 6, 80, true},   // metadata, by a rule inside link-local
		{"169.254.169.254", 6, 81, false},
		{"8.8.8.8", 17, 53, true},
		{"100.96.0.7", 6, 8080, true},    // a sandbox, by a caller's rule inside the pool
		{"100.96.0.4", 6, 8080, false},   // the node at a gateway: a caller's rule never opens it
		{"100.96.0.1", 6, 8080, false},   // nor the DNS address on another port
		{"100.96.1.2", 6, 8080, true},    // a rule set opens the node at a gateway
		{"169.254.10.1", 6, 8080, true},  // and link-local, like a caller's rule
		{"169.254.0.22", 6, 8080, false}, // the guest's gateway: a caller's rule never opens it
		{"169.254.0.21", 17, 7, true},    // a rule set may
	}
	for _, c := range cases {
		if got := p.allows(netip.MustParseAddr(c.dst), c.proto, c.port, now); got != c.want {
			t.Errorf("%s proto %d port %d: %v, want %v", c.dst, c.proto, c.port, got, c.want)
		}
	}
}

func TestProtectedExplicit(t *testing.T) {
	pool := netip.MustParsePrefix("100.96.0.0/12")
	for cidr, want := range map[string]bool{
		"169.254.169.254/32": true,
		"169.254.0.0/16":     true,
		"169.254.128.0/17":   true,
		"100.96.0.4/32":      true,
		"100.96.0.0/12":      true,
		"100.104.0.0/13":     true,
		// Covering a protected range, or being one address, is no opt-in.
		"0.0.0.0/0":      false,
		"0.0.0.0/1":      false,
		"128.0.0.0/1":    false,
		"169.254.0.0/15": false,
		"100.64.0.0/10":  false,
		"198.18.0.1/32":  false,
		"8.8.8.8/32":     false,
	} {
		r, err := validateRule("x", Rule{CIDR: cidr})
		if err != nil {
			t.Fatal(err)
		}
		if got := protectedExplicit(pool, r); got != want {
			t.Errorf("%s: protectedExplicit = %v, want %v", cidr, got, want)
		}
	}
}
