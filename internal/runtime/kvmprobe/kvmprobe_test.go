package kvmprobe

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func TestDecide(t *testing.T) {
	ok := Facts{APIVersion: 12, ProbeInstructions: 200002}
	with := func(f func(*Facts)) Facts { c := ok; f(&c); return c }
	for _, tc := range []struct {
		name   string
		facts  Facts
		accel  Accel
		kind   Kind
		module string
		reason string
	}{
		{"no device", Facts{DevErr: "no such file or directory"}, AccelTCG, KindNone, "", "cannot be opened"},
		{"bad api version", Facts{APIVersion: 11}, AccelTCG, KindNone, "", "API version 11"},
		{"create vm fails", Facts{APIVersion: 12, CreateVMErr: "KVM_CREATE_VM: EPERM"}, AccelTCG, KindNone, "", "cannot create a VM"},
		{"hardware intel fast", with(func(f *Facts) { f.Modules = []string{ModuleIntel}; f.ProbeDuration = 200 * time.Microsecond }), AccelKVM, KindHardware, ModuleIntel, "hardware KVM (kvm_intel)"},
		{"hardware amd fast", with(func(f *Facts) { f.Modules = []string{ModuleAMD}; f.ProbeDuration = time.Millisecond }), AccelKVM, KindHardware, ModuleAMD, "hardware KVM (kvm_amd)"},
		{"no known module but fast", with(func(f *Facts) { f.ProbeDuration = time.Millisecond }), AccelKVM, KindHardware, "", "no known vendor module"},
		{"intel named but slow", with(func(f *Facts) { f.Modules = []string{ModuleIntel}; f.ProbeDuration = 290 * time.Millisecond }), AccelTCG, KindNone, ModuleIntel, "emulates guest code"},
		{"at the threshold is slow", with(func(f *Facts) { f.Modules = []string{ModuleIntel}; f.ProbeDuration = HardwareSpeed }), AccelTCG, KindNone, ModuleIntel, "emulates"},
		{"probe failed", with(func(f *Facts) {
			f.Modules = []string{ModuleIntel}
			f.ProbeErr = "KVM_RUN: EFAULT"
			f.ProbeInstructions = 0
		}), AccelTCG, KindNone, ModuleIntel, "probe failed (KVM_RUN: EFAULT)"},
		{"probe reported nothing", with(func(f *Facts) { f.Modules = []string{ModuleIntel}; f.ProbeInstructions = 0 }), AccelTCG, KindNone, ModuleIntel, "emulates"},
		{"pvm without kernel", with(func(f *Facts) { f.Modules = []string{ModulePVM}; f.ProbeDuration = 290 * time.Millisecond }), AccelTCG, KindPVM, ModulePVM, "no PVM guest kernel is configured"},
		{"pvm fast probe still needs kernel", with(func(f *Facts) { f.Modules = []string{ModulePVM}; f.ProbeDuration = time.Millisecond }), AccelTCG, KindPVM, ModulePVM, "no PVM guest kernel"},
		{"pvm kernel unusable", with(func(f *Facts) {
			f.Modules = []string{ModulePVM}
			f.PVMGuestKernel, f.PVMKernelErr = "/k/vmlinux", "no boot probe ran"
		}), AccelTCG, KindPVM, ModulePVM, "/k/vmlinux is not usable (no boot probe ran)"},
		{"pvm kernel passed boot probe", with(func(f *Facts) { f.Modules = []string{ModulePVM}; f.PVMGuestKernel = "/k/vmlinux" }), AccelKVM, KindPVM, ModulePVM, "passed its boot probe"},
		{"hardware module wins over pvm", with(func(f *Facts) { f.Modules = []string{ModulePVM, ModuleIntel}; f.ProbeDuration = time.Millisecond }), AccelKVM, KindHardware, ModuleIntel, "hardware"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Decide(tc.facts)
			if r.Accel != tc.accel || r.Kind != tc.kind || r.Module != tc.module {
				t.Fatalf("got %s, want accel=%s kind=%s module=%q", r, tc.accel, tc.kind, tc.module)
			}
			if !strings.Contains(r.Reason, tc.reason) {
				t.Fatalf("reason %q does not say %q", r.Reason, tc.reason)
			}
			if !strings.HasSuffix(r.Reason, "VMs run under TCG") && r.Accel == AccelTCG {
				t.Fatalf("reason %q does not end by saying TCG", r.Reason)
			}
			if r.HardwareKVM() != (tc.kind == KindHardware && tc.accel == AccelKVM) {
				t.Fatalf("HardwareKVM()=%t for %s", r.HardwareKVM(), r)
			}
		})
	}
}

// fakeHost counts how often the host was observed.
type fakeHost struct {
	bootID string
	calls  int
	facts  Facts
}

