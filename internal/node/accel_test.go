package node

import (
	"os/exec"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/auth"
)

// TestInfoReportsAccelerator: the node's Info carries the accelerator
// decision and the default backend's reason it was given (the watcher passes Info on whole), and none when
// detection did not run.
func TestInfoReportsAccelerator(t *testing.T) {
	r := Accelerator{Accel: "tcg", Kind: "pvm", Module: "kvm_pvm", Reason: "/dev/kvm is PVM (kvm_pvm) and no PVM guest kernel is configured: VMs run under TCG",
		ProbeInstructions: 200002, ProbeDuration: 290 * time.Millisecond, DetectedAt: time.Date(2026, 12, 2, 13, 0, 0, 0, time.UTC)}
	why := "microvm needs hardware KVM: " + r.Reason
	f := newFakeNode(t, func(c *Config) { c.Accelerator = &r; c.DefaultBackendReason = why })
	s := &service{n: f.Node}
	ctx := as("opendsec-apiserver", auth.ScopeNode)
	resp, err := s.Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	a := resp.Msg.GetAccelerator()
	if a.GetAccel() != "tcg" || a.GetKind() != "pvm" || a.GetModule() != "kvm_pvm" || a.GetReason() != r.Reason ||
		a.GetProbeInstructions() != 200002 || a.GetProbeDurationUs() != 290000 || !a.GetDetectedAt().AsTime().Equal(r.DetectedAt) {
		t.Fatalf("Info accelerator %v, want the decision %+v", a, r)
	}
	if resp.Msg.GetDefaultBackend() != f.cfg.DefaultBackend || resp.Msg.GetDefaultBackendReason() != why {
		t.Fatalf("Info default backend %q (%q), want %q (%q)", resp.Msg.GetDefaultBackend(), resp.Msg.GetDefaultBackendReason(), f.cfg.DefaultBackend, why)
	}
	f2 := newFakeNode(t)
	resp, err = (&service{n: f2.Node}).Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.GetAccelerator() != nil {
		t.Fatalf("Info without detection reports %v", resp.Msg.GetAccelerator())
	}
}

// TestInfoReportsCoreScheduling: Info carries the core-scheduling decision
// the daemon made, and none without one.
func TestInfoReportsCoreScheduling(t *testing.T) {
	c := CoreScheduling{Reason: "SMT is off (/sys/devices/system/cpu/smt/active = 0): no sibling to share, core scheduling not needed"}
	f := newFakeNode(t, func(cfg *Config) { cfg.CoreScheduling = &c })
	ctx := as("opendsec-apiserver", auth.ScopeNode)
	resp, err := (&service{n: f.Node}).Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Msg.GetCoreScheduling(); got == nil || got.GetEnabled() || got.GetReason() != c.Reason {
		t.Fatalf("Info core scheduling %v, want %+v", got, c)
	}
	resp, err = (&service{n: newFakeNode(t).Node}).Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.GetCoreScheduling() != nil {
		t.Fatalf("Info without a decision reports %v", resp.Msg.GetCoreScheduling())
	}
}

// TestInfoReportsBackends: Info carries every backend's version and what
// it chose at start; with the real container backend on a host with crun,
// the default (oci_runtime auto) is crun and says why.
func TestInfoReportsBackends(t *testing.T) {
	ctx := as("opendsec-apiserver", auth.ScopeNode)
	resp, err := (&service{n: newFakeNode(t).Node}).Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if bi := resp.Msg.GetBackendInfo(); len(bi) != 1 || bi[0].GetName() != "fake" || bi[0].GetVersion() != "fake 1" {
		t.Fatalf("Info backend_info %v, want the fake backend's", bi)
	}
	f := newFixture(t)
	n := f.open(t)
	resp, err = (&service{n: n}).Info(ctx, connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	bi := resp.Msg.GetBackendInfo()
	if len(bi) != 1 || bi[0].GetName() != "container" {
		t.Fatalf("Info backend_info %v, want the container backend's", bi)
	}
	want := "runc "
	if _, err := exec.LookPath("crun"); err == nil {
		want = "crun "
	}
	if !strings.HasPrefix(bi[0].GetVersion(), want) || !strings.HasPrefix(bi[0].GetDetail(), "oci_runtime "+strings.TrimSpace(want)+": container.oci_runtime auto") {
		t.Fatalf("container backend info %v; want %s chosen by oci_runtime auto, with its reason", bi[0], want)
	}
	t.Logf("container backend: %s (%s)", bi[0].GetVersion(), bi[0].GetDetail())
}
