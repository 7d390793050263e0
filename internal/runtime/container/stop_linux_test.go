package container

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
	if err := unix.Stat(filepath.Join(spec.StateDir, tmpDir), &bundle); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(filepath.Join(spec.StateDir, tmpDir, rootfsDir), &root); err != nil {
		t.Fatal(err)
	}
	if root.Dev != bundle.Dev {
		t.Fatalf("the started sandbox's root is still mounted on the host (%s)", filepath.Join(spec.StateDir, tmpDir, rootfsDir))
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

// TestRuncInvocationsPerCreateAndStop counts the runc processes a cold
// create and a node stop run (through a wrapper that logs each one's
// arguments and execs the real runc): a create is one `runc run --detach`;
// Stop (pidfd kill) and Delete of the stopped sandbox are one `runc delete
// --force`, with no `runc state` (init's end is already known).
func TestRuncInvocationsPerCreateAndStop(t *testing.T) {
	kind := testOCIKind(t)
	real, err := exec.LookPath(kind)
	if err != nil {
		t.Fatalf("%s: %v", kind, err)
	}
	dir := t.TempDir()
	logf := filepath.Join(dir, "runc-calls.log")
	wrapper := filepath.Join(dir, kind)
	script := "#!/bin/sh\necho \"$*\" >>" + logf + "\nexec " + real + " \"$@\"\n"
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil { //nolint:gosec // an executable
		t.Fatal(err)
	}
	calls := func() []string {
		b, err := os.ReadFile(logf)
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		var out []string
		for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			if l != "" && l != "--version" && !isProbeCall(l) {
				out = append(out, l)
			}
		}
		if err := os.Truncate(logf, 0); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		return out
	}
	f := newFactoryWith(t, func(c *Config) { withOCIBinary(c, kind, wrapper) })
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	if got := calls(); len(got) != 1 || !strings.Contains(got[0], " run --detach ") {
		t.Fatalf("runc calls of a create: %q; want one `runc run --detach`", got)
	}
	ctx := t.Context()
	if err := rt.Stop(ctx, spec.ID, runtime.StopOptions{}); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if err := rt.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if got := calls(); len(got) != 1 || !strings.Contains(got[0], " delete --force ") {
		t.Fatalf("runc calls of stop and delete: %q; want one `runc delete --force`", got)
	}
	if _, err := os.Stat(filepath.Join(rt.(*Runtime).cfg.StateRoot, spec.ID)); !os.IsNotExist(err) {
		t.Fatalf("runc state dir of %s after delete: %v; want it gone", spec.ID, err)
	}
	for _, d := range rt.(*Runtime).CgroupDirs(spec.ID) {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("cgroup %s after delete: %v; want it gone", d, err)
		}
	}
	runtimetest.AssertNoLeftovers(t, spec.StateDir, 0)

	// A stop with a grace period signals through runc; once init is gone
	// no `runc state` confirms it.
	spec, _ = runtimetest.StartSandbox(t, rt, tmpl)
	calls()
	if err := rt.Stop(ctx, spec.ID, runtime.StopOptions{Timeout: 10 * time.Second}); err != nil {
		t.Fatalf("stop with a grace period: %v", err)
	}
	if err := rt.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	got := calls()
	if len(got) < 3 || !strings.Contains(got[0], " state ") || !strings.Contains(got[len(got)-1], " delete --force ") {
		t.Fatalf("runc calls of a graceful stop and delete: %q; want state, kill, delete", got)
	}
	for _, c := range got[1 : len(got)-1] {
		if !strings.Contains(c, " kill --all ") {
			t.Fatalf("runc calls of a graceful stop and delete: %q; want only kills between the first state and the delete", got)
		}
	}
	runtimetest.AssertNoLeftovers(t, spec.StateDir, 0)
}
