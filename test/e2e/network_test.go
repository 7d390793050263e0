//go:build linux

package e2e

import (
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

// fetch asks the sandbox to GET http://addr/ (2 s connect timeout) and
// returns the response, or an error saying why it failed. (busybox-static's
// wget crashes in glibc's resolver, so this speaks HTTP/1.0 through nc.)
func (s *system) fetch(t *testing.T, id, addr string) (string, error) {
	t.Helper()
	host, port, _ := strings.Cut(addr, ":")
	r := s.shell(t, id, `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 2 `+host+" "+port+" 2>&1")
	if r.exit.GetExitCode() != 0 {
		return "", fmt.Errorf("nc %s: exit %d (%s): %s", addr, r.exit.GetExitCode(), r.exit.GetStatus(), strings.TrimSpace(r.stdout+r.stderr))
	}
	return r.stdout, nil
}

// reaches fails the test unless the sandbox gets addr's greeting within 1 s
// (polled: rule changes must take effect that fast).
func (s *system) reaches(t *testing.T, id, addr string) {
	t.Helper()
	deadline := time.Now().Add(time.Second)
	for {
		body, err := s.fetch(t, id, addr)
		if err == nil && strings.HasSuffix(body, "hello "+addr) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s cannot reach %s: %v (body %q)", id, addr, err, body)
		}
	}
}

// blocked fails the test if the sandbox can reach addr.
func (s *system) blocked(t *testing.T, id, addr string) {
	t.Helper()
	if body, err := s.fetch(t, id, addr); err == nil {
		t.Fatalf("sandbox %s reached %s (body %q); the policy should block it", id, addr, body)
	}
}

// netCounts counts what the network policy made in the node's namespace.
type netCounts struct{ chains, sets, veths, netns int }

func (s *system) netCounts(t *testing.T) netCounts {
	t.Helper()
	s.waitTeardowns(t)
	ns, err := netns.GetFromPath(s.NodeNS())
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	var c netCounts
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		t.Fatal(err)
	}
	chains, err := conn.ListChains()
	if err != nil {
		t.Fatal(err)
	}
	for _, ch := range chains {
		if strings.HasPrefix(ch.Name, "sb-") {
			c.chains++
		}
	}
	tables, err := conn.ListTables()
	if err != nil {
		t.Fatal(err)
	}
	for _, tb := range tables {
		sets, err := conn.GetSets(tb)
		if err != nil {
			t.Fatal(err)
		}
		for _, st := range sets {
			if strings.HasPrefix(st.Name, "sb-") {
				c.sets++
			}
		}
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, "od") {
			c.veths++
		}
	}
	ents, _ := os.ReadDir(s.DataDir() + "/netns")
	c.netns = len(ents)
	return c
}

