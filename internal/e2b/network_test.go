package e2b

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

func cidrs(p *v1.NetworkPolicy) []string {
	var out []string
	for _, r := range p.GetAllow() {
		out = append(out, r.GetCidr()+r.GetDomain())
	}
	return out
}

func TestComplementCoversAllButExcluded(t *testing.T) {
	deny := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.0.2.7/32")}
	got := complement(netip.MustParsePrefix("0.0.0.0/0"), deny)
	if len(got) > 64 {
		t.Fatalf("complement has %d prefixes", len(got))
	}
	in := func(a string) bool {
		for _, p := range got {
			if p.Contains(netip.MustParseAddr(a)) {
				return true
			}
		}
		return false
	}
	for _, a := range []string{"10.0.0.1", "10.255.255.255", "192.0.2.7"} {
		if in(a) {
			t.Errorf("%s is denied but in the complement %v", a, got)
		}
	}
	for _, a := range []string{"0.0.0.0", "9.255.255.255", "11.0.0.0", "192.0.2.6", "192.0.2.8", "255.255.255.255", "8.8.8.8"} {
		if !in(a) {
			t.Errorf("%s is not denied but missing from the complement %v", a, got)
		}
	}
	if got := complement(netip.MustParsePrefix("0.0.0.0/0"), nil); len(got) != 1 || got[0].String() != "0.0.0.0/0" {
		t.Fatalf("complement of nothing = %v", got)
	}
}

// publicInternet is E2B's "all egress" as prefixes: everything but the
// reserved and private ranges.
func publicInternet() []string {
	var out []string
	for _, p := range complement(netip.MustParsePrefix("0.0.0.0/0"), notInternet) {
		out = append(out, p.String())
	}
	return out
}

// All egress means the public internet: public addresses in, private,
// reserved and sandbox-pool addresses out.
func TestPublicInternet(t *testing.T) {
	got := publicInternet()
	if len(got) > 64 {
		t.Fatalf("%d rules for the public internet", len(got))
	}
	in := func(a string) bool {
		for _, s := range got {
			if netip.MustParsePrefix(s).Contains(netip.MustParseAddr(a)) {
				return true
			}
		}
		return false
	}
	for _, a := range []string{"1.1.1.1", "8.8.8.8", "151.101.0.223", "198.18.0.2", "203.0.113.9", "172.32.0.1", "192.169.0.1", "223.255.255.255"} {
		if !in(a) {
			t.Errorf("public %s is not allowed", a)
		}
	}
	for _, a := range []string{"10.0.0.1", "172.16.5.5", "172.31.255.255", "192.168.1.1", "169.254.169.254", "100.96.0.1", "100.64.0.1", "127.0.0.1", "0.1.2.3", "224.0.0.1", "255.255.255.255"} {
		if in(a) {
			t.Errorf("%s is allowed; it is not on the public internet", a)
		}
	}
}

func TestEgressPolicy(t *testing.T) {
	f := false
	for _, c := range []struct {
		name            string
		internet        *bool
		allow           []string
		deny            []string
		want            []string // exact allow list; nil: check wantFn only
		internetAllowed bool
	}{
		{"default allows the public internet", nil, nil, nil, publicInternet(), true},
		{"no internet denies all", &f, nil, nil, []string{"0.0.0.0/32"}, false},
		{"deny all but some", nil, []string{"1.1.1.1", "pypi.org", "*.example.com"}, []string{"0.0.0.0/0"}, []string{"1.1.1.1/32", "pypi.org", "*.example.com"}, false},
		{"no internet plus allow", &f, []string{"10.1.0.0/16"}, nil, []string{"10.1.0.0/16"}, false},
		{"deny one range", nil, nil, []string{"128.0.0.0/1"}, []string{"1.0.0.0/8", "2.0.0.0/7", "4.0.0.0/6", "8.0.0.0/7", "11.0.0.0/8", "12.0.0.0/6", "16.0.0.0/4", "32.0.0.0/3", "64.0.0.0/3", "96.0.0.0/6", "100.0.0.0/10", "100.128.0.0/9", "101.0.0.0/8", "102.0.0.0/7", "104.0.0.0/5", "112.0.0.0/5", "120.0.0.0/6", "124.0.0.0/7", "126.0.0.0/8"}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, err := egressPolicy("network.", c.internet, c.allow, c.deny)
			if err != nil {
				t.Fatal(err)
			}
			if strings.Join(cidrs(p), ",") != strings.Join(c.want, ",") {
				t.Fatalf("allow = %v; want %v", cidrs(p), c.want)
			}
			if got := *internetAllowed(p); got != c.internetAllowed {
				t.Fatalf("internetAllowed = %v", got)
			}
		})
	}
	for _, c := range []struct {
		allow, deny []string
		field       string
	}{
		{nil, []string{"example.com"}, "network.denyOut[0]"},
		{nil, []string{"::/0"}, "network.denyOut[0]"},
		{[]string{"pypi.org"}, nil, "network.allowOut[0]"}, // a domain while all egress is allowed
		{[]string{"1.2.3.4", "not a domain!"}, []string{"0.0.0.0/0"}, "network.allowOut[1]"},
		{make([]string, 65), nil, "network.allowOut"},
	} {
		_, err := egressPolicy("network.", nil, c.allow, c.deny)
		if err == nil || !strings.HasPrefix(err.Error(), c.field+":") {
			t.Errorf("allow %v deny %v: err %v; want one naming %s", c.allow, c.deny, err, c.field)
		}
	}
}

