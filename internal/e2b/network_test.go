package e2b

import (
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
		{"default allows everything", nil, nil, nil, []string{"0.0.0.0/0"}, true},
		{"no internet denies all", &f, nil, nil, []string{"0.0.0.0/32"}, false},
		{"deny all but some", nil, []string{"1.1.1.1", "pypi.org", "*.example.com"}, []string{"0.0.0.0/0"}, []string{"1.1.1.1/32", "pypi.org", "*.example.com"}, false},
		{"no internet plus allow", &f, []string{"10.1.0.0/16"}, nil, []string{"10.1.0.0/16"}, false},
		{"deny one range", nil, nil, []string{"128.0.0.0/1"}, []string{"0.0.0.0/1"}, true},
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
	if pol := h.api.sbs[m["sandboxID"].(string)].GetSpec().GetNetwork(); pol != nil {
		t.Fatalf("no network fields must leave the node default, got %v", pol)
	}
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
	if got := cidrs(h.api.sbs[id].GetSpec().GetNetwork()); w.Code != 204 || strings.Join(got, ",") != "0.0.0.0/0" {
		t.Fatalf("{} must clear every restriction: %d %v", w.Code, got)
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
