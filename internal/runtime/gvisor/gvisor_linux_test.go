package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// runscPath is the runsc the tests use: $OPENDSEC_RUNSC, else the one
// scripts/install-deps.sh caches, else runsc in PATH.
func runscPath(t testing.TB) string {
	if p := os.Getenv("OPENDSEC_RUNSC"); p != "" {
		return p
	}
	if _, err := os.Stat(defaultCachedRunsc); err == nil {
		return defaultCachedRunsc
	}
	p, err := exec.LookPath("runsc")
	if err != nil {
		t.Fatalf("no runsc: run scripts/install-deps.sh (it builds a pinned runsc into %s) or set OPENDSEC_RUNSC", defaultCachedRunsc)
	}
	return p
}

const defaultCachedRunsc = "/var/cache/opendsec/gvisor/runsc"

func newFactory(t *testing.T) runtimetest.Factory {
	testutil.RequiresRoot(t)
	// Not a TempDir: runsc keeps a bind mount of an empty netns
	// (null-netns) in its root for --network=none, for the root's life.
	root := "/run/opendsec/gvisor-test"
	layer := testutil.BusyboxRootfs(t)
	agent := testutil.AgentBinary(t)
	runsc := runscPath(t)
	return func(t *testing.T) (runtime.Runtime, runtime.Spec) {
		rt, err := New(t.Context(), Config{RunscPath: runsc, StateRoot: filepath.Join(root, "runsc"), CgroupParent: "/opendsec-gvisor-test", AgentPath: agent})
		if err != nil {
			t.Fatalf("new gvisor runtime: %v", err)
		}
		return rt, runtime.Spec{
			Rootfs:    runtime.Rootfs{Image: "test/busybox", Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: layer}}},
			Resources: runtime.Resources{CPU: 1, MemoryMB: 256, PidsLimit: 128},
		}
	}
}

// killInit ends a sandbox from outside, as `kill -9` of its sandbox process.
func killInit(t testing.TB, rt runtime.Runtime, id string) {
	t.Helper()
	st, err := rt.Status(context.Background(), id)
	if err != nil || st.Pid <= 0 {
		t.Fatalf("status of %s: %+v %v", id, st, err)
	}
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 %d: %v", st.Pid, err)
	}
}

func TestConformance(t *testing.T) {
	runtimetest.Suite(t, newFactory(t), runtimetest.Options{Exec: true, Kill: killInit, Concurrency: 6})
}

// TestOpenMissingRunsc: a runsc that is not there is a clear error at Open.
func TestOpenMissingRunsc(t *testing.T) {
	agent := filepath.Join(t.TempDir(), "opendsec-agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := runtime.Open(t.Context(), runtime.Env{StateDir: t.TempDir()}, map[string]json.RawMessage{
		Name: []byte(`{"runsc_path":"/nonexistent/runsc","agent_path":"` + agent + `","state_root":"` + t.TempDir() + `"}`),
	})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "gvisor.runsc_path") || !strings.Contains(err.Error(), "install-deps.sh") {
		t.Fatalf("open with a missing runsc: %v; want a failed precondition naming gvisor.runsc_path and the install script", err)
	}
	_, err = runtime.Open(t.Context(), runtime.Env{}, map[string]json.RawMessage{Name: []byte(`{"platform":"kvm","agent_path":"` + agent + `"}`)})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "gvisor.platform") {
		t.Fatalf("open with platform kvm: %v; want an invalid argument naming gvisor.platform", err)
	}
}