func TestCreateAndUpdateNetwork(t *testing.T) {
	h := newHarness(t)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if got := cidrs(h.api.sbs[m["sandboxID"].(string)].GetSpec().GetNetwork()); strings.Join(got, ",") != strings.Join(publicInternet(), ",") {
		t.Fatalf("no network fields must allow the public internet (E2B's default), got %v", got)
	}
	if _, m := h.do(h.keyA, "GET", "/sandboxes/"+m["sandboxID"].(string), ""); m["allowInternetAccess"] != true {
		t.Fatalf("detail allowInternetAccess = %v", m["allowInternetAccess"])
	}
	// The operator's e2b.default_internet_access: false keeps the node's
	// default rule sets.
	h.gw.cfg.DenyInternetByDefault = true
	_, m = h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if pol := h.api.sbs[m["sandboxID"].(string)].GetSpec().GetNetwork(); pol != nil {
		t.Fatalf("default_internet_access false must leave the node default, got %v", pol)
	}
	h.gw.cfg.DenyInternetByDefault = false
	_, m = h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","allow_internet_access":false}`)
	id := m["sandboxID"].(string)
	if got := cidrs(h.api.sbs[id].GetSpec().GetNetwork()); strings.Join(got, ",") != "0.0.0.0/32" {
		t.Fatalf("allow_internet_access false: %v", got)
	}
	if _, m := h.do(h.keyA, "GET", "/sandboxes/"+id, ""); m["allowInternetAccess"] != false {
		t.Fatalf("detail allowInternetAccess = %v", m["allowInternetAccess"])
	}
	w, _ := h.do(h.keyA, "PUT", "/sandboxes/"+id+"/network", `{"allowOut":["pypi.org"],"denyOut":["0.0.0.0/0"]}`)
	if w.Code != http.StatusNoContent {
		t.Fatalf("update: %d %s", w.Code, w.Body)
	}
	if got := cidrs(h.api.sbs[id].GetSpec().GetNetwork()); strings.Join(got, ",") != "pypi.org" {
		t.Fatalf("after update: %v", got)
	}
	// Bad updates and other principals change nothing.
	for _, c := range []struct {
		key, body string
		status    int
	}{
		{h.keyA, `{"denyOut":["nope"]}`, 400},
		{h.keyA, `{"egressProxy":{"address":"1.2.3.4:1080"}}`, 400},
		{h.keyA, `{"dns_servers":["1.1.1.1"]}`, 400},
		{h.keyA, `{"allowOut":`, 400},
		{h.keyA, `{"allowOut":["169.254.169.254"],"denyOut":["0.0.0.0/0"]}`, 400},
		{h.keyB, `{}`, 404},
	} {
		w, m := h.do(c.key, "PUT", "/sandboxes/"+id+"/network", c.body)
		if w.Code != c.status || m["code"] != float64(c.status) {
			t.Errorf("PUT %s: %d %s; want %d", c.body, w.Code, w.Body, c.status)
		}
	}
	if got := cidrs(h.api.sbs[id].GetSpec().GetNetwork()); strings.Join(got, ",") != "pypi.org" {
		t.Fatalf("a refused update changed the policy: %v", got)
	}
	w, _ = h.do(h.keyA, "PUT", "/sandboxes/"+id+"/network", `{}`)
	if got := cidrs(h.api.sbs[id].GetSpec().GetNetwork()); w.Code != 204 || strings.Join(got, ",") != strings.Join(publicInternet(), ",") {
		t.Fatalf("{} must clear every restriction (the public internet): %d %v", w.Code, got)
	}
	if w, _ := h.do(h.keyA, "PUT", "/sandboxes/n001aaaaaaaaaaaaaaaa/network", `{}`); w.Code != 404 {
		t.Fatalf("unknown sandbox: %d", w.Code)
	}
	n := len(h.api.sbs)
	w, _ = h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","network":{"denyOut":["300.1.1.1"]}}`)
	if w.Code != 400 || !strings.Contains(w.Body.String(), "network.denyOut[0]") || len(h.api.sbs) != n {
		t.Fatalf("bad network on create: %d %s (%d sandboxes, had %d)", w.Code, w.Body, len(h.api.sbs), n)
	}
}

