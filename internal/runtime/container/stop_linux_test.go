package container

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestStopKillsEveryProcessAtOnce: Stop without a grace period (the node's
// stop) kills init by pidfd; when it returns no process of the sandbox is
// left in its cgroups (a background `sleep` included), runc reports it
// stopped, and Wait says it was stopped, not that it crashed. Delete then
// leaves nothing.
func TestStopKillsEveryProcessAtOnce(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	ctx := t.Context()
	if res, err := runtimetest.Run(ctx, rt, spec.ID, "", "/bin/sh", "-c", "sleep 1000 </dev/null >/dev/null 2>&1 & echo started"); err != nil || !strings.Contains(res.Stdout, "started") {
		t.Fatalf("start a background process: %+v, %v", res, err)
	}
	c := rt.(*Runtime)
	procs := func() []string {
		var out []string
		for _, dir := range c.CgroupDirs(spec.ID) {
			b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
			if err != nil {
				continue
			}
			out = append(out, strings.Fields(string(b))...)
		}
		return out
	}
	if n := len(procs()); n < 3 {
		t.Fatalf("%d processes in the sandbox's cgroups before the stop; want init, the agent and sleep", n)
	}
	st, err := rt.Status(ctx, spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Stop(ctx, spec.ID, runtime.StopOptions{}); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if left := procs(); len(left) > 0 {
		t.Fatalf("processes left in the sandbox's cgroups when Stop returned: %v", left)
	}
	if pidAlive(st.Pid) {
		t.Fatalf("init %d alive after Stop", st.Pid)
	}
	if s, err := rt.Status(ctx, spec.ID); err != nil || s.State != runtime.StateStopped {
		t.Fatalf("status after stop: %+v, %v; want stopped", s, err)
	}
	ex, err := rt.Wait(ctx, spec.ID)
	if err != nil || ex.Reason != "stopped" {
		t.Fatalf("wait after stop: %+v, %v; want reason stopped", ex, err)
	}
	if err := rt.Delete(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	runtimetest.AssertNoLeftovers(t, spec.StateDir, st.Pid)
}

// TestStartedRootLeavesTheHostMountTable: once a sandbox runs, its root is
// no longer mounted in the node's mount namespace (each later `runc run`
// copies that table), yet the sandbox's writes still land in its upper
// layer on the host.
func TestStartedRootLeavesTheHostMountTable(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	var bundle, root unix.Stat_t
	if err := unix.Stat(spec.StateDir, &bundle); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(filepath.Join(spec.StateDir, rootfsDir), &root); err != nil {
		t.Fatal(err)
	}
	if root.Dev != bundle.Dev {
		t.Fatalf("the started sandbox's root is still mounted on the host (%s)", filepath.Join(spec.StateDir, rootfsDir))
	}
	if res, err := runtimetest.Run(t.Context(), rt, spec.ID, "", "/bin/sh", "-c", "echo hi > /written && cat /written"); err != nil || res.Stdout != "hi\n" {
		t.Fatalf("write in the sandbox: %+v, %v", res, err)
	}
	sb, err := rt.(*Runtime).get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(sb.st.upper(), "written")); err != nil || string(b) != "hi\n" {
		t.Fatalf("the write in the upper layer on the host: %q, %v", b, err)
	}
}