// TestNetworkPolicy: sandboxes are default-deny; a CIDR+port rule opens
// exactly that; SetNetwork takes effect on a running sandbox within 1 s; bad
// rules are refused and change nothing; after kill -9 and a restart the
// rules still hold and nothing is duplicated.
func TestNetworkPolicy(t *testing.T) {
	s := newSystem(t)
	inet := harness.MakeInternet(t, s.NodeNS())
	a, b := harness.InetIP+":8080", harness.InetIP+":8081"
	for _, addr := range []string{a, b} {
		l := harness.ListenIn(t, inet, addr)
		go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "hello "+addr) }))
	}
	s.Start()

	deny := s.create(t, nil)
	allowA := s.create(t, &opendsecv1.SandboxSpec{Network: &opendsecv1.NetworkPolicy{
		Allow: []*opendsecv1.NetworkRule{{Cidr: harness.InetIP + "/32", Protocol: "tcp", Ports: "8080"}},
	}})
	if got := allowA.GetSpec().GetNetwork().GetAllow(); len(got) != 1 || got[0].GetPorts() != "8080" {
		t.Errorf("created sandbox reports network %v, want the rule it was created with", allowA.GetSpec().GetNetwork())
	}
	s.blocked(t, deny.GetId(), a)
	s.reaches(t, allowA.GetId(), a)
	s.blocked(t, allowA.GetId(), b)
	if r := s.shell(t, deny.GetId(), "cat /etc/resolv.conf"); !strings.HasPrefix(r.stdout, "nameserver ") {
		t.Errorf("resolv.conf = %q, want the node's DNS proxy", r.stdout)
	}

	// Change both while they run.
	t0 := time.Now()
	if _, err := s.Sandboxes().SetNetwork(t.Context(), connect.NewRequest(&opendsecv1.SetNetworkRequest{Id: deny.GetId(), Network: &opendsecv1.NetworkPolicy{
		Allow: []*opendsecv1.NetworkRule{{Cidr: harness.InetIP, Protocol: "tcp", Ports: "8081"}},
	}})); err != nil {
		t.Fatalf("set network: %v", err)
	}
	if _, err := s.Sandboxes().SetNetwork(t.Context(), connect.NewRequest(&opendsecv1.SetNetworkRequest{Id: allowA.GetId()})); err != nil {
		t.Fatalf("set network: %v", err)
	}
	t.Logf("two SetNetwork calls took %v", time.Since(t0))
	s.reaches(t, deny.GetId(), b)
	s.blocked(t, deny.GetId(), a)
	s.blocked(t, allowA.GetId(), a)

	// Bad input names the field and changes nothing.
	_, err := s.Sandboxes().SetNetwork(t.Context(), connect.NewRequest(&opendsecv1.SetNetworkRequest{Id: deny.GetId(), Network: &opendsecv1.NetworkPolicy{
		Allow: []*opendsecv1.NetworkRule{{Cidr: "300.1.2.3/8"}},
	}}))
	wantErr(t, "bad cidr", err, connect.CodeInvalidArgument, "network.allow[0].cidr")
	_, err = s.Sandboxes().SetNetwork(t.Context(), connect.NewRequest(&opendsecv1.SetNetworkRequest{Id: deny.GetId(), Network: &opendsecv1.NetworkPolicy{
		Allow: []*opendsecv1.NetworkRule{{Cidr: harness.InetIP, Ports: "0"}},
	}}))
	wantErr(t, "port 0", err, connect.CodeInvalidArgument, "ports")
	_, err = s.Sandboxes().SetNetwork(t.Context(), connect.NewRequest(&opendsecv1.SetNetworkRequest{Id: deny.GetId(), Network: &opendsecv1.NetworkPolicy{RuleSets: []string{"nope"}}}))
	wantErr(t, "unknown rule set", err, connect.CodeInvalidArgument, "nope")
	before := s.sandboxCount(t)
	_, err = s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{Spec: &opendsecv1.SandboxSpec{Image: "root/busybox", Network: &opendsecv1.NetworkPolicy{
		Allow: []*opendsecv1.NetworkRule{{Domain: "evil .example.test"}},
	}}}))
	wantErr(t, "bad domain", err, connect.CodeInvalidArgument, "network.allow[0].domain")
	if n := s.sandboxCount(t); n != before {
		t.Errorf("a refused create changed the sandbox count: %d → %d", before, n)
	}
	s.reaches(t, deny.GetId(), b)

	want := netCounts{chains: 2, sets: 0, veths: 2, netns: 2}
	if got := s.netCounts(t); got != want {
		t.Errorf("before restart: %+v, want %+v", got, want)
	}
	s.Kill9()
	s.Start()
	if got := s.netCounts(t); got != want {
		t.Errorf("after kill -9 and restart: %+v, want %+v", got, want)
	}
	s.reaches(t, deny.GetId(), b)
	s.blocked(t, deny.GetId(), a)
	s.blocked(t, allowA.GetId(), a)

	for _, sb := range []*opendsecv1.Sandbox{deny, allowA} {
		if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: sb.GetId()})); err != nil {
			t.Fatalf("stop: %v", err)
		}
	}
	if got := s.netCounts(t); got != (netCounts{}) {
		t.Errorf("after stopping every sandbox: %+v left", got)
	}
}
