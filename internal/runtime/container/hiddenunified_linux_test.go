package container

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/osthread"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// underUnified runs fn in a private mount namespace where the hybrid
// host's cgroup2 mount is gone: fn sees what lies under its mount point,
// on the /sys/fs/cgroup tmpfs.
func underUnified(t *testing.T, unified string, fn func() error) {
	t.Helper()
	c := make(chan error, 1)
	osthread.Throwaway(func() {
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			c <- err
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			c <- err
			return
		}
		if err := unix.Unmount(unified, unix.MNT_DETACH); err != nil {
			c <- err
			return
		}
		c <- fn()
	})
	if err := <-c; err != nil {
		t.Fatal(err)
	}
}

// TestCrunLeavesNothingUnderHiddenUnified: on a hybrid host crun runs
// where the cgroup2 mount is hidden (hideMount). It used to make
// <unified>/<cgroup path>/cgroup.procs on the tmpfs under that mount
// point for every container, never removed. Now a crun sandbox leaves
// nothing there, and what an earlier node left under its cgroup parent
// is swept when the runc namespace is made.
func TestCrunLeavesNothingUnderHiddenUnified(t *testing.T) {
	requireOCIRuntime(t, OCIRuntimeCrun)
	cg, err := detectCgroups()
	if err != nil {
		t.Fatal(err)
	}
	if cg.v2 || cg.unified == "" {
		t.Skip("not a hybrid cgroup host")
	}
	var parent string
	f := newFactoryWith(t, func(c *Config) {
		c.OCIRuntime = OCIRuntimeCrun
		c.CgroupParent = "/opendsec-test-hidden"
		parent = c.CgroupParent
	})
	// An earlier node's leftover, as crun made them.
	old := filepath.Join(cg.unified, "opendsec-test-hidden", "sb-old")
	underUnified(t, cg.unified, func() error {
		if err := os.MkdirAll(old, 0o755); err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(old, "cgroup.procs"), []byte("1\n"), 0o700)
	})
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	if res := sh(t, rt, spec.ID, "echo ok"); res.ExitCode != 0 || res.Stdout != "ok\n" {
		t.Fatalf("sandbox: %+v", res)
	}
	mine := filepath.Join(cg.unified, parent, spec.ID)
	underUnified(t, cg.unified, func() error {
		var st unix.Statfs_t
		if err := unix.Statfs(cg.unified, &st); err != nil || st.Type != unix.TMPFS_MAGIC {
			t.Errorf("under the cgroup2 mount: statfs %v type %#x, want the tmpfs", err, st.Type)
		}
		if _, err := os.Lstat(mine); !os.IsNotExist(err) {
			t.Errorf("%s under the hidden cgroup2 mount: %v, want nothing", mine, err)
		}
		if _, err := os.Lstat(old); !os.IsNotExist(err) {
			t.Errorf("an earlier node's %s: %v, want swept", old, err)
		}
		return nil
	})
	// The sandbox is still in its cgroup v1 hierarchies.
	if _, err := os.Stat(filepath.Join(cg.v1["memory"], parent, spec.ID)); err != nil {
		t.Fatalf("memory cgroup: %v", err)
	}
}
