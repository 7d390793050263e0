package kvmprobe

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/testutil"
)

// TestThisHostIsEmulatedPVM pins this project's machines: /dev/kvm is PVM
// (kvm_pvm), an ordinary guest is emulated, so VMs must run under TCG. It
// fails if the probe breaks (no instructions timed, or a fast probe) or if
// someone falls back to "KVM opened, so use it". Elsewhere it checks only
// that the decision agrees with the probe.
func TestThisHostIsEmulatedPVM(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.RequiresKVM(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := Detect(ctx, Options{CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s (wall %s)", r, r.ProbeWall)
	if r.ProbeInstructions != 200002 {
		t.Fatalf("probe ran %d instructions, want 200002: %s", r.ProbeInstructions, r.Reason)
	}
	if _, err := os.Stat("/sys/module/kvm_pvm"); err != nil {
		if r.ProbeDuration < HardwareSpeed && !r.HardwareKVM() {
			t.Fatalf("a fast probe (%s) on a non-PVM host must be hardware kvm: %s", r.ProbeDuration, r)
		}
		t.Skip("not a PVM host (no /sys/module/kvm_pvm): the PVM classification is checked on the project's machines")
	}
	if r.Accel != AccelTCG || r.Kind != KindPVM || r.Module != ModulePVM {
		t.Fatalf("got %s, want accel=tcg kind=pvm module=kvm_pvm", r)
	}
	if r.ProbeDuration <= HardwareSpeed {
		t.Fatalf("probe took %s of CPU, want > %s on this emulating host: the probe is broken", r.ProbeDuration, HardwareSpeed)
	}
	if r.HardwareKVM() {
		t.Fatal("HardwareKVM() is true on PVM")
	}
}
