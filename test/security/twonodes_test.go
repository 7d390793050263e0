//go:build linux

package security

import (
	"fmt"
	"net/http"
	"slices"
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

// fetch asks addr for its greeting from inside sandbox id.
func fetch(t *testing.T, s *harness.System, id, addr string) (string, error) {
	t.Helper()
	host, port, _ := strings.Cut(addr, ":")
	r := s.Shell(t, id, `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 2 `+host+" "+port+" 2>&1")
	if r.Exit.GetExitCode() != 0 {
		return "", fmt.Errorf("nc %s: exit %d: %s", addr, r.Exit.GetExitCode(), strings.TrimSpace(r.Stdout+r.Stderr))
	}
	return r.Stdout, nil
}

// reaches fails unless sandbox id gets addr's greeting within 2 s.
func reaches(t *testing.T, s *harness.System, id, addr string) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		body, err := fetch(t, s, id, addr)
		if err == nil && strings.HasSuffix(body, "hello "+addr) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s cannot reach %s: %v (body %q)", id, addr, err, body)
		}
	}
}

func blocked(t *testing.T, s *harness.System, id, addr string) {
	t.Helper()
	if body, err := fetch(t, s, id, addr); err == nil {
		t.Fatalf("sandbox %s reached %s (body %q); its policy blocks it", id, addr, body)
	}
}

// hostObjects are a node's veths (by the sandbox IDs in their aliases) and
// whether its table is in the namespace at ns.
func hostObjects(t *testing.T, ns, node string) (veths []string, table bool) {
	t.Helper()
	h, err := netns.GetFromPath(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	nl, err := netlink.NewHandleAt(h)
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	links, err := nl.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range links {
		if a := l.Attrs(); l.Type() == "veth" && strings.HasPrefix(a.Alias, node) {
			veths = append(veths, a.Alias)
		}
	}
	slices.Sort(veths)
	conn, err := nftables.New(nftables.WithNetNSFd(int(h)))
	if err != nil {
		t.Fatal(err)
	}
	tables, err := conn.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		t.Fatal(err)
	}
	table = slices.ContainsFunc(tables, func(tb *nftables.Table) bool { return tb.Name == "opendsec-"+node })
	return veths, table
}

// Finding 9: two OpenDsec nodes on one host, sharing one network namespace
// (the harshest case: nodes in namespaces of their own share less). Each
// runs sandboxes under its own policy; a kill -9 and restart of one (its
// recovery) and its cleanup leave the other's veths, table and sandboxes
// untouched and working.
func TestSecurityTwoNodesOnOneHost(t *testing.T) {
	a := harness.NewWith(t, harness.Options{NodeID: "aaaa", Pool: "100.96.0.0/16"})
	b := harness.NewWith(t, harness.Options{NodeID: "bbbb", NodeNS: a.NodeNS(), Pool: "100.97.0.0/16"})
	inet := harness.MakeInternet(t, a.NodeNS())
	open, shut := harness.InetIP+":8080", harness.InetIP+":8081"
	for _, addr := range []string{open, shut} {
		l := harness.ListenIn(t, inet, addr)
		go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "hello "+addr) }))
	}
	a.Start()
	b.Start()
	spec := func() *opendsecv1.SandboxSpec {
		return &opendsecv1.SandboxSpec{Network: &opendsecv1.NetworkPolicy{
			Allow: []*opendsecv1.NetworkRule{{Cidr: harness.InetIP + "/32", Protocol: "tcp", Ports: "8080"}},
		}}
	}
	sa, sb := a.Create(t, spec()).GetId(), b.Create(t, spec()).GetId()
	if !strings.HasPrefix(sa, "aaaa") || !strings.HasPrefix(sb, "bbbb") {
		t.Fatalf("sandbox IDs %s and %s do not start with their nodes' IDs", sa, sb)
	}
	works := func(when string) {
		t.Helper()
		for _, c := range []struct {
			s  *harness.System
			id string
		}{{a, sa}, {b, sb}} {
			reaches(t, c.s, c.id, open)
			blocked(t, c.s, c.id, shut)
		}
		if v, tb := hostObjects(t, a.NodeNS(), "aaaa"); !slices.Equal(v, []string{sa}) || !tb {
			t.Fatalf("%s: node aaaa has veths of %v, table %v; want %s's and its table", when, v, tb, sa)
		}
	}
	works("both started")

	// Node b dies and comes back: its recovery keeps its own sandbox and
	// leaves a's alone.
	b.Kill9()
	b.Start()
	works("after node bbbb's kill -9 and restart")
	if v, tb := hostObjects(t, a.NodeNS(), "bbbb"); !slices.Equal(v, []string{sb}) || !tb {
		t.Fatalf("node bbbb after its restart has veths of %v, table %v; want %s's and its table", v, tb, sb)
	}

	// Node b's sandbox stops: only its network goes.
	if _, err := b.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: sb})); err != nil {
		t.Fatalf("stop %s: %v", sb, err)
	}
	// The network goes with the stop's background teardown.
	for deadline := time.Now().Add(10 * time.Second); ; {
		v, _ := hostObjects(t, a.NodeNS(), "bbbb")
		if len(v) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("node bbbb's veths 10 s after its sandbox stopped: %v", v)
			break
		}
		time.Sleep(20 * time.Millisecond) // polling the node's background teardown
	}
	reaches(t, a, sa, open)
	blocked(t, a, sa, shut)
	if v, tb := hostObjects(t, a.NodeNS(), "aaaa"); !slices.Equal(v, []string{sa}) || !tb {
		t.Fatalf("after node bbbb's stop node aaaa has veths of %v, table %v", v, tb)
	}
}
