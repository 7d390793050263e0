//go:build linux

// Package e2e runs OpenDsec's binaries for real, as root: `opendsec up` with
// the container backend, the real agent and runc, driven through the public
// API exactly as SDKs drive it (test/harness).
package e2e

import (
	"testing"

	"github.com/kernflux/opendsec/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// system is a harness.System with this package's helpers as methods.
type system struct{ *harness.System }

// newSystem is harness.New: fresh ports, busybox imported, warm pool off.
func newSystem(t *testing.T) *system { return &system{harness.New(t)} }

// newSystemPool is harness.NewPool: node.warm_pool.size = poolSize.
func newSystemPool(t *testing.T, poolSize int) *system {
	return &system{harness.NewPool(t, poolSize)}
}
