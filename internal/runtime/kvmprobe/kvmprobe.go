// Package kvmprobe decides which accelerator a VM backend may use on this
// host: "kvm" only where the CPU really executes guest code (hardware
// VT-x/AMD-V, or PVM with a PVM guest kernel that passed a boot probe), else
// "tcg". "/dev/kvm opens" is not enough: on a PVM host (kvm_pvm) an ordinary
// guest kernel runs through KVM's instruction emulator, crawls and dies, and
// QEMU's -accel kvm initialises fine so it never falls back by itself.
//
// Detect checks, in order: /dev/kvm opens, KVM_GET_API_VERSION is 12,
// KVM_CREATE_VM works; the vendor module in /sys/module (kvm_intel and
// kvm_amd are hardware, kvm_pvm is PVM); and a timed real-mode probe: a
// 16-bit loop of about 200,000 instructions in one KVM_RUN. Under 10 ms of
// CPU time means the CPU runs guest code; an emulating host takes hundreds
// of milliseconds. Decide turns those observed facts into a Result (a pure
// function). The result is cached once per boot in CacheDir, keyed by
// /proc/sys/kernel/random/boot_id and the options.
package kvmprobe

import (
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Accel is what a VM backend passes to QEMU's -accel, and whether
// Firecracker (which needs KVM) may run.
type Accel string

const (
	AccelKVM Accel = "kvm"
	AccelTCG Accel = "tcg"
)

// Kind is what kind of KVM the host has.
type Kind string

const (
	// KindHardware: the CPU executes guest code (VT-x/AMD-V), proven by
	// the timed probe.
	KindHardware Kind = "hardware"
	// KindPVM: /dev/kvm is PVM (kvm_pvm); only a PVM guest kernel runs at
	// speed, anything else goes through the instruction emulator.
	KindPVM Kind = "pvm"
	// KindNone: no usable KVM (absent, broken, or emulating guest code).
	KindNone Kind = "none"
)

// Module names found in /sys/module.
const (
	ModuleIntel = "kvm_intel"
	ModuleAMD   = "kvm_amd"
	ModulePVM   = "kvm_pvm"
)

// HardwareSpeed is the probe's threshold: the loop under this much CPU time
// means the CPU executes guest code. Hardware KVM runs it in well under a
// millisecond; PVM's emulator here takes ~290 ms.
const HardwareSpeed = 10 * time.Millisecond

// DefaultCacheDir is where the result is cached when Options.CacheDir is
// empty.
const DefaultCacheDir = "/run/opendsec"

// DefaultDevPath is the KVM device.
const DefaultDevPath = "/dev/kvm"

// Result is the accelerator decision and the facts it rests on.
type Result struct {
	// Accel is what a VM backend must pass to QEMU -accel, and whether
	// Firecracker may run (only with kvm).
	Accel Accel `json:"accel"`
	Kind  Kind  `json:"kind"`
	// Module is the KVM vendor module: kvm_intel, kvm_amd, kvm_pvm or "".
	Module string `json:"module"`
	// ProbeInstructions is how many guest instructions the timed probe ran
	// (0 if it did not run).
	ProbeInstructions int64 `json:"probe_instructions"`
	// ProbeDuration is the CPU time of the probe's KVM_RUN (thread CPU
	// time, so a busy host does not make hardware look slow).
	ProbeDuration time.Duration `json:"probe_duration_ns"`
	// ProbeWall is the wall time of the same KVM_RUN.
	ProbeWall time.Duration `json:"probe_wall_ns"`
	// Reason is one sentence for humans: why this Accel.
	Reason string `json:"reason"`
	// PVMGuestKernel is the configured PVM guest kernel ("" if none).
	PVMGuestKernel string    `json:"pvm_guest_kernel,omitempty"`
	BootID         string    `json:"boot_id"`
	DetectedAt     time.Time `json:"detected_at"`
}

// HardwareKVM reports whether the host has hardware KVM that VMs use.
func (r Result) HardwareKVM() bool { return r.Kind == KindHardware && r.Accel == AccelKVM }

// String is the result as one line of text.
func (r Result) String() string {
	s := fmt.Sprintf("accel=%s kind=%s", r.Accel, r.Kind)
	if r.Module != "" {
		s += " module=" + r.Module
	}
	if r.ProbeInstructions > 0 {
		s += fmt.Sprintf(" probe=%d instructions in %s", r.ProbeInstructions, r.ProbeDuration.Round(10*time.Microsecond))
	}
	return s + ": " + r.Reason
}

// Options configure Detect. The zero value is valid.
type Options struct {
	// DevPath is the KVM device (default /dev/kvm).
	DevPath string
	// PVMGuestKernel is an operator-configured PVM guest kernel (an ELF
	// vmlinux built for this host's PVM ABI). Without it a PVM host uses tcg.
	PVMGuestKernel string
	// PVMBootProbe boots PVMGuestKernel under KVM and returns nil once the
	// guest reached its agent within a deadline. The vm backend supplies
	// it; kvmprobe only checks that the kernel is an ELF vmlinux. Without a
	// boot probe a PVM host uses tcg even with a kernel configured.
	PVMBootProbe func(ctx context.Context, kernel string) error
	// CacheDir holds the per-boot cache file (default /run/opendsec).
	CacheDir string
	// ProbeTimeout bounds the timed probe (default 5s).
	ProbeTimeout time.Duration
}

// Facts are what Detect observed, the input of Decide.
type Facts struct {
	DevPath string
	// DevErr is why /dev/kvm could not be opened ("" if it opened).
	DevErr string
	// APIVersion is KVM_GET_API_VERSION's answer (0 if not asked).
	APIVersion int
	// CreateVMErr is why KVM_CREATE_VM failed ("" if it worked).
	CreateVMErr string
	// Modules are the KVM vendor modules present in /sys/module.
	Modules []string
	// ProbeErr is why the timed probe failed ("" if it reached HLT).
	ProbeErr          string
	ProbeInstructions int64
	ProbeDuration     time.Duration
	ProbeWall         time.Duration
	// PVMGuestKernel is the configured kernel; PVMKernelErr why it is not
	// usable ("" if it is an ELF vmlinux and passed the boot probe).
	PVMGuestKernel string
	PVMKernelErr   string
}

// Decide turns observed facts into the accelerator decision. It never says
// kvm because /dev/kvm merely opened.
func Decide(f Facts) Result {
	r := Result{Accel: AccelTCG, Kind: KindNone, PVMGuestKernel: f.PVMGuestKernel,
		ProbeInstructions: f.ProbeInstructions, ProbeDuration: f.ProbeDuration, ProbeWall: f.ProbeWall}
	dev := f.DevPath
	if dev == "" {
		dev = DefaultDevPath
	}
	switch {
	case f.DevErr != "":
		r.Reason = fmt.Sprintf("%s cannot be opened (%s): VMs run under TCG", dev, f.DevErr)
		return r
	case f.APIVersion != 12:
		r.Reason = fmt.Sprintf("%s answers KVM API version %d, not 12: VMs run under TCG", dev, f.APIVersion)
		return r
	case f.CreateVMErr != "":
		r.Reason = fmt.Sprintf("%s cannot create a VM (%s): VMs run under TCG", dev, f.CreateVMErr)
		return r
	}
	for _, m := range []string{ModuleIntel, ModuleAMD, ModulePVM} {
		for _, have := range f.Modules {
			if have == m && r.Module == "" {
				r.Module = m
			}
		}
	}
	fast := f.ProbeErr == "" && f.ProbeInstructions > 0 && f.ProbeDuration < HardwareSpeed
	probe := fmt.Sprintf("the real-mode probe ran %d instructions in %s", f.ProbeInstructions, f.ProbeDuration.Round(100*time.Microsecond))
	if r.Module == ModulePVM {
		r.Kind = KindPVM
		switch {
		case f.PVMGuestKernel == "":
			r.Reason = fmt.Sprintf("%s is PVM (kvm_pvm) and no PVM guest kernel is configured: VMs run under TCG", dev)
		case f.PVMKernelErr != "":
			r.Reason = fmt.Sprintf("%s is PVM (kvm_pvm) but the PVM guest kernel %s is not usable (%s): VMs run under TCG", dev, f.PVMGuestKernel, f.PVMKernelErr)
		default:
			r.Accel = AccelKVM
			r.Reason = fmt.Sprintf("%s is PVM (kvm_pvm) and the PVM guest kernel %s passed its boot probe: VMs run under KVM with that kernel", dev, f.PVMGuestKernel)
		}
		return r
	}
	switch {
	case f.ProbeErr != "":
		r.Reason = fmt.Sprintf("%s opened but the real-mode probe failed (%s): VMs run under TCG", dev, f.ProbeErr)
	case !fast:
		r.Reason = fmt.Sprintf("%s opened but %s (hardware runs it in under %s), so KVM emulates guest code: VMs run under TCG", dev, probe, HardwareSpeed)
	default:
		r.Kind, r.Accel = KindHardware, AccelKVM
		mod := r.Module
		if mod == "" {
			mod = "no known vendor module"
		}
		r.Reason = fmt.Sprintf("%s is hardware KVM (%s) and %s: VMs run under KVM", dev, mod, probe)
	}
	return r
}

// Detect returns the accelerator decision for this host, from the per-boot
// cache when it is there and was made with the same options.
func Detect(ctx context.Context, opts Options) (Result, error) {
	return detect(ctx, opts, hostEnv)
}

// env is what detect reads from the host; tests replace it.
type env struct {
	bootIDPath string
	observe    func(ctx context.Context, opts Options) Facts
}

var hostEnv = env{bootIDPath: "/proc/sys/kernel/random/boot_id", observe: observe}

type cacheFile struct {
	Key    string `json:"key"`
	Result Result `json:"result"`
}

// CacheFileName is the cache file in CacheDir.
const CacheFileName = "accel.json"

func detect(ctx context.Context, opts Options, e env) (Result, error) {
	if opts.DevPath == "" {
		opts.DevPath = DefaultDevPath
	}
	if opts.CacheDir == "" {
		opts.CacheDir = DefaultCacheDir
	}
	if opts.ProbeTimeout <= 0 {
		opts.ProbeTimeout = 5 * time.Second
	}
	b, err := os.ReadFile(e.bootIDPath)
	if err != nil {
		return Result{}, errdefs.New(errdefs.ErrUnavailable, "boot id: %w", err)
	}
	bootID := strings.TrimSpace(string(b))
	key := cacheKey(bootID, opts)
	path := filepath.Join(opts.CacheDir, CacheFileName)
	if b, err := os.ReadFile(path); err == nil {
		var c cacheFile
		if json.Unmarshal(b, &c) == nil && c.Key == key && c.Result.BootID == bootID {
			return c.Result, nil
		}
	}
	if err := ctx.Err(); err != nil {
		return Result{}, fmt.Errorf("accelerator detection: %w", err)
	}
	f := e.observe(ctx, opts)
	if err := ctx.Err(); err != nil {
		return Result{}, fmt.Errorf("accelerator detection: %w", err)
	}
	r := Decide(f)
	r.BootID, r.DetectedAt = bootID, time.Now().UTC()
	slog.Info("accelerator detected", "accel", r.Accel, "kind", r.Kind, "module", r.Module,
		"probe_instructions", r.ProbeInstructions, "probe_cpu", r.ProbeDuration, "probe_wall", r.ProbeWall,
		"pvm_params", pvmParams(), "reason", r.Reason)
	if err := writeCache(path, cacheFile{Key: key, Result: r}); err != nil {
		slog.Warn("accelerator cache not written", "path", path, "err", err)
	}
	return r, nil
}

// cacheKey ties a cached result to the boot and to the options it was made
// with (a changed PVM kernel file is a new key).
func cacheKey(bootID string, opts Options) string {
	h := sha256.New()
	fmt.Fprintf(h, "boot=%s\ndev=%s\npvm=%s\nbootprobe=%t\n", bootID, opts.DevPath, opts.PVMGuestKernel, opts.PVMBootProbe != nil)
	if opts.PVMGuestKernel != "" {
		if st, err := os.Stat(opts.PVMGuestKernel); err == nil {
			fmt.Fprintf(h, "size=%d\nmtime=%d\n", st.Size(), st.ModTime().UnixNano())
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

func writeCache(path string, c cacheFile) error {
	b, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".accel-*.json")
	if err != nil {
		return err
	}
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// CheckPVMKernel checks that path is an x86-64 ELF vmlinux (what a PVM
// guest is booted from: PVH direct boot, no firmware path). It does not
// prove the kernel speaks this host's PVM ABI; the boot probe does.
func CheckPVMKernel(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return errdefs.New(errdefs.ErrNotFound, "pvm guest kernel %s: not found: %w", path, err)
		}
		return errdefs.New(errdefs.ErrInvalidArgument, "pvm guest kernel %s: not an ELF vmlinux (give the uncompressed vmlinux, not a bzImage): %w", path, err)
	}
	defer f.Close()
	if f.Machine != elf.EM_X86_64 || (f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN) {
		return errdefs.New(errdefs.ErrInvalidArgument, "pvm guest kernel %s: an ELF %s %s, not an x86-64 vmlinux", path, f.Type, f.Machine)
	}
	return nil
}

// checkPVM fills f.PVMKernelErr for a configured PVM kernel.
func checkPVM(ctx context.Context, opts Options, f *Facts) {
	f.PVMGuestKernel = opts.PVMGuestKernel
	if opts.PVMGuestKernel == "" {
		return
	}
	if err := CheckPVMKernel(opts.PVMGuestKernel); err != nil {
		f.PVMKernelErr = err.Error()
		return
	}
	if opts.PVMBootProbe == nil {
		f.PVMKernelErr = "no boot probe ran: the vm backend supplies Options.PVMBootProbe"
		return
	}
	if err := opts.PVMBootProbe(ctx, opts.PVMGuestKernel); err != nil {
		f.PVMKernelErr = "boot probe: " + err.Error()
	}
}

// modules lists the KVM vendor modules present in /sys/module.
func modules(sysModule string) []string {
	var out []string
	for _, m := range []string{ModuleIntel, ModuleAMD, ModulePVM} {
		if _, err := os.Stat(filepath.Join(sysModule, m)); err == nil {
			out = append(out, m)
		}
	}
	return out
}

// pvmParams reads kvm_pvm's parameters for the log ("" without kvm_pvm).
func pvmParams() string {
	dir := "/sys/module/kvm_pvm/parameters"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return ""
	}
	var parts []string
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err == nil {
			parts = append(parts, e.Name()+"="+strings.TrimSpace(string(b)))
		}
	}
	return strings.Join(parts, " ")
}
