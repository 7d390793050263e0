package daemon

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/testutil"
)

// probeResults are the accelerator decisions the choice is tested with,
// made by kvmprobe.Decide from observed facts as on real hosts.
func probeResults() map[string]kvmprobe.Result {
	fast := kvmprobe.Facts{APIVersion: 12, Modules: []string{kvmprobe.ModuleIntel}, ProbeInstructions: 200002, ProbeDuration: 300 * time.Microsecond}
	pvm := kvmprobe.Facts{APIVersion: 12, Modules: []string{kvmprobe.ModulePVM}, ProbeInstructions: 200002, ProbeDuration: 290 * time.Millisecond}
	none := kvmprobe.Facts{DevErr: "no such file or directory"}
	return map[string]kvmprobe.Result{"hardware": kvmprobe.Decide(fast), "pvm": kvmprobe.Decide(pvm), "none": kvmprobe.Decide(none)}
}

// TestChooseDefaultBackend: auto is microvm only with hardware KVM, the
// Firecracker binaries and a microvm backend that opens, else container
// with the reason; an explicit backend is honoured, or refused naming
// node.default_backend and the cause.
func TestChooseDefaultBackend(t *testing.T) {
	res := probeResults()
	opened := runtimefake.New(runtimefake.Config{})
	openOK := func() (runtime.Runtime, error) { return opened, nil }
	openFails := func() (runtime.Runtime, error) {
		return nil, errdefs.New(errdefs.ErrUnimplemented, "microvm backend: the sandbox lifecycle is not built yet")
	}
	noBinary := func() error {
		return errdefs.New(errdefs.ErrFailedPrecondition, "microvm backend: /usr/local/bin/firecracker (node.backends.microvm.firecracker_path): no such file or directory")
	}
	binaryOK := func() error { return nil }
	mustNotCall := func() (runtime.Runtime, error) {
		t.Error("the microvm backend was opened though an earlier check failed")
		return nil, errors.New("unexpected open")
	}
	r := func(name string) *kvmprobe.Result { v := res[name]; return &v }
	for _, tc := range []struct {
		name        string
		f           backendFacts
		backend     string
		reason      []string // substrings
		opened      bool     // the microvm backend auto opened is returned
		err         error    // category
		errContains []string
	}{
		{name: "auto on pvm", f: backendFacts{Setting: "auto", Configured: []string{"container", "gvisor", "vm"}, Accel: r("pvm"), Binaries: binaryOK, OpenMicroVM: mustNotCall},
			backend: "container", reason: []string{"microvm needs hardware KVM: ", res["pvm"].Reason, "kvm_pvm"}},
		{name: "empty is auto", f: backendFacts{Configured: []string{"container"}, Accel: r("none"), OpenMicroVM: mustNotCall},
			backend: "container", reason: []string{"microvm needs hardware KVM: ", "cannot be opened"}},
		{name: "auto without detection", f: backendFacts{Setting: "auto", Configured: []string{"container"}, AccelErr: errors.New("boot id: permission denied"), OpenMicroVM: mustNotCall},
			backend: "container", reason: []string{"microvm needs hardware KVM", "could not be detected", "boot id: permission denied"}},
		{name: "auto hardware without firecracker", f: backendFacts{Setting: "auto", Configured: []string{"container"}, Accel: r("hardware"), Binaries: noBinary, OpenMicroVM: mustNotCall},
			backend: "container", reason: []string{"microvm needs Firecracker", "firecracker_path"}},
		{name: "auto hardware backend refuses", f: backendFacts{Setting: "auto", Configured: []string{"container"}, Accel: r("hardware"), Binaries: binaryOK, OpenMicroVM: openFails},
			backend: "container", reason: []string{"the microvm backend does not open here", "not built yet"}},
		{name: "auto hardware opens", f: backendFacts{Setting: "auto", Configured: []string{"container"}, Accel: r("hardware"), Binaries: binaryOK, OpenMicroVM: openOK},
			backend: "microvm", reason: []string{"auto: ", res["hardware"].Reason, "Firecracker is installed"}, opened: true},
		{name: "auto hardware microvm configured", f: backendFacts{Setting: "auto", Configured: []string{"container", "microvm"}, Accel: r("hardware"), Binaries: binaryOK, OpenMicroVM: mustNotCall},
			backend: "microvm", reason: []string{"auto: "}},
		{name: "auto without container", f: backendFacts{Setting: "auto", Configured: []string{"gvisor"}, Accel: r("pvm"), OpenMicroVM: mustNotCall},
			err: errdefs.ErrInvalidArgument, errContains: []string{"node.default_backend", "container is not in node.backends", "gvisor"}},
		{name: "explicit container on pvm", f: backendFacts{Setting: "container", Configured: []string{"container", "vm"}, Accel: r("pvm"), OpenMicroVM: mustNotCall},
			backend: "container", reason: []string{"set by node.default_backend"}},
		{name: "explicit vm", f: backendFacts{Setting: "vm", Configured: []string{"container", "vm"}, Accel: r("pvm"), OpenMicroVM: mustNotCall},
			backend: "vm", reason: []string{"set by node.default_backend"}},
		{name: "explicit unconfigured", f: backendFacts{Setting: "gvisor", Configured: []string{"container"}, Accel: r("hardware"), OpenMicroVM: mustNotCall},
			err: errdefs.ErrInvalidArgument, errContains: []string{"node.default_backend", `"gvisor" is not a configured backend`, "have container"}},
		{name: "explicit microvm on pvm", f: backendFacts{Setting: "microvm", Configured: []string{"container"}, Accel: r("pvm"), OpenMicroVM: mustNotCall},
			err: errdefs.ErrFailedPrecondition, errContains: []string{"node.default_backend", "cannot run it", "microvm needs hardware KVM", "kvm_pvm", `set it to "auto" or container`}},
		{name: "explicit microvm hardware refuses", f: backendFacts{Setting: "microvm", Configured: []string{"container"}, Accel: r("hardware"), Binaries: binaryOK, OpenMicroVM: openFails},
			err: errdefs.ErrFailedPrecondition, errContains: []string{"node.default_backend", "does not open here"}},
		{name: "explicit microvm hardware opens", f: backendFacts{Setting: "microvm", Configured: []string{"container"}, Accel: r("hardware"), Binaries: binaryOK, OpenMicroVM: openOK},
			backend: "microvm", reason: []string{"set by node.default_backend", "hardware KVM"}, opened: true},
	} {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			c, rt, err := chooseDefaultBackend(tc.f)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("err = %v, want %v", err, tc.err)
				}
				for _, s := range tc.errContains {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q lacks %q", err, s)
					}
				}
				if rt != nil {
					t.Errorf("a refused choice returned an opened backend")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Backend != tc.backend {
				t.Fatalf("chose %s (%s), want %s", c.Backend, c.Reason, tc.backend)
			}
			for _, s := range tc.reason {
				if !strings.Contains(c.Reason, s) {
					t.Errorf("reason %q lacks %q", c.Reason, s)
				}
			}
			if (rt != nil) != tc.opened {
				t.Errorf("opened backend returned: %v, want %v", rt != nil, tc.opened)
			}
			if want := "default backend: " + c.Backend + " (" + c.Reason + ")"; c.String() != want {
				t.Errorf("String() = %q, want %q", c.String(), want)
			}
		})
	}
}

