package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
)

func withDetect(t *testing.T, r kvmprobe.Result) {
	t.Helper()
	old := detect
	detect = func(context.Context, kvmprobe.Options) (kvmprobe.Result, error) { return r, nil }
	t.Cleanup(func() { detect = old })
}

func TestOpenRefusesWithoutHardwareKVM(t *testing.T) {
	reason := "/dev/kvm is PVM (kvm_pvm) and no PVM guest kernel is configured: VMs run under TCG"
	withDetect(t, kvmprobe.Result{Accel: kvmprobe.AccelTCG, Kind: kvmprobe.KindPVM, Reason: reason})
	_, err := runtime.Open(context.Background(), runtime.Env{}, map[string]json.RawMessage{Name: json.RawMessage(`{}`)})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), reason) || !strings.Contains(err.Error(), "needs hardware KVM") {
		t.Fatalf("got %v", err)
	}
}

func TestOpenRefusesWithoutBinaries(t *testing.T) {
	withDetect(t, kvmprobe.Result{Accel: kvmprobe.AccelKVM, Kind: kvmprobe.KindHardware, Reason: "hardware"})
	dir := t.TempDir()
	fc := filepath.Join(dir, "firecracker")
	raw, _ := json.Marshal(Config{FirecrackerPath: fc, JailerPath: filepath.Join(dir, "jailer")})
	_, err := runtime.Open(context.Background(), runtime.Env{}, map[string]json.RawMessage{Name: raw})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "firecracker_path") || !strings.Contains(err.Error(), fc) {
		t.Fatalf("got %v", err)
	}
}

// TestOpenOnThisHost uses the real detector: on a host without hardware
// KVM (this project's machines) Open fails quoting its reason.
func TestOpenOnThisHost(t *testing.T) {
	ctx := context.Background()
	cache := t.TempDir() // not the node's /run/opendsec
	old := detect
	detect = func(ctx context.Context, o kvmprobe.Options) (kvmprobe.Result, error) {
		o.CacheDir = cache
		return kvmprobe.Detect(ctx, o)
	}
	t.Cleanup(func() { detect = old })
	res, err := detect(ctx, kvmprobe.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.HardwareKVM() {
		t.Skipf("this host has hardware KVM (%s); the refusal is covered by TestOpenRefusesWithoutHardwareKVM", res.Reason)
	}
	_, err = runtime.Open(ctx, runtime.Env{}, map[string]json.RawMessage{Name: json.RawMessage(`{}`)})
	if err == nil || !strings.Contains(err.Error(), res.Reason) {
		t.Fatalf("got %v, want the detector's reason %q", err, res.Reason)
	}
}

// TestRealFirecrackerAPI starts the binary OPENDSEC_FIRECRACKER names (no
// guest boots: that needs hardware KVM) and checks the client against its
// real API: instance info, machine config, and its error bodies.
func TestRealFirecrackerAPI(t *testing.T) {
	bin := os.Getenv("OPENDSEC_FIRECRACKER")
	if bin == "" {
		t.Skip("OPENDSEC_FIRECRACKER is not set to a firecracker binary (none is built on these machines)")
	}
	dir, err := os.MkdirTemp("", "fcreal")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	sock := filepath.Join(dir, "api.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "--api-sock", sock, "--level", "Warning")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); _ = cmd.Wait() })
	c := NewClient(sock)
	// Firecracker makes its socket after it starts: poll for it, bounded.
	var info InstanceInfo
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for range 500 {
		if info, err = c.InstanceInfo(ctx); err == nil || !errors.Is(err, errdefs.ErrUnavailable) {
			break
		}
		<-tick.C
	}
	if err != nil || info.State != "Not started" {
		t.Fatalf("instance info %+v: %v", info, err)
	}
	if err := c.PutMachineConfig(ctx, MachineConfig{VcpuCount: 1, MemSizeMib: 256}); err != nil {
		t.Fatal(err)
	}
	if mc, err := c.GetMachineConfig(ctx); err != nil || mc.MemSizeMib != 256 {
		t.Fatalf("machine config %+v %v", mc, err)
	}
	if err := c.PutMachineConfig(ctx, MachineConfig{VcpuCount: 1, MemSizeMib: 0}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("0 MiB: %v", err)
	}
	if err := c.PutBootSource(ctx, BootSource{KernelImagePath: filepath.Join(dir, "none")}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("missing kernel: %v", err)
	}
	if err := c.PatchVM(ctx, VMPaused); err == nil {
		t.Fatal("pause before start succeeded")
	}
}

// A dynamically linked firecracker cannot start in the jailer's empty
// chroot: open refuses it, naming the loader it needs. (Found with a
// from-source build for the gnu target, which exec fails in the jail with
// "No such file or directory".)
func TestOpenRefusesDynamicFirecracker(t *testing.T) {
	withDetect(t, kvmprobe.Result{Accel: kvmprobe.AccelKVM, Kind: kvmprobe.KindHardware, Reason: "hardware"})
	dyn, err := exec.LookPath("ls") // any dynamically linked executable
	if err != nil {
		t.Skip(err)
	}
	if interp, _ := elfInterp(dyn); interp == "" {
		t.Skipf("%s is static here", dyn)
	}
	raw, _ := json.Marshal(Config{FirecrackerPath: dyn, JailerPath: dyn})
	_, err = runtime.Open(context.Background(), runtime.Env{}, map[string]json.RawMessage{Name: raw})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "dynamically linked") || !strings.Contains(err.Error(), "ld-linux") {
		t.Fatalf("got %v", err)
	}
	if interp, err := elfInterp(filepath.Join(standin(t), "firecracker")); err != nil || interp != "" {
		t.Fatalf("the static stand-in: interp %q %v", interp, err)
	}
}

// On a hardware KVM host with static binaries open builds the backend:
// a tap network, pause, snapshot and fork with memory.
func TestOpenBuildsTheBackend(t *testing.T) {
	withDetect(t, kvmprobe.Result{Accel: kvmprobe.AccelKVM, Kind: kvmprobe.KindHardware, Reason: "hardware"})
	bin := standin(t)
	raw, _ := json.Marshal(Config{FirecrackerPath: filepath.Join(bin, "firecracker"), JailerPath: filepath.Join(bin, "jailer")})
	rts, err := runtime.Open(context.Background(), runtime.Env{NodeID: "n1"}, map[string]json.RawMessage{Name: raw})
	if err != nil {
		t.Fatal(err)
	}
	rt := rts[Name]
	caps := rt.Info().Capabilities
	if !caps.Pause || !caps.Snapshot || !caps.Fork || !caps.MemorySnapshot || runtime.NetworkModeOf(rt) != runtime.NetworkTap {
		t.Fatalf("capabilities %+v, network %s", caps, runtime.NetworkModeOf(rt))
	}
	if err := rt.ValidateOptions(map[string]string{"x": "1"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("options: %v", err)
	}
}