// covers reports whether any CIDR rule of pol contains a.
func covers(pol *v1.NetworkPolicy, a string) bool {
	for _, r := range pol.GetAllow() {
		if p, err := netip.ParsePrefix(r.GetCidr()); err == nil && p.Contains(netip.MustParseAddr(a)) {
			return true
		}
	}
	return false
}

// The review's reproductions: a denyOut entry next to a protected address
// must not turn into an allow rule that names it (the node lets a rule that
// lies inside link-local or the pool through, as a rule that says so).
func TestEgressPolicyKeepsReservedRangesOut(t *testing.T) {
	reserved := []string{"169.254.169.254", "169.254.0.1", "100.96.0.1", "100.96.0.2", "100.104.0.1", "100.64.0.1", "127.0.0.1", "0.0.0.1", "224.0.0.251", "240.0.0.1", "255.255.255.255"}
	for _, deny := range [][]string{
		{"169.254.169.255"},
		{"100.96.0.0/13"},
		{"100.104.0.0/13", "169.254.0.0/17"},
		{"10.0.0.1"},
		{"128.0.0.0/1"},
		{"8.8.4.4", "198.51.100.0/24"},
	} {
		pol, err := egressPolicy("network.", nil, nil, deny)
		if err != nil {
			t.Fatalf("deny %v: %v", deny, err)
		}
		for _, r := range pol.GetAllow() {
			p := netip.MustParsePrefix(r.GetCidr())
			for _, res := range reservedRanges {
				if p.Overlaps(res) {
					t.Errorf("deny %v: rule %s overlaps %s", deny, p, res)
				}
			}
		}
		for _, a := range reserved {
			if covers(pol, a) {
				t.Errorf("deny %v: %s is allowed", deny, a)
			}
		}
		for _, d := range deny {
			p, _, _ := parseIPv4(d)
			if covers(pol, p.Addr().String()) {
				t.Errorf("deny %v: denied %s is allowed", deny, p.Addr())
			}
		}
	open:
		for _, a := range []string{"1.1.1.1", "100.63.255.255", "100.128.0.1", "169.253.0.1", "169.255.0.1", "203.0.113.9"} {
			for _, d := range deny {
				if p, _, _ := parseIPv4(d); p.Contains(netip.MustParseAddr(a)) {
					continue open
				}
			}
			if !covers(pol, a) {
				t.Errorf("deny %v: %s is neither denied nor reserved but not allowed: %v", deny, a, cidrs(pol))
			}
		}
		if !*internetAllowed(pol) {
			t.Errorf("deny %v: internetAllowed false", deny)
		}
	}
	// allowOut wins over denyOut but is clipped the same way.
	for allow, open := range map[string]string{"0.0.0.0/0": "8.8.8.8", "96.0.0.0/4": "100.128.0.1", "169.0.0.0/8": "169.255.0.1"} {
		pol, err := egressPolicy("network.", nil, []string{allow}, []string{"0.0.0.0/0"})
		if err != nil {
			t.Fatalf("allow %s: %v", allow, err)
		}
		for _, a := range reserved {
			if covers(pol, a) {
				t.Errorf("allow %s: %s is allowed: %v", allow, a, cidrs(pol))
			}
		}
		if !covers(pol, open) {
			t.Errorf("allow %s: %s is not allowed: %v", allow, open, cidrs(pol))
		}
	}
	// An allowOut entry inside a reserved range is refused, naming it, on
	// create and on update alike.
	for _, bad := range []string{"169.254.169.254", "169.254.0.0/16", "100.96.0.0/12", "100.104.0.7", "127.0.0.1", "0.0.0.0", "224.0.0.0/8", "240.1.2.3"} {
		for _, internet := range []*bool{nil, new(bool)} {
			_, err := egressPolicy("network.", internet, []string{"1.2.3.4", bad}, []string{"0.0.0.0/0"})
			if err == nil || !strings.HasPrefix(err.Error(), "network.allowOut[1]:") {
				t.Errorf("allowOut %q: err %v; want one naming network.allowOut[1]", bad, err)
			}
		}
	}
	// A denyOut list whose complement is more than the node takes.
	var many []string
	for i := range 64 {
		many = append(many, fmt.Sprintf("%d.%d.7.1", 1+i, 3*i))
	}
	if _, err := egressPolicy("", nil, nil, many); err == nil || !strings.HasPrefix(err.Error(), "denyOut:") {
		t.Errorf("64 scattered denyOut addresses: err %v; want one naming denyOut", err)
	}
}

