package opendsec_test

import (
	"strings"
	"testing"
	"time"

	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestPrewarm(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.PoolRoom = 6
	c := newClient(t, srv)
	ctx := t.Context()
	spec := &opendsec.SandboxSpec{Image: "root/busybox", Cpu: 0.1}
	res, err := c.Prewarm(ctx, spec, 4, opendsec.PrewarmOptions{TTL: 90 * time.Second, Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.GetHeld() != 4 || res.GetReady() != 4 || res.GetReason() != "" || res.GetTtlSeconds() != 90 {
		t.Fatalf("prewarm 4: %v", res)
	}
	res, err = c.Prewarm(ctx, spec, 10, opendsec.PrewarmOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.GetHeld() != 6 || !strings.HasPrefix(res.GetReason(), "capacity:") {
		t.Fatalf("prewarm 10 with room for 6: %v", res)
	}
	got := srv.Prewarms()
	if len(got) != 2 || got[0].GetCount() != 4 || got[0].GetTtlSeconds() != 90 || !got[0].GetWait() || got[0].GetSpec().GetCpu() != 0.1 || got[1].GetTtlSeconds() != 0 {
		t.Fatalf("server got %v", got)
	}
	for _, tc := range []struct {
		field string
		spec  *opendsec.SandboxSpec
		count int
		opts  opendsec.PrewarmOptions
	}{
		{"count", spec, 0, opendsec.PrewarmOptions{}},
		{"count", spec, 2000, opendsec.PrewarmOptions{}}, // the server's bound
		{"spec", nil, 1, opendsec.PrewarmOptions{}},
		{"spec.image", &opendsec.SandboxSpec{}, 1, opendsec.PrewarmOptions{}},
		{"ttl", spec, 1, opendsec.PrewarmOptions{TTL: -time.Second}},
	} {
		_, err := c.Prewarm(ctx, tc.spec, tc.count, tc.opts)
		if !opendsec.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), tc.field+":") && !strings.Contains(err.Error(), " "+tc.field+":") {
			t.Errorf("prewarm %d %v: %v; want invalid naming %s", tc.count, tc.opts, err, tc.field)
		}
	}
}
