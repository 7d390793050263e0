package container

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// On a v1 host whose cpuset root balances load, a sandbox's cpuset is made
// without load balancing of its own (no scheduler domain rebuild on its
// CPUs' copy or its removal), still gets the parent's CPUs and memory
// nodes from the OCI runtime, holds the sandbox's processes and goes with
// Delete.
func TestSandboxCpusetNotLoadBalanced(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	r := rt.(*Runtime)
	mnt, ok := r.cg.v1["cpuset"]
	if r.cg.v2 || !ok {
		t.Skip("no cgroup v1 cpuset hierarchy on this host")
	}
	if !r.cg.cpusetLoadBalanced() {
		t.Skip("the cpuset root does not balance load: sandboxes' cpusets keep the kernel's default")
	}
	if !r.quietCpusets {
		t.Fatal("cpuset root balances load but the runtime does not make quiet cpusets")
	}
	read := func(p string) string {
		t.Helper()
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	// The parent exists from the first sandbox on: the second is quiet
	// for sure.
	runtimetest.StartSandbox(t, rt, tmpl)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	sb, err := r.get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(mnt, sb.st.CgroupPath)
	if got := read(filepath.Join(dir, "cpuset.sched_load_balance")); got != "0" {
		t.Fatalf("%s: cpuset.sched_load_balance %s, want 0", dir, got)
	}
	parent := filepath.Dir(dir)
	if got, want := read(filepath.Join(dir, "cpuset.cpus")), read(filepath.Join(parent, "cpuset.cpus")); got == "" || got != want {
		t.Fatalf("sandbox cpuset.cpus %q, want the parent's %q", got, want)
	}
	if got, want := read(filepath.Join(dir, "cpuset.mems")), read(filepath.Join(parent, "cpuset.mems")); got == "" || got != want {
		t.Fatalf("sandbox cpuset.mems %q, want the parent's %q", got, want)
	}
	if procs := read(filepath.Join(dir, "cgroup.procs")); procs == "" {
		t.Fatalf("no process in the sandbox's cpuset %s", dir)
	}
	if err := rt.Delete(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("%s after Delete: %v, want it gone", dir, err)
	}
}
