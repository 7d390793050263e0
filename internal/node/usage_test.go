package node

import (
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// TestSecurityPlacementNodeAdmitsItsQuota: the node admits CPU against the
// capacity its Info offers placement (DefaultCPUOvercommit times its cores) and
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
	if got := info().GetTotal().GetCpu(); got != DefaultCPUOvercommit {
		t.Fatalf("Info offers %g CPU for 1 core; want %d", got, DefaultCPUOvercommit)
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
	for i := range DefaultCPUOvercommit {
		resp, err := create()
		if err != nil {
			t.Fatalf("create %d of %d: %v", i+1, DefaultCPUOvercommit, err)
		}
		if resp.GetUsedSeq() <= seq || resp.GetUsed().GetCpu() != float64(i+1) {
			t.Fatalf("create %d returned used %v at seq %d (before: %d); want %d CPU at a larger seq", i+1, resp.GetUsed(), resp.GetUsedSeq(), seq, i+1)
		}
		seq = resp.GetUsedSeq()
		ids = append(ids, resp.GetSandbox().GetId())
	}
	if in := info(); in.GetUsedSeq() != seq || in.GetUsed().GetCpu() != DefaultCPUOvercommit {
		t.Fatalf("Info after the creates: used %v at seq %d; want the last create's reading %d at %d", in.GetUsed(), in.GetUsedSeq(), DefaultCPUOvercommit, seq)
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
	if resp.Msg.GetUsedSeq() <= seq || resp.Msg.GetUsed().GetCpu() != DefaultCPUOvercommit-1 {
		t.Fatalf("stop returned used %v at seq %d (before: %d); want %d CPU at a larger seq", resp.Msg.GetUsed(), resp.Msg.GetUsedSeq(), seq, DefaultCPUOvercommit-1)
	}
	if _, err := create(); err != nil {
		t.Fatalf("create after a stop freed 1 CPU: %v", err)
	}
}

// TestNodeOvercommitIsConfigurable: node.cpu_overcommit and
// node.memory_overcommit set what Info offers placement and what admission
// lets limits add up to; past it a create is refused naming the key, and
// the refusal reserves nothing.
func TestNodeOvercommitIsConfigurable(t *testing.T) {
	f := newFakeNode(t, func(c *Config) { c.CPU, c.MemoryMB, c.CPUOvercommit, c.MemoryOvercommit = 1, 256, 2, 3 })
	s := &service{n: f.Node}
	ctx := as("opendsec-apiserver", auth.ScopeNode)
	in, err := s.Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if got := in.Msg.GetTotal(); got.GetCpu() != 2 || got.GetMemoryMb() != 768 {
		t.Fatalf("Info offers %v; want 2 CPU (1 core × 2) and 768 MiB (256 × 3)", got)
	}
	create := func(cpu float64, mem int64) error {
		_, err := s.CreateSandbox(ctx, connect.NewRequest(&nodev1.CreateSandboxRequest{
			SandboxId: sandboxid.New("t001"),
			Spec:      &nodev1.SandboxSpec{Image: "root/busybox", Cpu: cpu, MemoryMb: proto.Int64(mem), TimeoutSeconds: 600},
		}))
		return err
	}
	// Memory: three sandboxes of 256 MiB fit in 256 MiB × 3; a fourth does not.
	for i := range 3 {
		if err := create(0.1, 256); err != nil {
			t.Fatalf("create %d of 3 × 256 MiB on a 256 MiB node with memory_overcommit 3: %v", i+1, err)
		}
	}
	err = create(0.1, 256)
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "node.memory_overcommit") {
		t.Fatalf("fourth 256 MiB create: %v; want resource exhausted naming node.memory_overcommit", err)
	}
	if _, mem, n := f.Usage(); n != 3 || mem != 768 {
		t.Fatalf("%d sandboxes, %d MiB reserved after a refused create; want 3, 768", n, mem)
	}
	// CPU: 0.3 of 2 reserved; 1 + 0.7 more fit, then nothing.
	f.Node.cfg.MemoryOvercommit = 100
	for _, cpu := range []float64{1, 0.7} {
		if err := create(cpu, 16); err != nil {
			t.Fatalf("create of %g CPU within 1 core × cpu_overcommit 2: %v", cpu, err)
		}
	}
	err = create(0.1, 16)
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "node.cpu_overcommit") {
		t.Fatalf("create past 1 core × cpu_overcommit 2: %v; want resource exhausted naming node.cpu_overcommit", err)
	}
}
