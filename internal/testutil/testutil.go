// Package testutil holds helpers shared by tests: privileged-test gates that
// fail loudly and shared fixtures.
package testutil

import (
	"os"
	"testing"
)

// RequiresRoot skips t unless the process is root. When OPENDSEC_ROOT_TESTS=1
// (set by `make test` and CI) a non-root run fails instead of skipping, so a
// privileged suite can never silently pass.
func RequiresRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("OPENDSEC_ROOT_TESTS") == "1" {
		t.Fatal("OPENDSEC_ROOT_TESTS=1 but not running as root: run the privileged tests as root")
	}
	t.Skip("needs root (run as root, or set OPENDSEC_ROOT_TESTS=1 to make this an error)")
}

// RequiresKVM skips t with the reason when /dev/kvm is missing.
func RequiresKVM(t testing.TB) {
	t.Helper()
	if _, err := os.Stat("/dev/kvm"); err != nil {
		t.Skip("needs /dev/kvm (not present on this machine): " + err.Error())
	}
}
