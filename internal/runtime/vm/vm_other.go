//go:build !linux

package vm

import (
	"context"
	"fmt"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// New fails: the vm backend runs only on Linux.
func New(ctx context.Context, cfg Config) (runtime.Runtime, error) {
	return nil, fmt.Errorf("vm backend: %w: it runs only on linux", errdefs.ErrUnimplemented)
}