func TestCreateRefusesReservedAllowOut(t *testing.T) {
	h := newHarness(t)
	n := len(h.api.sbs)
	w, _ := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","network":{"allowOut":["8.8.8.8","169.254.169.254"],"denyOut":["0.0.0.0/0"]}}`)
	if w.Code != 400 || !strings.Contains(w.Body.String(), "network.allowOut[1]") || len(h.api.sbs) != n {
		t.Fatalf("metadata in allowOut on create: %d %s (%d sandboxes, had %d)", w.Code, w.Body, len(h.api.sbs), n)
	}
}

func TestTrafficAccessToken(t *testing.T) {
	h := newHarness(t)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","network":{"allowPublicTraffic":false}}`)
	id := m["sandboxID"].(string)
	tok, _ := m["trafficAccessToken"].(string)
	if tok == "" || tok != h.gw.trafficToken(id) || tok == h.gw.accessToken(id) {
		t.Fatalf("trafficAccessToken = %v", m["trafficAccessToken"])
	}
	_, pub := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if pub["trafficAccessToken"] != nil {
		t.Fatalf("a public sandbox got a traffic token: %v", pub)
	}
	get := func(id, tok string, port string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("GET", "/", nil)
		req.Header.Set("E2b-Sandbox-Id", id)
		req.Header.Set("E2b-Sandbox-Port", port)
		if tok != "" {
			req.Header.Set("E2b-Traffic-Access-Token", tok)
		}
		w := httptest.NewRecorder()
		h.gw.ServeHTTP(w, req)
		return w
	}
	for _, bad := range []string{"", "wrong", h.gw.accessToken(id)} {
		if w := get(id, bad, "8000"); w.Code != http.StatusForbidden {
			t.Errorf("token %q: %d %s; want 403", bad, w.Code, w.Body)
		}
	}
	// With the token the request goes on to the (unreachable) node: 502,
	// not 403. The public sandbox needs none.
	if w := get(id, tok, "8000"); w.Code != http.StatusBadGateway {
		t.Errorf("with token: %d %s", w.Code, w.Body)
	}
	if w := get(pub["sandboxID"].(string), "", "8000"); w.Code != http.StatusBadGateway {
		t.Errorf("public sandbox: %d %s", w.Code, w.Body)
	}
	w, _ := h.do(h.keyA, "POST", "/sandboxes", `{"templateID":"base","secure":false,"network":{"allowPublicTraffic":false}}`)
	if w.Code != 400 {
		t.Fatalf("private traffic without secure: %d", w.Code)
	}
}

// On a node whose network policy is off, E2B's default internet cannot be
// had: a create that asked for nothing still succeeds (with no network),
// one that asked for a network is refused naming it.
func TestDefaultInternetOnNodeWithoutNetwork(t *testing.T) {
	h := newHarness(t)
	h.api.networkOff = true
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("create with no network option: %d %s", w.Code, w.Body)
	}
	if pol := h.api.sbs[m["sandboxID"].(string)].GetSpec().GetNetwork(); pol != nil {
		t.Fatalf("policy %v on a node without network", pol)
	}
	n := len(h.api.sbs)
	w, m = h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","allow_internet_access":true}`)
	if w.Code != http.StatusBadRequest || !strings.Contains(m["message"].(string), "node.network.enabled") || len(h.api.sbs) != n {
		t.Fatalf("explicit internet on a node without network: %d %s", w.Code, w.Body)
	}
}
