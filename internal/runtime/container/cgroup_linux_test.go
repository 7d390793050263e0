package container

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func writeFiles(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestCgroupStatsV2(t *testing.T) {
	root := t.TempDir()
	writeFiles(t, filepath.Join(root, "opendsec", "sb"), map[string]string{
		"memory.current": "1048576\n",
		"pids.current":   "3\n",
		"cpu.stat":       "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\n",
	})
	m := cgroupMounts{v2: true, unified: root}
	st, err := m.stats("/opendsec/sb")
	if err != nil {
		t.Fatal(err)
	}
	if st.MemoryBytes != 1<<20 || st.Pids != 3 || st.CPUNanos != 2500000 {
		t.Fatalf("stats %+v", st)
	}
	if d := m.dirs("/opendsec/sb"); !slices.Equal(d, []string{filepath.Join(root, "opendsec", "sb")}) {
		t.Fatalf("v2 dirs %v", d)
	}
	if err := m.remove(t.Context(), "/opendsec/sb"); err == nil {
		t.Fatalf("removed a cgroup dir that still has files (rmdir must refuse)")
	}
	if err := m.remove(t.Context(), "/opendsec/missing"); err != nil {
		t.Fatalf("remove of a missing cgroup: %v", err)
	}
}

func TestCgroupStatsV1(t *testing.T) {
	root := t.TempDir()
	m := cgroupMounts{v1: map[string]string{}, unified: filepath.Join(root, "unified")}
	for _, c := range []string{"memory", "pids", "cpuacct", "name=systemd"} {
		m.v1[c] = filepath.Join(root, c)
	}
	writeFiles(t, filepath.Join(root, "memory", "opendsec", "sb"), map[string]string{"memory.usage_in_bytes": "4096\n"})
	writeFiles(t, filepath.Join(root, "pids", "opendsec", "sb"), map[string]string{"pids.current": "7\n"})
	writeFiles(t, filepath.Join(root, "cpuacct", "opendsec", "sb"), map[string]string{"cpuacct.usage": "123456\n"})
	st, err := m.stats("/opendsec/sb")
	if err != nil {
		t.Fatal(err)
	}
	if st.MemoryBytes != 4096 || st.Pids != 7 || st.CPUNanos != 123456 {
		t.Fatalf("stats %+v", st)
	}
	d := m.dirs("/opendsec/sb")
	if len(d) != 5 || !slices.Contains(d, filepath.Join(root, "unified", "opendsec", "sb")) {
		t.Fatalf("v1 dirs %v: want every hierarchy plus unified", d)
	}
	if _, err := m.stats("/opendsec/other"); err == nil {
		t.Fatalf("stats of a missing cgroup succeeded")
	}
}

func TestDetectCgroupsHost(t *testing.T) {
	m, err := detectCgroups()
	if err != nil {
		t.Fatal(err)
	}
	if m.v2 {
		if m.unified == "" {
			t.Fatal("v2 without a unified mount")
		}
	} else if m.v1["memory"] == "" || m.v1["pids"] == "" {
		t.Fatalf("v1 host without memory/pids hierarchies: %v", m.v1)
	}
	t.Logf("cgroup v2=%v unified=%q v1=%v", m.v2, m.unified, m.v1)
}

func TestUnescapeMount(t *testing.T) {
	if got := unescapeMount(`/a\040b`); got != "/a b" {
		t.Fatalf("got %q", got)
	}
}
