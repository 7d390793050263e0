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
func open(ctx context.Context, _ runtime.Env, raw json.RawMessage) (runtime.Runtime, error) {
	cfg, err := parseConfig(raw)
	if err != nil {
		return nil, err
	}
	res, err := detect(ctx, kvmprobe.Options{DevPath: cfg.KVMDevice})
	if err != nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "microvm backend: accelerator detection: %w", err)
	}
	if !res.HardwareKVM() {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "microvm backend needs hardware KVM and this host has none: %s; use the vm (QEMU) or gvisor backend here", res.Reason)
	}
	if err := checkBinaries(cfg); err != nil {
		return nil, err
	}
	// The jailed process lifecycle around Boot, CreateSnapshot and Load
	// (start, pidfd wait, stop, recover) is not built yet.
	return nil, errdefs.New(errdefs.ErrUnimplemented, "microvm backend: the sandbox lifecycle around Firecracker is not built yet (issue 13 part 4); use the vm backend")
}
