package kvmprobe

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/testutil"
	"golang.org/x/sys/unix"
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

// TestProbeNeverHangs: a guest that never halts (jmp $) is stopped at the
// probe's deadline: KVM_RUN is kicked with immediate_exit and a signal,
// and the probe reports a timeout instead of hanging the caller.
func TestProbeNeverHangs(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.RequiresKVM(t)
	kvm, err := unix.Open(DefaultDevPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	vm, err := ioctl(kvm, kvmCreateVM, 0)
	if err != nil {
		unix.Close(kvm)
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	p := runProbe(ctx, kvm, int(vm), []byte{0xEB, 0xFE}) // jmp $
	took := time.Since(start)
	t.Logf("probe of a spinning guest: %q after %s", p.err, took)
	if p.err == "" || p.instructions != 0 {
		t.Fatalf("a guest that never halts passed the probe: %+v", p)
	}
	if took > 2*time.Second {
		t.Fatalf("the probe took %s past a 300ms deadline", took)
	}
	if r := Decide(Facts{APIVersion: 12, Modules: []string{ModuleIntel}, ProbeErr: p.err}); r.Accel != AccelTCG {
		t.Fatalf("a timed-out probe decided %s", r)
	}
}