// TestForkKeepsMemory: a shell holding a random value and a counter in its
// memory is forked into 2; each fork has the value, counts on from where
// the source was, and a file written in one fork is not in the other.
func TestForkKeepsMemory(t *testing.T) {
	rt, tmpl := newFactory(t)(t)
	ctx := t.Context()
	src, _ := runtimetest.StartSandbox(t, rt, tmpl)
	// The value lives only in the shell's memory; the loop writes it out.
	if res, err := runtimetest.Run(ctx, rt, src.ID, "", "/bin/sh", "-c",
		`(v=$(head -c8 /dev/urandom | od -An -tx1 | tr -d ' \n'); i=0; while :; do i=$((i+1)); echo "$v $i" > /c.tmp && mv /c.tmp /c; sleep 0.02; done) >/dev/null 2>&1 </dev/null &`); err != nil || res.ExitCode != 0 {
		t.Fatalf("start counter: %v %+v", err, res)
	}
	v0, n0 := waitCounter(t, rt, src.ID, 5)
	var specs []runtime.Spec
	for i := range 2 {
		s := tmpl
		s.ID = runtimetest.NewID("gvfork" + strconv.Itoa(i))
		s.StateDir = filepath.Join(t.TempDir(), "sb")
		s.Guest.Hostname = "fork" + strconv.Itoa(i)
		specs = append(specs, s)
	}
	res, err := rt.(runtime.Forker).Fork(ctx, src.ID, specs)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	for _, s := range specs {
		t.Cleanup(func() {
			_ = rt.Stop(context.Background(), s.ID, runtime.StopOptions{})
			_ = rt.Delete(context.Background(), s.ID)
		})
	}
	for i, r := range res {
		if !r.MemoryPreserved {
			t.Fatalf("fork %d: MemoryPreserved is false", i)
		}
		if err := rt.Start(ctx, specs[i].ID); err != nil {
			t.Fatalf("start fork %d: %v", i, err)
		}
	}
	for _, s := range specs {
		v, n := waitCounter(t, rt, s.ID, n0)
		if v != v0 {
			t.Fatalf("fork %s holds value %q, the source %q", s.ID, v, v0)
		}
		// Counting on from the checkpoint, not from 1.
		v, n2 := waitCounter(t, rt, s.ID, n+5)
		if v != v0 || n2 < n0 {
			t.Fatalf("fork %s: %q %d after %d", s.ID, v, n2, n0)
		}
	}
	if err := runtimetest.WriteFile(ctx, rt, specs[0].ID, "/only-here", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := runtimetest.ReadFile(ctx, rt, specs[1].ID, "/only-here"); err == nil {
		t.Fatalf("a file written in fork 0 is visible in fork 1")
	}
	if _, err := runtimetest.ReadFile(ctx, rt, src.ID, "/only-here"); err == nil {
		t.Fatalf("a file written in fork 0 is visible in the source")
	}
	// The source runs on.
	if _, n := waitCounter(t, rt, src.ID, n0+5); n <= n0 {
		t.Fatalf("source counter stuck at %d", n)
	}
}

// waitCounter polls the loop's /c until its count is at least n.
func waitCounter(t testing.TB, rt runtime.Runtime, id string, n int) (string, int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	var last string
	var lastErr error
	defer func() {
		if t.Failed() {
			t.Logf("last error: %v", lastErr)
		}
	}()
	for time.Now().Before(deadline) {
		res, err := runtimetest.Run(t.Context(), rt, id, "", "cat", "/c")
		lastErr = err
		if err == nil && res.ExitCode == 0 {
			last = strings.TrimSpace(res.Stdout)
			if v, c, ok := strings.Cut(last, " "); ok {
				if k, err := strconv.Atoi(c); err == nil && k >= n {
					return v, k
				}
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("counter of %s did not reach %d in 20 s (last %q)", id, n, last)
	return "", 0
}

// TestDiskQuota: the root overlay holds at most disk_mb; a write past it
// fails with ENOSPC and what fits stays readable.
func TestDiskQuota(t *testing.T) {
	rt, tmpl := newFactory(t)(t)
	tmpl.Resources.DiskMB = 16
	sb, _ := runtimetest.StartSandbox(t, rt, tmpl)
	res, err := runtimetest.Run(t.Context(), rt, sb.ID, "", "/bin/sh", "-c", "dd if=/dev/zero of=/big bs=1M count=32")
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode == 0 || !strings.Contains(res.Stderr, "No space left") {
		t.Fatalf("writing 32 MiB with a 16 MiB quota: %+v; want ENOSPC", res)
	}
	res, err = runtimetest.Run(t.Context(), rt, sb.ID, "", "/bin/sh", "-c", "rm /big && dd if=/dev/zero of=/small bs=1M count=4 && echo ok")
	if err != nil || res.ExitCode != 0 || !strings.Contains(res.Stdout, "ok") {
		t.Fatalf("writing 4 MiB after freeing the space: %v %+v", err, res)
	}
}

// TestDiffRootfsWhiteouts: a file deleted from the image is a 0/0
// character device in the diff, a replaced directory is opaque.
func TestDiffRootfsWhiteouts(t *testing.T) {
	rt, tmpl := newFactory(t)(t)
	sb, _ := runtimetest.StartSandbox(t, rt, tmpl)
	if res, err := runtimetest.Run(t.Context(), rt, sb.ID, "", "/bin/sh", "-c", "rm /bin/ls && rm -rf /usr/sbin && mkdir /usr/sbin && echo n > /usr/sbin/new"); err != nil || res.ExitCode != 0 {
		t.Fatalf("change the root: %v %+v", err, res)
	}
	err := rt.(runtime.RootfsDiffer).DiffRootfs(t.Context(), sb.ID, func(_ context.Context, d runtime.RootfsDiff) error {
		var st syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(d.Dir, "bin", "ls"), &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFCHR || st.Rdev != 0 {
			t.Errorf("deleted /bin/ls in the diff: %+v %v; want a 0/0 character device", st, err)
		}
		buf := make([]byte, 8)
		n, err := syscall.Getxattr(filepath.Join(d.Dir, "usr", "sbin"), "trusted.overlay.opaque", buf)
		if err != nil || string(buf[:n]) != "y" {
			t.Errorf("replaced /usr/sbin: opaque %q %v; want y", buf[:max(n, 0)], err)
		}
		if b, err := os.ReadFile(filepath.Join(d.Dir, "usr", "sbin", "new")); err != nil || string(b) != "n\n" {
			t.Errorf("new file: %q %v", b, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The sandbox runs on after the diff paused it.
	if res, err := runtimetest.Run(t.Context(), rt, sb.ID, "", "cat", "/usr/sbin/new"); err != nil || res.Stdout != "n\n" {
		t.Fatalf("after the diff: %v %+v", err, res)
	}
}

// TestSeccomp: Docker's default profile holds inside the sandbox (gVisor
// enforces it on the guest's syscalls): unshare, which needs no capability
// for a user namespace but is refused without CAP_SYS_ADMIN by the
// profile, fails; ordinary work runs.
func TestSeccomp(t *testing.T) {
	rt, tmpl := newFactory(t)(t)
	sb, _ := runtimetest.StartSandbox(t, rt, tmpl)
	res, err := runtimetest.Run(t.Context(), rt, sb.ID, "", "/bin/sh", "-c", "unshare -U true")
	if err != nil || res.ExitCode == 0 || !strings.Contains(res.Stderr, "not permitted") {
		t.Fatalf("unshare -U in the sandbox: %v %+v; want EPERM from the seccomp profile", err, res)
	}
	if res, err := runtimetest.Run(t.Context(), rt, sb.ID, "", "/bin/sh", "-c", "echo ok | cat"); err != nil || res.Stdout != "ok\n" {
		t.Fatalf("a pipe under the profile: %v %+v", err, res)
	}
}
