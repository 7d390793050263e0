package apiserver_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
)

func withAllow(rules ...*v1.NetworkRule) *v1.SandboxSpec {
	s := busybox()
	s.Network = &v1.NetworkPolicy{Allow: rules}
	return s
}

func batchErr(t *testing.T, c opendsecv1connect.SandboxServiceClient, spec *v1.SandboxSpec) error {
	t.Helper()
	st, err := c.BatchCreateSandboxes(t.Context(), connect.NewRequest(&v1.BatchCreateSandboxesRequest{Spec: spec, Count: 2}))
	if err != nil {
		return err
	}
	defer st.Close()
	for st.Receive() {
		if m := st.Msg(); m.GetErrorCode() != "" {
			return errors.New(m.GetErrorMessage())
		}
	}
	return st.Err()
}

// wantAdminNeeded asserts err is permission_denied naming field and saying
// an admin token is needed.
func wantAdminNeeded(t *testing.T, what string, err error, field string) {
	t.Helper()
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodePermissionDenied ||
		!strings.HasPrefix(ce.Message(), field+":") || !strings.Contains(ce.Message(), "admin token") {
		t.Fatalf("%s: %v, want permission_denied naming %s and saying an admin token is needed", what, err, field)
	}
}

// TestNetworkProtectedRangesNeedAdmin checks a user token cannot open cloud
// metadata or the sandbox pools with an allow rule on CreateSandbox,
// BatchCreateSandboxes or SetNetwork: each is refused naming the rule and
// nothing reaches the node; broad rules and rule sets stay open to users;
// an admin token opens the protected ranges.
func TestNetworkProtectedRangesNeedAdmin(t *testing.T) {
	e := setup(t, nil, "n001")
	ctx := t.Context()
	adminTok, err := e.key.Issue("root", auth.ScopeAdmin, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	admin := opendsecv1connect.NewSandboxServiceClient(auth.Client(e.hc, adminTok), e.url, connect.WithGRPC())
	n := e.nodes[0]
	web := &v1.NetworkRule{Domain: "pypi.org", Protocol: "tcp", Ports: "443"}
	sb := e.create(busybox())

	for _, cidr := range []string{"169.254.169.254", "169.254.169.254/32", "169.254.0.0/16", "100.96.0.1", "100.96.0.0/12", "100.64.0.0/10", "100.127.255.0/24"} {
		rule := &v1.NetworkRule{Cidr: cidr, Protocol: "tcp", Ports: "80"}
		spec := withAllow(web, rule)
		creates, live := n.count()
		_, err := e.sbx.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{Spec: spec}))
		wantAdminNeeded(t, "user create "+cidr, err, "network.allow[1]")
		wantAdminNeeded(t, "user batch create "+cidr, batchErr(t, e.sbx, spec), "network.allow[1]")
		_, err = e.sbx.SetNetwork(ctx, connect.NewRequest(&v1.SetNetworkRequest{Id: sb.GetId(), Network: spec.GetNetwork()}))
		wantAdminNeeded(t, "user set network "+cidr, err, "network.allow[1]")
		if c, l := n.count(); c != creates || l != live {
			t.Fatalf("refused %s: the node saw %d creates and holds %d sandboxes, before %d and %d", cidr, c, l, creates, live)
		}
	}

	// Rules that do not lie inside a protected range, and rule sets (the
	// administrator's), are the node's to check.
	for _, np := range []*v1.NetworkPolicy{
		{Allow: []*v1.NetworkRule{{Cidr: "0.0.0.0/0"}}},
		{Allow: []*v1.NetworkRule{{Cidr: "0.0.0.0/1"}, {Cidr: "128.0.0.0/1"}}},
		{Allow: []*v1.NetworkRule{{Cidr: "169.254.0.0/15", Protocol: "tcp", Ports: "443"}, {Cidr: "100.0.0.0/8"}}},
		{Allow: []*v1.NetworkRule{{Cidr: "203.0.113.7"}, web}},
		{RuleSets: []string{"metadata"}},
	} {
		spec := busybox()
		spec.Network = np
		resp, err := e.sbx.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{Spec: spec}))
		if err != nil {
			t.Fatalf("user create with %v: %v", np, err)
		}
		if _, err := e.sbx.StopSandbox(ctx, connect.NewRequest(&v1.StopSandboxRequest{Id: resp.Msg.GetSandbox().GetId()})); err != nil {
			t.Fatal(err)
		}
	}
	e.refresh()

	// An admin opens metadata.
	md := withAllow(&v1.NetworkRule{Cidr: "169.254.169.254", Protocol: "tcp", Ports: "80"})
	resp, err := admin.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{Spec: md}))
	if err != nil {
		t.Fatalf("admin create with a metadata rule: %v", err)
	}
	if got := resp.Msg.GetSandbox().GetSpec().GetNetwork().GetAllow(); len(got) != 1 || got[0].GetCidr() != "169.254.169.254" {
		t.Fatalf("admin create: the node got allow %v", got)
	}
	if err := batchErr(t, admin, md); err != nil {
		t.Fatalf("admin batch create with a metadata rule: %v", err)
	}
	// The fake node has no SetNetwork: its unimplemented answer shows the
	// admin's call got past the apiserver.
	_, err = admin.SetNetwork(ctx, connect.NewRequest(&v1.SetNetworkRequest{Id: sb.GetId(), Network: md.GetNetwork()}))
	if connect.CodeOf(err) == connect.CodePermissionDenied {
		t.Fatalf("admin set network with a metadata rule: %v", err)
	}
}
