//go:build !linux

package netpolicy

import (
	"context"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// RecoverReport says what Recover did.
type RecoverReport struct {
	Kept    []string
	Removed []string
}

// Manager is unavailable off Linux.
type Manager struct{}

var errNotLinux = errdefs.New(errdefs.ErrUnimplemented, "sandbox networking needs Linux")

// New fails off Linux.
func New(ctx context.Context, cfg Config, dataDir string) (*Manager, error) { return nil, errNotLinux }

// Close does nothing.
func (m *Manager) Close() error { return nil }

// Planned returns an empty Network: sandbox networks are Linux-only.
func (m *Manager) Planned(id string) Network { return Network{ID: id} }

// PlannedWith returns an empty Network: sandbox networks are Linux-only.
func (m *Manager) PlannedWith(id string, opts SetupOptions) Network { return Network{ID: id} }

// Setup fails off Linux.
func (m *Manager) Setup(ctx context.Context, id string, rules Rules) (Network, error) {
	return Network{}, errNotLinux
}

// SetupWith fails off Linux.
func (m *Manager) SetupWith(ctx context.Context, id string, rules Rules, opts SetupOptions) (Network, error) {
	return Network{}, errNotLinux
}

// SetRules fails off Linux.
func (m *Manager) SetRules(ctx context.Context, id string, rules Rules) error { return errNotLinux }

// Teardown fails off Linux.
func (m *Manager) Teardown(ctx context.Context, id string) error { return errNotLinux }

// Recover fails off Linux.
func (m *Manager) Recover(ctx context.Context, live func(id string) bool) (RecoverReport, error) {
	return RecoverReport{}, errNotLinux
}

// Validate checks rules against this node's rule sets.
func (m *Manager) Validate(rules Rules) error { return errNotLinux }