func (h *fakeHost) env(t *testing.T) env {
	p := filepath.Join(t.TempDir(), "boot_id")
	if err := os.WriteFile(p, []byte(h.bootID+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return env{bootIDPath: p, observe: func(context.Context, Options) Facts { h.calls++; return h.facts }}
}

func TestCacheOncePerBoot(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	h := &fakeHost{bootID: "boot-a", facts: Facts{APIVersion: 12, Modules: []string{ModulePVM}, ProbeInstructions: 200002, ProbeDuration: 290 * time.Millisecond}}
	e := h.env(t)
	opts := Options{CacheDir: dir}
	r1, err := detect(ctx, opts, e)
	if err != nil {
		t.Fatal(err)
	}
	if r1.BootID != "boot-a" || r1.Kind != KindPVM || r1.DetectedAt.IsZero() {
		t.Fatalf("first result %+v", r1)
	}
	// The host changes, but the boot does not: the cached answer stands.
	h.facts = Facts{DevErr: "gone"}
	r2, err := detect(ctx, opts, e)
	if err != nil {
		t.Fatal(err)
	}
	if h.calls != 1 || r2.Kind != KindPVM || !r2.DetectedAt.Equal(r1.DetectedAt) {
		t.Fatalf("second detect in the same boot observed again (calls=%d) or changed: %+v", h.calls, r2)
	}
	// A new boot id invalidates the cache.
	if err := os.WriteFile(e.bootIDPath, []byte("boot-b\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r3, err := detect(ctx, opts, e)
	if err != nil {
		t.Fatal(err)
	}
	if h.calls != 2 || r3.BootID != "boot-b" || r3.Kind != KindNone {
		t.Fatalf("after reboot: calls=%d result %+v", h.calls, r3)
	}
	// Other options (a PVM kernel configured) are another key too.
	if _, err := detect(ctx, Options{CacheDir: dir, PVMGuestKernel: "/nonexistent/vmlinux"}, e); err != nil {
		t.Fatal(err)
	}
	if h.calls != 3 {
		t.Fatalf("a changed option reused the cache (calls=%d)", h.calls)
	}
	// The cache file is readable JSON with the result.
	b, err := os.ReadFile(filepath.Join(dir, CacheFileName))
	if err != nil {
		t.Fatal(err)
	}
	var c cacheFile
	if err := json.Unmarshal(b, &c); err != nil || c.Result.BootID != "boot-b" {
		t.Fatalf("cache file %s: %v", b, err)
	}
}

func TestCacheCorruptIsIgnored(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, CacheFileName), []byte("{not json"), 0o644); err != nil {
		t.Fatal(err)
	}
	h := &fakeHost{bootID: "boot-a", facts: Facts{DevErr: "no such file or directory"}}
	r, err := detect(context.Background(), Options{CacheDir: dir}, h.env(t))
	if err != nil {
		t.Fatal(err)
	}
	if h.calls != 1 || r.Accel != AccelTCG {
		t.Fatalf("calls=%d result %+v", h.calls, r)
	}
}

func TestCheckPVMKernel(t *testing.T) {
	dir := t.TempDir()
	if err := CheckPVMKernel(filepath.Join(dir, "missing")); !errdefs.IsNotFound(err) {
		t.Fatalf("missing kernel: %v, want not found", err)
	}
	bz := filepath.Join(dir, "bzImage")
	if err := os.WriteFile(bz, []byte("MZ\x00\x00 not an elf"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := CheckPVMKernel(bz); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "not an ELF vmlinux") {
		t.Fatalf("bzImage: %v", err)
	}
	// The test binary itself is an ELF for the build's machine.
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	err = CheckPVMKernel(exe)
	if isAMD64 && err != nil {
		t.Fatalf("an x86-64 ELF is refused: %v", err)
	}
}

func TestPVMBootProbeHook(t *testing.T) {
	exe, err := os.Executable()
	if err != nil || !isAMD64 {
		t.Skip("needs an x86-64 ELF (the test binary on amd64)")
	}
	var f Facts
	checkPVM(context.Background(), Options{PVMGuestKernel: exe}, &f)
	if !strings.Contains(f.PVMKernelErr, "no boot probe ran") {
		t.Fatalf("without a boot probe: %q", f.PVMKernelErr)
	}
	f = Facts{}
	checkPVM(context.Background(), Options{PVMGuestKernel: exe, PVMBootProbe: func(context.Context, string) error { return errors.New("agent not up in 10s") }}, &f)
	if f.PVMKernelErr != "boot probe: agent not up in 10s" {
		t.Fatalf("failed boot probe: %q", f.PVMKernelErr)
	}
	f = Facts{}
	var got string
	checkPVM(context.Background(), Options{PVMGuestKernel: exe, PVMBootProbe: func(_ context.Context, k string) error { got = k; return nil }}, &f)
	if f.PVMKernelErr != "" || got != exe {
		t.Fatalf("passing boot probe: err %q, probed %q", f.PVMKernelErr, got)
	}
}
