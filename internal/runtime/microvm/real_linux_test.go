package microvm

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// realBinaries are OPENDSEC_FIRECRACKER and OPENDSEC_JAILER, or a skip.
func realBinaries(t *testing.T) (fc, jailer string) {
	t.Helper()
	fc, jailer = os.Getenv("OPENDSEC_FIRECRACKER"), os.Getenv("OPENDSEC_JAILER")
	if fc == "" || jailer == "" {
		t.Skip("OPENDSEC_FIRECRACKER and OPENDSEC_JAILER are not both set to Firecracker's binaries (none is installed on these machines)")
	}
	return fc, jailer
}

// detectKVM is the real detector's result (cached in a test dir, not
// the node's /run/opendsec).
func detectKVM(t *testing.T) kvmprobe.Result {
	t.Helper()
	res, err := kvmprobe.Detect(context.Background(), kvmprobe.Options{CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// realRuntime is the backend over the real binaries; guest assets are the
// built ones when there, else stand-in files (nothing boots then).
func realRuntime(t *testing.T, fc, jailer string, res kvmprobe.Result) (*Runtime, Config) {
	t.Helper()
	base, err := os.MkdirTemp("", "fcr")
	if err != nil {
		t.Fatal(err)
	}
	guest := os.Getenv("OPENDSEC_GUEST_DIR")
	if guest == "" {
		guest = t.TempDir()
		for _, f := range []string{"vmlinux", "initrd.cpio"} {
			if err := os.WriteFile(filepath.Join(guest, f), []byte("not booted "+f), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	cfg := Config{FirecrackerPath: fc, JailerPath: jailer, ChrootBase: base, GuestDir: guest}
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	r := New(cfg, runtime.Env{NodeID: "r" + strconv.Itoa(os.Getpid())}, res)
	t.Cleanup(func() {
		_ = unmountUnder(base)
		_ = os.RemoveAll(base)
		_ = removeCgroup(r.cgroupParent(), map[bool]int{true: 2, false: 1}[unified()])
	})
	return r, r.cfg
}

// TestRealJailedFirecracker runs the real jailer and firecracker as the
// backend does: a jail with the sandbox's uid, netns (a tap in it) and
// cgroup, and configures machine, kernel, drives, network and vsock
// through the API. It boots only on hardware KVM (TestBootOnKVM); here it
// checks the configuration and the process, then Stop and Delete.
func TestRealJailedFirecracker(t *testing.T) {
	fc, jailer := realBinaries(t)
	rootOnly(t)
	res := detectKVM(t)
	r, cfg := realRuntime(t, fc, jailer, res)
	r.configureOnly, r.agentWait = true, 0
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ns := ipNetns(t)
	layer := filepath.Join(t.TempDir(), "l0.erofs")
	if err := os.WriteFile(layer, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	mac, _ := net.ParseMAC("02:0d:5e:00:00:21")
	spec := runtime.Spec{ID: "sb-real", StateDir: t.TempDir(),
		Rootfs:    runtime.Rootfs{Layers: []runtime.Layer{{Digest: "sha256:l0", Format: runtime.LayerEROFS, Path: layer}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 128, DiskMB: 16},
		Network: runtime.NetworkAttachment{Mode: runtime.NetworkTap, NetNS: ns, Device: "tap0", MAC: mac,
			GuestAddr: netip.MustParsePrefix("169.254.0.21/30"), Gateway: netip.MustParseAddr("169.254.0.22")}}
	h, err := r.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), h.ID) }()
	t0 := time.Now()
	if err := r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	t.Logf("jailer exec to a configured VM: %s", time.Since(t0))
	sb, _ := r.get(h.ID)
	c := r.client(sb.st)
	info, err := c.InstanceInfo(ctx)
	if err != nil || info.State != "Not started" || info.ID != "sb-real" || !strings.HasPrefix(info.VMMVersion, "1.") {
		t.Fatalf("instance info %+v %v", info, err)
	}
	t.Logf("firecracker %s, jailed as uid %d", info.VMMVersion, sb.st.UID)
	if mc, err := c.GetMachineConfig(ctx); err != nil || mc.VcpuCount != 1 || mc.MemSizeMib != 128 {
		t.Fatalf("machine config %+v %v", mc, err)
	}
	st, _ := r.Status(ctx, h.ID)
	if got := procUID(t, st.Pid); got != sb.st.UID {
		t.Fatalf("firecracker runs as uid %d, want %d", got, sb.st.UID)
	}
	same := func(a, b string) bool {
		sa, err1 := os.Stat(a)
		sb, err2 := os.Stat(b)
		return err1 == nil && err2 == nil && os.SameFile(sa, sb)
	}
	if !same("/proc/"+strconv.Itoa(st.Pid)+"/ns/net", ns) {
		t.Fatal("firecracker is not in the sandbox's netns")
	}
	if cg, _ := os.ReadFile("/proc/" + strconv.Itoa(st.Pid) + "/cgroup"); !strings.Contains(string(cg), r.cgroupParent()+"/sb-real") {
		t.Fatalf("cgroup %s", cg)
	}
	// The vsock device's host socket is in the jail.
	if _, err := os.Stat(filepath.Join(cfg.Root("sb-real"), "run", "vsock.sock")); err != nil {
		t.Fatalf("vsock socket: %v", err)
	}
	// A pre-boot resource with a bad body is Firecracker's own 400.
	if err := c.PutMachineConfig(ctx, MachineConfig{VcpuCount: 1, MemSizeMib: 0}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("0 MiB: %v", err)
	}
	if !res.HardwareKVM() {
		t.Logf("boot skipped: %s", res.Reason)
	}
	// Not started: SendCtrlAltDel is refused, Stop kills.
	if err := r.Stop(ctx, h.ID, runtime.StopOptions{Timeout: time.Second}); err != nil {
		t.Fatal(err)
	}
	if ex, err := r.Wait(ctx, h.ID); err != nil || ex.Reason != "stopped" {
		t.Fatalf("wait: %+v %v", ex, err)
	}
	if err := r.Delete(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, r, "sb-real", spec.StateDir)
}

// requireBoot skips unless the detector says hardware KVM (or PVM with
// its kernel) and the binaries and the guest assets are given.
func requireBoot(t *testing.T) (*Runtime, Config) {
	t.Helper()
	res := detectKVM(t)
	if res.Accel != kvmprobe.AccelKVM {
		t.Skipf("no guest boots here: %s", res.Reason)
	}
	fc, jailer := realBinaries(t)
	rootOnly(t)
	if os.Getenv("OPENDSEC_GUEST_DIR") == "" {
		t.Skip("OPENDSEC_GUEST_DIR is not set to the guest assets (make guest-assets)")
	}
	return realRuntime(t, fc, jailer, res)
}

// busyboxRootfs is the busybox image as one EROFS layer.
func busyboxRootfs(t *testing.T) runtime.Rootfs {
	t.Helper()
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("mkfs.erofs (erofs-utils) makes the guest's image layer")
	}
	src := testutil.BusyboxRootfs(t)
	p := filepath.Join(t.TempDir(), "busybox.erofs")
	if out, err := exec.Command("mkfs.erofs", p, src).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	if err := os.Chmod(p, 0o644); err != nil {
		t.Fatal(err)
	}
	return runtime.Rootfs{Image: "test/busybox", Layers: []runtime.Layer{{Digest: "sha256:busybox", Format: runtime.LayerEROFS, Path: p}}}
}

// TestBootOnKVM boots the guest assets in a jailed firecracker, reaches
// the agent over vsock, pauses and resumes, and forks with memory.
func TestBootOnKVM(t *testing.T) {
	r, _ := requireBoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rootfs := busyboxRootfs(t)
	spec := runtime.Spec{ID: "sb-boot", StateDir: t.TempDir(), Rootfs: rootfs, Resources: runtime.Resources{CPU: 1, MemoryMB: 256, DiskMB: 64}}
	h, err := r.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), h.ID) }()
	t0 := time.Now()
	if err := r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	t.Logf("boot to agent: %s", time.Since(t0))
	hc := r.agentHTTP(h.ID)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/health", nil)
	resp, err := hc.Do(req)
	if err != nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("health: %v %v", resp, err)
	}
	_ = resp.Body.Close()
	if err := r.Pause(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	if err := r.Resume(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	fspec := runtime.Spec{ID: "sb-boot-f1", StateDir: t.TempDir(), Rootfs: rootfs, Resources: spec.Resources}
	res, err := r.Fork(ctx, h.ID, []runtime.Spec{fspec})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), fspec.ID) }()
	t.Logf("fork: source frozen %s", res[0].SourceFrozen)
	if err := r.Start(ctx, fspec.ID); err != nil {
		t.Fatal(err)
	}
	if err := r.Stop(ctx, h.ID, runtime.StopOptions{Timeout: 10 * time.Second}); err != nil {
		t.Fatal(err)
	}
}

// TestConformance runs the backend conformance suite on real microVMs
// where a guest boots (hardware KVM); here it skips with the detector's
// reason.
func TestConformance(t *testing.T) {
	r, cfg := requireBoot(t)
	rootfs := busyboxRootfs(t)
	first := true
	runtimetest.Suite(t, func(t *testing.T) (runtime.Runtime, runtime.Spec) {
		if !first { // a later instance is the node after a restart
			r = New(cfg, runtime.Env{NodeID: r.nodeID}, r.accel)
		}
		first = false
		return r, runtime.Spec{Rootfs: rootfs, Resources: runtime.Resources{CPU: 1, MemoryMB: 256, PidsLimit: 128, DiskMB: 64}}
	}, runtimetest.Options{Exec: true, Kill: func(t testing.TB, rt runtime.Runtime, id string) {
		st, err := rt.Status(context.Background(), id)
		if err != nil || st.Pid <= 0 {
			t.Fatalf("status of %s: %+v %v", id, st, err)
		}
		if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}})
}
