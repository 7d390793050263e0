package seccompbpf

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestInstallRefusesBadPrograms: a missing file or one that is not whole
// 8-byte instructions is refused before anything is installed.
func TestInstallRefusesBadPrograms(t *testing.T) {
	dir := t.TempDir()
	odd := filepath.Join(dir, "odd")
	if err := os.WriteFile(odd, []byte("123456789"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{
		filepath.Join(dir, "missing"): "read seccomp filter",
		odd:                           "9 bytes is not 1 to 4096 8-byte instructions",
		empty:                         "0 bytes",
	} {
		if err := Install(path); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Install(%s) = %v; want an error containing %q", filepath.Base(path), err, want)
		}
	}
	// Nothing was installed: no_new_privs is still off in this process.
	if v, err := unix.PrctlRetInt(unix.PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0); err != nil || v != 0 {
		t.Fatalf("no_new_privs = %d (%v) after refused installs", v, err)
	}
}
