package opendsec_test

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestNetworkPolicy(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	ctx := t.Context()

	want := &opendsecv1.NetworkPolicy{
		RuleSets: []string{"pypi"},
		Allow:    []*opendsecv1.NetworkRule{{Cidr: "10.0.0.0/8", Protocol: "tcp", Ports: "443"}},
	}
	sb, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox", Network: want})
	if err != nil {
		t.Fatal(err)
	}
	if got := sb.GetSpec().GetNetwork(); !proto.Equal(got, want) {
		t.Fatalf("created spec.network = %v, want %v", got, want)
	}

	next := &opendsecv1.NetworkPolicy{Allow: []*opendsecv1.NetworkRule{{Domain: "pypi.org", Ports: "443"}}}
	upd, err := c.SetNetwork(ctx, sb.Id, next)
	if err != nil {
		t.Fatal(err)
	}
	if got := upd.GetSpec().GetNetwork(); !proto.Equal(got, next) {
		t.Fatalf("set network returned %v, want %v", got, next)
	}
	got, err := c.GetSandbox(ctx, sb.Id)
	if err != nil || !proto.Equal(got.GetSpec().GetNetwork(), next) {
		t.Fatalf("get after set network = %v, %v", got.GetSpec().GetNetwork(), err)
	}

	bad := &opendsecv1.NetworkPolicy{Allow: []*opendsecv1.NetworkRule{{Cidr: "10.0.0.300/8"}}}
	if _, err := c.SetNetwork(ctx, sb.Id, bad); !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "network.allow[0].cidr") {
		t.Fatalf("bad cidr: %v", err)
	}
	got, err = c.GetSandbox(ctx, sb.Id)
	if err != nil || !proto.Equal(got.GetSpec().GetNetwork(), next) {
		t.Fatalf("a refused policy changed the sandbox: %v, %v", got.GetSpec().GetNetwork(), err)
	}

	upd, err = c.SetNetwork(ctx, sb.Id, nil)
	if err != nil || upd.GetSpec().GetNetwork() == nil || len(upd.GetSpec().GetNetwork().GetAllow()) != 0 {
		t.Fatalf("nil policy = %v, %v; want an empty (deny-all) policy", upd.GetSpec().GetNetwork(), err)
	}
	if _, err := c.SetNetwork(ctx, "nosuch", next); !opendsec.IsNotFound(err) {
		t.Fatalf("unknown sandbox: %v", err)
	}
	if _, err := c.SetNetwork(ctx, "", next); !opendsec.IsInvalidArgument(err) {
		t.Fatalf("empty id: %v", err)
	}
}
