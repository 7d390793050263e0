package runtime

import (
	"os"
	"path/filepath"
	"testing"
)

// TestCgroupMemory: the v2 file, else the v1 memory controller's, else 0.
func TestCgroupMemory(t *testing.T) {
	root := t.TempDir()
	write := func(rel, v string) {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("opendsec/v2/memory.current", "4096\n")
	write("memory/opendsec/v1/memory.usage_in_bytes", "8192\n")
	for path, want := range map[string]int64{"opendsec/v2": 4096, "opendsec/v1": 8192, "opendsec/gone": 0} {
		if got := cgroupMemoryAt(root, path); got != want {
			t.Errorf("cgroupMemoryAt(%q) = %d; want %d", path, got, want)
		}
	}
}
