package container

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestCrunHiddenLeftoversRemoved: crun on a hybrid host leaves
// <cgroup path>/cgroup.procs under the hidden cgroup2 mount point for
// every container; Delete removes them, and the sweep at start removes
// those of containers that are gone while keeping a live one's.
func TestCrunHiddenLeftoversRemoved(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	r := rt.(*Runtime)
	if r.oci.kind != OCIRuntimeCrun || r.oci.hideUnified == "" {
		t.Skipf("only crun on a hybrid cgroup host leaves files under the hidden cgroup2 mount point (runtime %s, hidden %q)", r.oci.kind, r.oci.hideUnified)
	}
	if r.oci.hidden == nil {
		t.Fatalf("crun on a hybrid host (%s hidden) but the directory under it was not opened", r.oci.hideUnified)
	}
	fd := int(r.oci.hidden.Fd())
	exists := func(rel string) bool {
		var st unix.Stat_t
		return unix.Fstatat(fd, strings.Trim(rel, "/"), &st, unix.AT_SYMLINK_NOFOLLOW) == nil
	}
	ctx := t.Context()

	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	sb, err := r.get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	path := sb.st.CgroupPath
	if !exists(path + "/cgroup.procs") {
		t.Fatalf("no %s/cgroup.procs under the hidden mount point: crun no longer leaves it? (then this cleanup can go)", path)
	}
	if err := rt.Delete(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if exists(path) {
		t.Fatalf("%s is still under the hidden mount point after Delete", path)
	}

	// An earlier run's leftover beside a live sandbox's.
	live, _ := runtimetest.StartSandbox(t, rt, tmpl)
	lsb, err := r.get(live.ID)
	if err != nil {
		t.Fatal(err)
	}
	gone := filepath.Join(strings.Trim(r.cfg.CgroupParent, "/"), "gone-"+live.ID)
	if err := unix.Mkdirat(fd, gone, 0o755); err != nil {
		t.Fatal(err)
	}
	pfd, err := unix.Openat(fd, gone+"/cgroup.procs", unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	_ = unix.Close(pfd)
	n, err := r.oci.sweepHidden(r.cfg.CgroupParent, func(id string) bool {
		_, err := os.Lstat(filepath.Join(r.cfg.StateRoot, id))
		return err == nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if exists(gone) {
		t.Fatalf("the sweep left %s (removed %d)", gone, n)
	}
	if n < 1 {
		t.Fatalf("the sweep removed %d containers' leftovers, want at least the one made here", n)
	}
	if !exists(lsb.st.CgroupPath + "/cgroup.procs") {
		t.Fatalf("the sweep removed the live sandbox's %s", lsb.st.CgroupPath)
	}
	if err := rt.Delete(ctx, live.ID); err != nil {
		t.Fatal(err)
	}
	if exists(lsb.st.CgroupPath) {
		t.Fatalf("%s is still under the hidden mount point after Delete", lsb.st.CgroupPath)
	}
}
