package container

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestCrunHiddenLeftoversRemoved: crun on a hybrid host, run where only
// the cgroup2 mount is unmounted, leaves <cgroup path>/cgroup.procs under
// the bare mount point for every container; with a /sys/fs/cgroup view of
// its own (cgview_linux.go) it leaves nothing there. Delete removes such
// leftovers, and the sweep at start removes those of containers that are
// gone while keeping a live one's.
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
	ownView := r.oci.view.root != ""
	left := exists(path + "/cgroup.procs")
	if ownView && left {
		t.Fatalf("crun runs with a cgroup view of its own but left %s/cgroup.procs under the hidden mount point", path)
	}
	if !ownView && !left {
		t.Fatalf("no %s/cgroup.procs under the hidden mount point: crun no longer leaves it? (then this cleanup can go)", path)
	}
	// What an older node's crun left of a container (made here when
	// crun leaves nothing itself).
	leave := func(rel string) {
		t.Helper()
		dir := ""
		for _, elem := range strings.Split(strings.Trim(rel, "/"), "/") {
			dir = filepath.Join(dir, elem)
			if err := unix.Mkdirat(fd, dir, 0o755); err != nil && err != unix.EEXIST {
				t.Fatal(err)
			}
		}
		pfd, err := unix.Openat(fd, dir+"/cgroup.procs", unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		_ = unix.Close(pfd)
	}
	if ownView {
		leave(path)
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
	leave(gone)
	if ownView {
		leave(lsb.st.CgroupPath)
	}
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
