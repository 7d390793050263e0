//go:build !linux

package container

import (
	"context"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Runtime is the container backend; it runs only on Linux. Off Linux it
// embeds the interfaces the Linux one implements, so it keeps their method
// sets whatever that contract grows (code and tests above it compile); New
// never returns one, so no method is ever called.
type Runtime struct {
	runtime.Runtime
	runtime.Prestarter
	runtime.Pauser
	runtime.StatsReader
	runtime.RootfsDiffer
	runtime.Forker
	runtime.Reclaimer
	runtime.FilesystemPauser
}

// New reports that the container backend needs Linux.
func New(cfg Config) (*Runtime, error) {
	return nil, errdefs.New(errdefs.ErrUnimplemented, "the container backend runs only on Linux")
}

// newBackend is New for the registry.
func newBackend(_ context.Context, cfg Config) (runtime.Runtime, error) {
	_, err := New(cfg)
	return nil, err
}

// CgroupDirs returns nothing: there are no sandboxes off Linux.
func (r *Runtime) CgroupDirs(string) []string { return nil }
