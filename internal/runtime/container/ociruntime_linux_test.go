package container

import (
	"os"
	"os/exec"
	"testing"
)

// testOCIRuntimeEnv names the OCI runtime the package's root tests run
// under: auto (the default, what users get: crun where it works), runc or
// crun. CI runs the package once with the default and once with runc
// (Makefile, test-go).
const testOCIRuntimeEnv = "OPENDSEC_TEST_OCI_RUNTIME"

// testOCIRuntime is the OCI runtime the package's tests use.
func testOCIRuntime(t testing.TB) string {
	t.Helper()
	switch v := os.Getenv(testOCIRuntimeEnv); v {
	case "", OCIRuntimeAuto:
		return OCIRuntimeAuto
	case OCIRuntimeRunc, OCIRuntimeCrun:
		requireOCIRuntime(t, v)
		return v
	default:
		t.Fatalf("%s=%q: give auto, runc or crun", testOCIRuntimeEnv, v)
		return ""
	}
}

// requireOCIRuntime skips the test when the runtime's binary is not
// installed, except under CI (CI=true), which installs both
// (scripts/install-deps.sh): there it fails.
func requireOCIRuntime(t testing.TB, kind string) {
	t.Helper()
	if _, err := exec.LookPath(kind); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s is not installed (%v); CI installs it with scripts/install-deps.sh", kind, err)
		}
		t.Skipf("%s is not installed (%v): apt-get install %s", kind, err, kind)
	}
}

// ociRuntimes are the runtimes a test runs under, one subtest each.
var ociRuntimes = []string{OCIRuntimeRunc, OCIRuntimeCrun}
