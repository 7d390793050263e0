package microvm

import (
	"context"
	"encoding/json"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
)

// detect is kvmprobe.Detect; tests replace it.
var detect = kvmprobe.Detect

// open builds the backend (node.backends.microvm). It refuses a host
// without hardware KVM, quoting the detector's reason, and one without the
// firecracker and jailer binaries.
func open(ctx context.Context, env runtime.Env, raw json.RawMessage) (runtime.Runtime, error) {
	cfg, err := parseConfig(raw)
	if err != nil {
		return nil, err
	}
	res, err := detect(ctx, kvmprobe.Options{DevPath: cfg.KVMDevice})
	if err != nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "microvm backend: accelerator detection: %w", err)
	}
	// kvm is hardware KVM, or PVM with an operator's PVM guest kernel
	// that passed the detector's boot probe.
	if res.Accel != kvmprobe.AccelKVM {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "microvm backend needs hardware KVM (or PVM with a PVM guest kernel) and this host has none: %s; use the vm (QEMU) or gvisor backend here", res.Reason)
	}
	if err := checkBinaries(cfg); err != nil {
		return nil, err
	}
	return New(cfg, env, res), nil
}
