package container

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestCPULimitInCgroup: config.json gives no CPU period (cpuResources),
// and each OCI runtime's cgroup holds the sandbox's quota for the
// kernel's default period of 100 ms: 0.5 CPU is 50000 of 100000 µs.
func TestCPULimitInCgroup(t *testing.T) {
	for _, kind := range ociRuntimes {
		t.Run(kind, func(t *testing.T) {
			requireOCIRuntime(t, kind)
			f := newFactoryWith(t, func(c *Config) { c.OCIRuntime = kind })
			rt, tmpl := f(t)
			tmpl.Resources.CPU = 0.5
			spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
			r := rt.(*Runtime)
			cgPath := r.cgroupPath(spec.ID)
			if r.cg.v2 {
				b, err := os.ReadFile(filepath.Join(r.cg.unified, cgPath, "cpu.max"))
				if err != nil || strings.TrimSpace(string(b)) != "50000 100000" {
					t.Fatalf("cpu.max: %q %v, want 50000 100000", b, err)
				}
				return
			}
			dir := filepath.Join(r.cg.v1["cpu"], cgPath)
			quota, err := readInt(filepath.Join(dir, "cpu.cfs_quota_us"))
			if err != nil || quota != 50000 {
				t.Fatalf("cpu.cfs_quota_us: %d %v, want 50000", quota, err)
			}
			period, err := readInt(filepath.Join(dir, "cpu.cfs_period_us"))
			if err != nil || period != 100000 {
				t.Fatalf("cpu.cfs_period_us: %d %v, want 100000", period, err)
			}
			// The sandbox sees the same in its own cgroup view.
			res := sh(t, rt, spec.ID, "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us 2>/dev/null || cat /sys/fs/cgroup/cpu.max")
			if res.ExitCode != 0 || !(res.Stdout == "50000\n100000\n" || res.Stdout == "50000 100000\n") {
				t.Fatalf("the limit inside the sandbox: %+v", res)
			}
		})
	}
}
