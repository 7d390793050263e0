package cli

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestCreateWithNetwork(t *testing.T) {
	srv := opendsectest.New(t, token)
	createOne(t, srv, "--rule-set", "pypi", "--rule-set", "npm",
		"--allow", "10.0.0.0/8:443/tcp", "--allow", "192.0.2.7/icmp", "--allow", "198.51.100.0/24",
		"--allow-domain", "pypi.org:443", "--allow-domain", "*.example.com:8000-8100/udp")
	want := &opendsecv1.NetworkPolicy{
		RuleSets: []string{"pypi", "npm"},
		Allow: []*opendsecv1.NetworkRule{
			{Cidr: "10.0.0.0/8", Ports: "443", Protocol: "tcp"},
			{Cidr: "192.0.2.7", Protocol: "icmp"},
			{Cidr: "198.51.100.0/24"},
			{Domain: "pypi.org", Ports: "443"},
			{Domain: "*.example.com", Ports: "8000-8100", Protocol: "udp"},
		},
	}
	if got := srv.Sandboxes()[0].GetSpec().GetNetwork(); !proto.Equal(got, want) {
		t.Fatalf("spec.network sent = %v\nwant %v", got, want)
	}

	createOne(t, srv)
	if got := srv.Sandboxes()[1].GetSpec(); got.Network != nil {
		t.Fatalf("create without network flags sent network %v; want it unset (node default)", got.Network)
	}
}

func TestSetNetwork(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv, "--rule-set", "pypi")

	r := mustRun(t, srv, "", "sandbox", "set-network", id, "--allow", "10.1.0.0/16:22", "--allow-domain", "example.com")
	if want := id + " network: 10.1.0.0/16:22, example.com\n"; r.stdout != want {
		t.Fatalf("set-network printed %q, want %q", r.stdout, want)
	}
	want := &opendsecv1.NetworkPolicy{Allow: []*opendsecv1.NetworkRule{{Cidr: "10.1.0.0/16", Ports: "22"}, {Domain: "example.com"}}}
	if got := srv.Sandboxes()[0].GetSpec().GetNetwork(); !proto.Equal(got, want) {
		t.Fatalf("network after set-network = %v, want %v", got, want)
	}

	// A rule the server refuses changes nothing and names the field.
	r = run(t, srv, "", "sandbox", "set-network", id, "--allow", "10.0.0.300/8")
	if r.code != 1 || !strings.Contains(r.stderr, "network.allow[0].cidr") {
		t.Fatalf("bad cidr: %+v", r)
	}
	if got := srv.Sandboxes()[0].GetSpec().GetNetwork(); !proto.Equal(got, want) {
		t.Fatalf("a refused set-network changed the policy to %v", got)
	}

	r = mustRun(t, srv, "", "sandbox", "set-network", id, "--deny-all")
	if r.stdout != id+" network: none (everything denied)\n" {
		t.Fatalf("deny-all printed %q", r.stdout)
	}
	if got := srv.Sandboxes()[0].GetSpec().GetNetwork(); got == nil || len(got.GetAllow())+len(got.GetRuleSets()) != 0 {
		t.Fatalf("network after --deny-all = %v, want an empty policy", got)
	}
}

func TestNetworkBadFlags(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"sandbox", "create", "--image", "root/busybox", "--allow", "10.0.0.0/8:443/sctp"}, `--allow: "10.0.0.0/8:443/sctp" has protocol "sctp"; use tcp, udp or icmp`},
		{[]string{"sandbox", "create", "--image", "root/busybox", "--allow", "10.0.0.0/8:"}, `--allow: "10.0.0.0/8:" has an empty port`},
		{[]string{"sandbox", "create", "--image", "root/busybox", "--allow-domain", ":443"}, `--allow-domain: ":443" names no address`},
		{[]string{"sandbox", "create", "--image", "root/busybox", "--rule-set", ""}, "--rule-set: empty name"},
		{[]string{"sandbox", "set-network", id}, "give rules (--allow, --allow-domain, --rule-set) or --deny-all"},
		{[]string{"sandbox", "set-network", id, "--deny-all", "--rule-set", "pypi"}, "not both or neither"},
		{[]string{"sandbox", "set-network", "--deny-all"}, "takes ID"},
	} {
		r := run(t, srv, "", tc.args...)
		if r.code != 1 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 1 and %q", tc.args, r.code, r.stderr, tc.want)
		}
		if r.stdout != "" {
			t.Errorf("%v: printed %q on stdout", tc.args, r.stdout)
		}
	}
	if n := len(srv.Sandboxes()); n != 1 {
		t.Fatalf("bad flags created sandboxes: %d", n)
	}
	if got := srv.Sandboxes()[0].GetSpec().GetNetwork(); got != nil {
		t.Fatalf("bad flags changed the network to %v", got)
	}
}
