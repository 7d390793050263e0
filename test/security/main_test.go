//go:build linux

// Package security is the end-to-end regression suite of issue 11's
// findings: each test runs a real `opendsec up` (test/harness) as root.
package security

import (
	"testing"

	"github.com/kernflux/opendsec/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
