//go:build !linux

package gvisor

import (
	"context"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// New fails: runsc runs on Linux only.
func New(ctx context.Context, cfg Config) (runtime.Runtime, error) {
	return nil, errdefs.New(errdefs.ErrFailedPrecondition, "the gvisor backend runs on Linux only")
}