// TestDefaultBackendThisHost: on this project's machines (/dev/kvm is PVM)
// the default config's auto picks container and says it is because
// microvm needs hardware KVM, quoting the PVM probe; a config naming
// microvm is refused with the same cause. Elsewhere it checks that the
// choice agrees with the probe.
func TestDefaultBackendThisHost(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	r, err := kvmprobe.Detect(ctx, kvmprobe.Options{CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	cfg := config.Default(t.TempDir())
	if cfg.Node.DefaultBackend != config.DefaultBackendAuto {
		t.Fatalf("default node.default_backend = %q, want %q", cfg.Node.DefaultBackend, config.DefaultBackendAuto)
	}
	c, rt, err := chooseDefaultBackend(hostBackendFacts(ctx, cfg, runtime.Env{NodeID: cfg.Node.ID}, []string{"container"}, &r, nil))
	if err != nil {
		t.Fatal(err)
	}
	if rt != nil {
		_ = closeRuntime(rt)
	}
	t.Log(c)
	if r.HardwareKVM() {
		// The microvm backend's lifecycle is not built: it refuses to
		// open, so auto still says container, naming that.
		if c.Backend != "container" || !strings.Contains(c.Reason, "microvm") {
			t.Fatalf("on hardware KVM: %s", c)
		}
		t.Skip("hardware KVM here: the PVM classification is checked on the project's machines")
	}
	if want := "default backend: container (microvm needs hardware KVM: " + r.Reason + ")"; c.String() != want {
		t.Fatalf("got %q, want %q", c, want)
	}
	if _, err := os.Stat("/sys/module/kvm_pvm"); err == nil {
		if r.Kind != kvmprobe.KindPVM || !strings.Contains(c.Reason, "PVM (kvm_pvm)") {
			t.Fatalf("on this PVM host: %s (probe %s)", c, r)
		}
	}
	cfg.Node.DefaultBackend = "microvm"
	if _, _, err := chooseDefaultBackend(hostBackendFacts(ctx, cfg, runtime.Env{}, []string{"container"}, &r, nil)); !errors.Is(err, errdefs.ErrFailedPrecondition) ||
		!strings.Contains(err.Error(), "node.default_backend") || !strings.Contains(err.Error(), r.Reason) {
		t.Fatalf("node.default_backend microvm on this host: %v; want a failed precondition naming the field and the probe's reason", err)
	}
}
