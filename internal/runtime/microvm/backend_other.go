//go:build !linux

package microvm

import (
	"context"
	"encoding/json"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// open reports that Firecracker needs Linux.
func open(context.Context, runtime.Env, json.RawMessage) (runtime.Runtime, error) {
	return nil, errdefs.New(errdefs.ErrUnimplemented, "the microvm backend runs only on Linux with hardware KVM")
}
