package container

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/runtime/sched"
)

// TestCPUClassBestEffortYields runs a CPU-bound loop in a latency sandbox
// and in a best_effort one, both pinned to one CPU, and checks from the
// cgroups' CPU accounting that the latency one gets most of that CPU. Other
// work on the machine takes from both, so the check is a ratio.
func TestCPUClassBestEffortYields(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	lat, be := tmpl, tmpl
	be.CPUClass = runtime.CPUBestEffort
	lat, _ = runtimetest.StartSandbox(t, rt, lat)
	be, _ = runtimetest.StartSandbox(t, rt, be)
	cpu := unix.CPUSet{}
	cpu.Set(lastCPU(t))
	for _, id := range []string{lat.ID, be.ID} {
		// The loop is the agent's child: it inherits init's policy.
		res, err := runtimetest.Run(t.Context(), rt, id, "", "sh", "-c", "while :; do :; done >/dev/null 2>&1 & echo $!")
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("start the loop in %s: %v %+v", id, err, res)
		}
		for _, pid := range cgroupPids(t, c, id) {
			if err := unix.SchedSetaffinity(pid, &cpu); err != nil {
				t.Fatalf("pin %d of %s: %v", pid, id, err)
			}
		}
	}
	for _, pid := range cgroupPids(t, c, be.ID) {
		if p, err := sched.Policy(pid); err == nil && p != unix.SCHED_IDLE {
			t.Fatalf("best_effort sandbox's pid %d has policy %d, want SCHED_IDLE", pid, p)
		}
	}
	for _, pid := range cgroupPids(t, c, lat.ID) {
		if p, err := sched.Policy(pid); err == nil && p == unix.SCHED_IDLE {
			t.Fatalf("latency sandbox's pid %d is SCHED_IDLE", pid)
		}
	}
	if !c.cg.v2 {
		if b, err := os.ReadFile(filepath.Join(c.cg.v1["cpu"], c.cgroupPath(be.ID), "cpu.shares")); err != nil || strings.TrimSpace(string(b)) != "2" {
			t.Fatalf("best_effort cpu.shares %q, %v; want 2", b, err)
		}
	}
	l0, b0 := cpuUsage(t, c, lat.ID), cpuUsage(t, c, be.ID)
	window := time.NewTimer(3 * time.Second) // the measurement window
	<-window.C
	l, b := cpuUsage(t, c, lat.ID)-l0, cpuUsage(t, c, be.ID)-b0
	t.Logf("over 3s on one CPU: latency %v, best_effort %v of CPU", time.Duration(l), time.Duration(b))
	if l < 4*b || l < int64(300*time.Millisecond) {
		t.Fatalf("latency sandbox got %v and best_effort %v of one shared CPU: want the latency one at least 4x the other", time.Duration(l), time.Duration(b))
	}
}

// lastCPU is the highest CPU this process may run on.
func lastCPU(t *testing.T) int {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		t.Fatal(err)
	}
	last := 0
	for i := range 1024 {
		if set.IsSet(i) {
			last = i
		}
	}
	return last
}

// cgroupPids lists the host pids in sandbox id's cgroup.
func cgroupPids(t *testing.T, c *Runtime, id string) []int {
	t.Helper()
	dir := filepath.Join(c.cg.unified, c.cgroupPath(id))
	if !c.cg.v2 {
		dir = filepath.Join(c.cg.v1["pids"], c.cgroupPath(id))
	}
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if p, err := strconv.Atoi(f); err == nil {
			pids = append(pids, p)
		}
	}
	if len(pids) == 0 {
		t.Fatalf("no processes in %s", dir)
	}
	return pids
}

// cpuUsage is sandbox id's CPU time in nanoseconds from its cgroup.
func cpuUsage(t *testing.T, c *Runtime, id string) int64 {
	t.Helper()
	if c.cg.v2 {
		b, err := os.ReadFile(filepath.Join(c.cg.unified, c.cgroupPath(id), "cpu.stat"))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
				n, _ := strconv.ParseInt(v, 10, 64)
				return n * 1000
			}
		}
		t.Fatal("no usage_usec in cpu.stat")
	}
	b, err := os.ReadFile(filepath.Join(c.cg.v1["cpuacct"], c.cgroupPath(id), "cpuacct.usage"))
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
