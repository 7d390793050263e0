package container

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
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
	if r.cpuset != nil {
		t.Skip("crun runs without the cpuset hierarchy: the sandboxes share one cpuset (TestSandboxesShareOneCpuset)")
	}
	if !r.cg.cpusetLoadBalanced() {
		t.Skip("the cpuset root does not balance load: sandboxes' cpusets keep the kernel's default")
	}
	if !r.quietCpusets {
		t.Fatal("cpuset root balances load but the runtime does not make quiet cpusets")
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
	if got := readTrimmed(t, filepath.Join(dir, "cpuset.sched_load_balance")); got != "0" {
		t.Fatalf("%s: cpuset.sched_load_balance %s, want 0", dir, got)
	}
	parent := filepath.Dir(dir)
	if got, want := readTrimmed(t, filepath.Join(dir, "cpuset.cpus")), readTrimmed(t, filepath.Join(parent, "cpuset.cpus")); got == "" || got != want {
		t.Fatalf("sandbox cpuset.cpus %q, want the parent's %q", got, want)
	}
	if got, want := readTrimmed(t, filepath.Join(dir, "cpuset.mems")), readTrimmed(t, filepath.Join(parent, "cpuset.mems")); got == "" || got != want {
		t.Fatalf("sandbox cpuset.mems %q, want the parent's %q", got, want)
	}
	if procs := readTrimmed(t, filepath.Join(dir, "cgroup.procs")); procs == "" {
		t.Fatalf("no process in the sandbox's cpuset %s", dir)
	}
	if err := rt.Delete(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("%s after Delete: %v, want it gone", dir, err)
	}
}

// With crun on a host whose cpuset controller has a hierarchy of its own,
// no sandbox gets a cpuset cgroup: all start in the one shared cpuset
// under the sandboxes' parent, which holds every CPU and memory node of
// the parent, and in its cgroup namespace a sandbox sees that cgroup as
// its root, with no other cgroup of the host's cpuset tree below it.
func TestSandboxesShareOneCpuset(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	r := rt.(*Runtime)
	if r.oci.kind != OCIRuntimeCrun {
		t.Skipf("the OCI runtime is %s: each sandbox has a cpuset of its own", r.oci.kind)
	}
	mnt, ok := r.cg.v1["cpuset"]
	if r.cg.v2 || !ok {
		t.Skip("no cgroup v1 cpuset hierarchy on this host")
	}
	alone := filepath.Dir(mnt) == "/sys/fs/cgroup"
	for c, m := range r.cg.v1 {
		alone = alone && (c == "cpuset" || m != mnt)
	}
	if !alone {
		t.Skipf("cpuset shares its hierarchy at %s: crun must see it", mnt)
	}
	if r.cpuset == nil || !r.oci.view.hidesCpuset() {
		t.Fatal("crun with a cpuset hierarchy of its own at /sys/fs/cgroup/cpuset, but the sandboxes get one cpuset each")
	}
	if r.quietCpusets {
		t.Fatal("the runtime still makes a quiet cpuset per sandbox")
	}
	shared := filepath.Join(r.cfg.CgroupParent, SharedCpusetName)
	for range 2 {
		spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
		sb, err := r.get(spec.ID)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(mnt, sb.st.CgroupPath)); !os.IsNotExist(err) {
			t.Fatalf("sandbox %s has a cpuset cgroup of its own (stat: %v)", spec.ID, err)
		}
		pid := int(sb.pid.Load())
		if got := cgroupOf(t, pid, "cpuset"); got != shared {
			t.Fatalf("init of %s is in cpuset %q, want the shared %q", spec.ID, got, shared)
		}
		// Its other cgroups are its own, as before.
		if got := cgroupOf(t, pid, "memory"); got != sb.st.CgroupPath {
			t.Fatalf("init of %s is in memory cgroup %q, want %q", spec.ID, got, sb.st.CgroupPath)
		}
		// What the sandbox sees (through its root, in its mount
		// namespace): the shared cgroup's files, no cgroup below it.
		view := filepath.Join("/proc", strconv.Itoa(pid), "root", "sys/fs/cgroup/cpuset")
		ents, err := os.ReadDir(view)
		if err != nil {
			t.Fatal(err)
		}
		files := 0
		for _, e := range ents {
			if e.IsDir() {
				t.Fatalf("the sandbox sees cpuset cgroup %s/%s: its cgroup namespace is not rooted at the shared cpuset", view, e.Name())
			}
			files++
		}
		if files == 0 {
			t.Fatalf("the sandbox's %s is empty: no cpuset hierarchy mounted there", view)
		}
	}
	dir := filepath.Join(mnt, shared)
	parent := filepath.Dir(dir)
	if got, want := readTrimmed(t, filepath.Join(dir, "cpuset.cpus")), readTrimmed(t, filepath.Join(parent, "cpuset.cpus")); got == "" || got != want {
		t.Fatalf("shared cpuset.cpus %q, want the parent's %q", got, want)
	}
	if got, want := readTrimmed(t, filepath.Join(dir, "cpuset.mems")), readTrimmed(t, filepath.Join(parent, "cpuset.mems")); got == "" || got != want {
		t.Fatalf("shared cpuset.mems %q, want the parent's %q", got, want)
	}
	if r.cg.cpusetLoadBalanced() {
		if got := readTrimmed(t, filepath.Join(dir, "cpuset.sched_load_balance")); got != "0" {
			t.Fatalf("shared cpuset.sched_load_balance %s, want 0", got)
		}
	}
}

// readTrimmed returns the contents of file p without surrounding space.
func readTrimmed(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// cgroupOf returns the path of pid's cgroup in the v1 hierarchy of
// controller, as the host sees it.
func cgroupOf(t *testing.T, pid int, controller string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == controller {
				return parts[2]
			}
		}
	}
	t.Fatalf("pid %d is in no %s cgroup: %s", pid, controller, b)
	return ""
}

// The shared cpuset removed under the node is made again by the next
// creates, several at once, each of which starts in it.
func TestSharedCpusetMadeAgain(t *testing.T) {
	f, parent := ownParentFactory(t, "cpuset", nil)
	rt, tmpl := f(t)
	r := rt.(*Runtime)
	if r.cpuset == nil {
		t.Skipf("the sandboxes do not share a cpuset here (runtime %s)", r.oci.kind)
	}
	dir := filepath.Join(r.cg.v1["cpuset"], parent, SharedCpusetName)
	if err := os.Remove(dir); err != nil {
		t.Fatalf("remove the shared cpuset (no sandbox in it yet): %v", err)
	}
	const n = 3
	ids := make([]string, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		spec := runtimetest.Prepare(t, rt, tmpl)
		ids[i] = spec.ID
		wg.Go(func() {
			ctx := context.Background()
			if _, err := rt.Create(ctx, spec); err != nil {
				errs <- fmt.Errorf("create %s: %w", spec.ID, err)
				return
			}
			if err := rt.Start(ctx, spec.ID); err != nil {
				errs <- fmt.Errorf("start %s: %w", spec.ID, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	shared := filepath.Join(parent, SharedCpusetName)
	for _, id := range ids {
		sb, err := r.get(id)
		if err != nil {
			t.Fatal(err)
		}
		if got := cgroupOf(t, int(sb.pid.Load()), "cpuset"); got != shared {
			t.Fatalf("init of %s is in cpuset %q, want the shared %q made again", id, got, shared)
		}
	}
}
