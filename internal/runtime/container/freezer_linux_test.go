package container

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// The v2 freezer: cgroup.freeze is written and cgroup.events' "frozen" is
// awaited. A fake cgroup dir stands in for the kernel, which flips the
// event a moment later.
func TestFreezerV2(t *testing.T) {
	root := t.TempDir()
	d := filepath.Join(root, "opendsec", "sb")
	writeFiles(t, d, map[string]string{"cgroup.freeze": "0\n", "cgroup.events": "populated 1\nfrozen 0\n"})
	m := cgroupMounts{v2: true, unified: root}
	go func() {
		// The "kernel": report frozen once cgroup.freeze says 1.
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) {
			if b, _ := os.ReadFile(filepath.Join(d, "cgroup.freeze")); strings.TrimSpace(string(b)) == "1" {
				// Replaced atomically: the reader never sees a half-written file.
				tmp := filepath.Join(d, "events.tmp")
				os.WriteFile(tmp, []byte("populated 1\nfrozen 1\n"), 0o644)
				os.Rename(tmp, filepath.Join(d, "cgroup.events"))
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	if err := m.setFrozen(t.Context(), "/opendsec/sb", true); err != nil {
		t.Fatal(err)
	}
	if ok, err := m.frozen("/opendsec/sb"); err != nil || !ok {
		t.Fatalf("frozen = %v, %v", ok, err)
	}
	if err := m.setFrozen(t.Context(), "/opendsec/sb", false); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(d, "cgroup.freeze")); string(b) != "0" {
		t.Fatalf("cgroup.freeze = %q after thaw, want 0", b)
	}
	if err := m.setFrozen(t.Context(), "/opendsec/missing", true); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("freeze of a missing cgroup: %v, want failed precondition", err)
	}
}

func TestFreezerV1NoController(t *testing.T) {
	m := cgroupMounts{v1: map[string]string{"memory": t.TempDir()}}
	if err := m.setFrozen(t.Context(), "/opendsec/sb", true); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("freeze without a freezer hierarchy: %v, want failed precondition", err)
	}
}

func TestCgroupStatsLimits(t *testing.T) {
	root := t.TempDir()
	writeFiles(t, filepath.Join(root, "opendsec", "sb"), map[string]string{
		"memory.current": "1048576\n",
		"memory.max":     "134217728\n",
		"memory.stat":    "anon 100\nfile 4096\n",
		"pids.current":   "3\n",
		"pids.max":       "max\n",
		"cpu.stat":       "usage_usec 1\n",
	})
	st, err := cgroupMounts{v2: true, unified: root}.stats("/opendsec/sb")
	if err != nil {
		t.Fatal(err)
	}
	if st.MemoryLimitBytes != 128<<20 || st.MemoryCacheBytes != 4096 || st.PidsLimit != 0 {
		t.Fatalf("stats %+v: want limit 128 MiB, cache 4096, pids limit 0 (max)", st)
	}
}
