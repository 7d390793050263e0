//go:build !linux

package container

import (
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Runtime is the container backend; it runs only on Linux.
type Runtime struct{}

// New reports that the container backend needs Linux.
func New(cfg Config) (*Runtime, error) {
	return nil, errdefs.New(errdefs.ErrUnimplemented, "the container backend runs only on Linux")
}

// newBackend is New for the registry.
func newBackend(cfg Config) (runtime.Runtime, error) {
	_, err := New(cfg)
	return nil, err
}
