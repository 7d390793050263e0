package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
	"github.com/kernflux/opendsec/internal/runtime/microvm"
)

// backendChoice is the node's default backend and why.
type backendChoice struct {
	Backend string
	Reason  string
}

// String is the line `opendsec up`, `opendsec accel` and the quickstart
// print: "default backend: container (microvm needs hardware KVM: ...)".
func (c backendChoice) String() string {
	return "default backend: " + c.Backend + " (" + c.Reason + ")"
}

// backendFacts are what the default backend is chosen from; tests inject
// them.
type backendFacts struct {
	// Setting is node.default_backend: "auto" (or empty) or a backend name.
	Setting string
	// Configured are the backends node.backends opened.
	Configured []string
	// Accel is the accelerator decision (nil when detection failed, with
	// AccelErr saying why).
	Accel    *kvmprobe.Result
	AccelErr error
	// Binaries checks that Firecracker is installed (microvm.CheckBinaries).
	Binaries func() error
	// OpenMicroVM opens the microvm backend; asked only when microvm is
	// not configured and the checks above pass.
	OpenMicroVM func() (runtime.Runtime, error)
}

// chooseDefaultBackend decides the node's default backend. "auto" is
// microvm where the microvm backend can run here (hardware KVM per the
// accelerator probe, Firecracker installed, the backend opens), else
// container, with the reason microvm could not. An explicit name is
// honoured when that backend is configured and, for microvm, can run;
// else it is refused naming node.default_backend and the cause. The
// returned Runtime is the microvm backend auto opened (nil otherwise), for
// the node to add to its backends.
func chooseDefaultBackend(f backendFacts) (backendChoice, runtime.Runtime, error) {
	const field = "node.default_backend"
	configured := func(name string) bool { return slices.Contains(f.Configured, name) }
	setting := f.Setting
	if setting == "" {
		setting = config.DefaultBackendAuto
	}
	if setting != config.DefaultBackendAuto && setting != microvm.Name {
		if !configured(setting) {
			return backendChoice{}, nil, errdefs.Invalid(field, "%q is not a configured backend (have %s); add node.backends.%s or use %q",
				setting, strings.Join(f.Configured, ", "), setting, config.DefaultBackendAuto)
		}
		return backendChoice{Backend: setting, Reason: "set by " + field}, nil, nil
	}
	why, opened := microvmUnavailable(f, configured(microvm.Name))
	if setting == microvm.Name {
		if why != "" {
			if opened != nil {
				_ = closeRuntime(opened)
			}
			return backendChoice{}, nil, errdefs.New(errdefs.ErrFailedPrecondition, "%s: is %q but this node cannot run it: %s; set it to %q or container",
				field, microvm.Name, why, config.DefaultBackendAuto)
		}
		return backendChoice{Backend: microvm.Name, Reason: "set by " + field + "; " + f.Accel.Reason}, opened, nil
	}
	if why == "" {
		return backendChoice{Backend: microvm.Name, Reason: "auto: " + f.Accel.Reason + ", and Firecracker is installed"}, opened, nil
	}
	if !configured("container") {
		return backendChoice{}, nil, errdefs.Invalid(field, "is %q, which picks microvm or container, but %s and container is not in node.backends; name a configured backend (have %s)",
			config.DefaultBackendAuto, why, strings.Join(f.Configured, ", "))
	}
	return backendChoice{Backend: "container", Reason: why}, nil, nil
}

// microvmUnavailable says why the microvm backend cannot run on this node
// ("" when it can), and returns it opened when it was not configured and
// opened now.
func microvmUnavailable(f backendFacts, configured bool) (string, runtime.Runtime) {
	switch {
	case f.Accel == nil:
		return fmt.Sprintf("microvm needs hardware KVM: the accelerator could not be detected: %v", f.AccelErr), nil
	case !f.Accel.HardwareKVM():
		return "microvm needs hardware KVM: " + f.Accel.Reason, nil
	case configured:
		// node.backends.microvm opened with the node: it runs here.
		return "", nil
	}
	if f.Binaries != nil {
		if err := f.Binaries(); err != nil {
			return "microvm needs Firecracker: " + err.Error(), nil
		}
	}
	if f.OpenMicroVM == nil {
		return "microvm is not in this build", nil
	}
	rt, err := f.OpenMicroVM()
	if err != nil {
		return "the microvm backend does not open here: " + err.Error(), nil
	}
	return "", rt
}

// closeRuntime closes rt when it holds anything (an io.Closer).
func closeRuntime(rt runtime.Runtime) error {
	if c, ok := rt.(interface{ Close() error }); ok {
		return c.Close()
	}
	return nil
}

// hostBackendFacts gathers the facts for cfg on this host: the configured
// backends (opened), the accelerator decision, Firecracker's binaries and
// the microvm backend's open.
func hostBackendFacts(ctx context.Context, cfg config.Config, env runtime.Env, configured []string, accel *kvmprobe.Result, accelErr error) backendFacts {
	raw := cfg.Node.Backends[microvm.Name]
	return backendFacts{
		Setting:    cfg.Node.DefaultBackend,
		Configured: configured,
		Accel:      accel,
		AccelErr:   accelErr,
		Binaries:   func() error { return microvm.CheckBinaries(raw) },
		OpenMicroVM: func() (runtime.Runtime, error) {
			rts, err := runtime.Open(ctx, env, map[string]json.RawMessage{microvm.Name: raw})
			if err != nil {
				return nil, err
			}
			return rts[microvm.Name], nil
		},
	}
}
