package container

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// deadPid returns the pid of a process that has ended and been reaped.
func deadPid(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	return cmd.Process.Pid
}

// TestProbeLeftoversSwept: a node that died between its crun probe's
// create and delete left the probe's bundle dir, the created container
// (its init alive) and its cgroups; the next node's start removes them,
// and the empty probe cgroups of other dead nodes, and leaves alone the
// probe dir and cgroups of a process still alive.
func TestProbeLeftoversSwept(t *testing.T) {
	requireOCIRuntime(t, OCIRuntimeCrun)
	f := newFactoryWith(t, func(c *Config) { c.OCIRuntime = OCIRuntimeCrun })
	rt, _ := f(t)
	r := rt.(*Runtime)
	o, cfg, cg := r.oci, r.cfg, r.cg
	// A temp dir and a cgroup parent of the test's own: a node that other
	// tests start meanwhile sweeps the shared ones.
	t.Setenv("TMPDIR", t.TempDir())
	parent := "/opendsec-probe-sweep-test-" + strconv.Itoa(os.Getpid())
	cfg.CgroupParent = parent + "/sandboxes"
	t.Cleanup(func() {
		_ = removeCgroupParent(cg, cfg.CgroupParent)
		_ = removeCgroupParent(cg, parent)
		o.dropHidden(parent, "/")
	})

	// A dead node's probe, created and never deleted.
	dead := deadPid(t)
	id := probeIDPrefix + strconv.Itoa(dead)
	dir, err := os.MkdirTemp("", probeDirPrefix+strconv.Itoa(dead)+".")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := writeProbeBundle(&cfg, dir, id); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	run := o.probeRunner(ctx, dir, filepath.Join(dir, "state"))
	if err := run("create", "--bundle", dir, id); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // should the sweep have failed
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		o.probeRunner(ctx, t.TempDir(), filepath.Join(dir, "state"))("delete", "--force", id)
	})
	var initPid int
	for _, d := range cg.dirs(filepath.Join(parent, id)) {
		if b, err := os.ReadFile(filepath.Join(d, "cgroup.procs")); err == nil && len(b) > 0 {
			initPid, _ = strconv.Atoi(strings.Fields(string(b))[0])
			break
		}
	}
	if initPid <= 0 {
		t.Fatalf("the probe container's init is in none of %v", cg.dirs(filepath.Join(parent, id)))
	}

	// Another dead node's empty probe cgroups, and a live process's (the
	// go command's) probe dir and cgroups.
	dead2 := probeIDPrefix + strconv.Itoa(deadPid(t))
	live := probeIDPrefix + strconv.Itoa(os.Getppid())
	for _, name := range []string{dead2, live} {
		for _, d := range cg.dirs(filepath.Join(parent, name)) {
			if err := os.MkdirAll(d, 0o755); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Rmdir(d) })
		}
	}
	liveDir, err := os.MkdirTemp("", probeDirPrefix+strconv.Itoa(os.Getppid())+".")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(liveDir) })

	if n := o.sweepProbes(&cfg, cg); n != 2 {
		t.Errorf("sweepProbes removed %d leftovers, want 2: the dead probe container and the other's cgroups", n)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the dead node's probe dir is still there: %v", err)
	}
	// The init ends (a zombie until its parent reaps it).
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(initPid) + "/stat")
		if err != nil || strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))[0] == "Z" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the leftover probe container's init %d still runs: %s", initPid, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, name := range []string{id, dead2} {
		for _, d := range cg.dirs(filepath.Join(parent, name)) {
			if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("dead node's probe cgroup %s is still there: %v", d, err)
			}
		}
	}
	for _, d := range cg.dirs(filepath.Join(parent, live)) {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("a live process's probe cgroup %s was removed: %v", d, err)
		}
	}
	if _, err := os.Stat(liveDir); err != nil {
		t.Errorf("a live process's probe dir was removed: %v", err)
	}
}
