package node

import (
	"errors"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// TestSecurityPlacementNodeAdmitsItsQuota: the node admits CPU against the
// capacity its Info offers placement (CPUOvercommit times its cores) and
// refuses beyond it; every create and stop returns the node's reservations
// with a used_seq that grows, the reading Info gives at that point.
func TestSecurityPlacementNodeAdmitsItsQuota(t *testing.T) {
	f := newFakeNode(t, func(c *Config) { c.CPU = 1 })
	s := &service{n: f.Node}
	ctx := as("opendsec-apiserver", auth.ScopeNode)
	info := func() *nodev1.InfoResponse {
		resp, err := s.Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		return resp.Msg
	}
	if got := info().GetTotal().GetCpu(); got != CPUOvercommit {
		t.Fatalf("Info offers %g CPU for 1 core; want %d", got, CPUOvercommit)
	}
	create := func() (*nodev1.CreateSandboxResponse, error) {
		resp, err := s.CreateSandbox(ctx, connect.NewRequest(&nodev1.CreateSandboxRequest{
			SandboxId: sandboxid.New("t001"),
			Spec:      &nodev1.SandboxSpec{Image: "root/busybox", Cpu: 1, MemoryMb: proto.Int64(16), TimeoutSeconds: 600},
		}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	seq := info().GetUsedSeq()
	var ids []string
	for i := range CPUOvercommit {
		resp, err := create()
		if err != nil {
			t.Fatalf("create %d of %d: %v", i+1, CPUOvercommit, err)
		}
		if resp.GetUsedSeq() <= seq || resp.GetUsed().GetCpu() != float64(i+1) {
			t.Fatalf("create %d returned used %v at seq %d (before: %d); want %d CPU at a larger seq", i+1, resp.GetUsed(), resp.GetUsedSeq(), seq, i+1)
		}
		seq = resp.GetUsedSeq()
		ids = append(ids, resp.GetSandbox().GetId())
	}
	if in := info(); in.GetUsedSeq() != seq || in.GetUsed().GetCpu() != CPUOvercommit {
		t.Fatalf("Info after the creates: used %v at seq %d; want the last create's reading %d at %d", in.GetUsed(), in.GetUsedSeq(), CPUOvercommit, seq)
	}
	if _, err := create(); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("create beyond the CPU quota: %v; want resource exhausted", err)
	}
	if in := info(); in.GetUsedSeq() != seq {
		t.Fatalf("a refused create moved used_seq %d → %d", seq, in.GetUsedSeq())
	}
	resp, err := s.StopSandbox(ctx, connect.NewRequest(&nodev1.StopSandboxRequest{SandboxId: ids[0]}))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.GetUsedSeq() <= seq || resp.Msg.GetUsed().GetCpu() != CPUOvercommit-1 {
		t.Fatalf("stop returned used %v at seq %d (before: %d); want %d CPU at a larger seq", resp.Msg.GetUsed(), resp.Msg.GetUsedSeq(), seq, CPUOvercommit-1)
	}
	if _, err := create(); err != nil {
		t.Fatalf("create after a stop freed 1 CPU: %v", err)
	}
}
