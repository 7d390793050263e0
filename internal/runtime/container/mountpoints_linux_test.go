package container

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// Every bind mount config.json puts under /.opendsec has its mount point
// in the shared layer: the OCI runtime makes none in the sandbox's upper.
func TestMountPointFilesCoverSpec(t *testing.T) {
	sp, err := ociSpec(testConfig(), testSpec(), "/opendsec/sb1")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range sp.Mounts {
		if !strings.HasPrefix(m.Destination, mountPointDirInSandbox+"/") {
			continue
		}
		n++
		if !slices.Contains(mountPointFiles, m.Destination) {
			t.Errorf("mount %s has no mount point in the shared layer (mountPointFiles %v)", m.Destination, mountPointFiles)
		}
	}
	if n != len(mountPointFiles) {
		t.Errorf("config.json mounts %d files under %s, the layer has %d", n, mountPointDirInSandbox, len(mountPointFiles))
	}
}

// The layer is made once, found intact by a later run, and made again
// (the damaged one moved aside, not changed) when it is not exactly the
// layer.
func TestMountPointLayerMadeAndChecked(t *testing.T) {
	testutil.RequiresRoot(t)
	parent := filepath.Join(t.TempDir(), "shared")
	dir, err := makeMountPointLayer(parent, mountPointFiles)
	if err != nil {
		t.Fatal(err)
	}
	if !mountPointLayerIntact(dir, mountPointFiles) {
		t.Fatalf("new layer %s is not intact", dir)
	}
	if st, err := os.Stat(parent); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("shared dir: %v %v, want 0700", st, err)
	}
	for _, f := range mountPointFiles {
		st, err := os.Lstat(filepath.Join(dir, f))
		if err != nil || !st.Mode().IsRegular() || st.Mode().Perm() != 0o700 || st.Size() != 0 {
			t.Errorf("%s: %v %v, want an empty 0700 file", f, st, err)
		}
	}
	if again, err := makeMountPointLayer(parent, mountPointFiles); err != nil || again != dir {
		t.Fatalf("second make: %q %v, want %q", again, err, dir)
	}
	// Damaged three ways: each is made again.
	for _, damage := range []func(){
		func() { os.WriteFile(filepath.Join(dir, mountPointDirInSandbox, "extra"), nil, 0o700) },
		func() { os.WriteFile(filepath.Join(dir, mountPointFiles[0]), []byte("x"), 0o700) },
		func() { os.Chmod(filepath.Join(dir, mountPointDirInSandbox), 0o777) },
	} {
		damage()
		if mountPointLayerIntact(dir, mountPointFiles) {
			t.Fatal("damaged layer reported intact")
		}
		if again, err := makeMountPointLayer(parent, mountPointFiles); err != nil || again != dir {
			t.Fatalf("make after damage: %q %v", again, err)
		}
		if !mountPointLayerIntact(dir, mountPointFiles) {
			t.Fatal("layer made again after damage is not intact")
		}
	}
	old, _ := filepath.Glob(filepath.Join(parent, "mountpoints-old.*", "layer"))
	if len(old) != 3 {
		t.Fatalf("damaged layers moved aside: %v, want 3", old)
	}
	// A different set of mount points is another directory.
	other, err := makeMountPointLayer(parent, mountPointFiles[:1])
	if err != nil || other == dir || !mountPointLayerIntact(other, mountPointFiles[:1]) || !mountPointLayerIntact(dir, mountPointFiles) {
		t.Fatalf("layer of another set: %q %v", other, err)
	}
}

// A started sandbox finds its mount points in the shared layer: its
// writable layer holds no /.opendsec, the sandbox sees /.opendsec as crun
// made it (root's, 0755) with the mounts on it, and what its root writes
// there goes to its own upper layer, never into the shared one.
func TestMountPointsFromSharedLayer(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	r := rt.(*Runtime)
	sb, err := r.get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	upper := sb.st.upper()
	if _, err := os.Lstat(filepath.Join(upper, mountPointDirInSandbox)); !os.IsNotExist(err) {
		t.Fatalf("%s in the upper layer %s: %v, want none", mountPointDirInSandbox, upper, err)
	}
	res := sh(t, rt, spec.ID, "stat -c '%a %u %g' /.opendsec && ls /.opendsec && grep -c ' /.opendsec/' /proc/self/mountinfo && test -s /.opendsec/agent && test -s /.opendsec/init && echo mounted")
	want := "755 0 0\nagent\ninit\ninterpreter.py\nseccomp.bpf\n4\nmounted\n"
	if res.ExitCode != 0 || res.Stdout != want {
		t.Fatalf("/.opendsec in the sandbox: %+v, want stdout %q", res, want)
	}
	if res := sh(t, rt, spec.ID, "echo x > /.opendsec/new && chmod 700 /.opendsec && cat /.opendsec/new"); res.ExitCode != 0 || res.Stdout != "x\n" {
		t.Fatalf("write in /.opendsec as the sandbox's root: %+v", res)
	}
	mp, err := r.mountPoints(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if sb.st.MountPoints != mp {
		t.Fatalf("handle's mount point layer %q, want %q (a root mounted again gets the same stack)", sb.st.MountPoints, mp)
	}
	if !mountPointLayerIntact(mp, mountPointFiles) {
		t.Fatalf("the shared layer %s changed after the sandbox wrote in /.opendsec", mp)
	}
	// From Linux 6.15 the overlay takes the layer's detached clone, which
	// has no mounts on it to walk (overlayLower).
	if kernelAtLeast(t, 6, 15) && (r.mpLayer.detached == "" || r.mpLayer.refused.Load()) {
		t.Fatalf("root overlay took the mount point layer from its directory (detached %q, refused %v), want its detached clone", r.mpLayer.detached, r.mpLayer.refused.Load())
	}
	if b, err := os.ReadFile(filepath.Join(upper, mountPointDirInSandbox, "new")); err != nil || string(b) != "x\n" {
		t.Fatalf("the sandbox's new file in its upper layer: %q %v", b, err)
	}
	// A second sandbox sees the layer as made, not the first one's change.
	spec2, _ := runtimetest.StartSandbox(t, rt, tmpl)
	if res := sh(t, rt, spec2.ID, "stat -c '%a' /.opendsec; ls /.opendsec"); res.Stdout != "755\nagent\ninit\ninterpreter.py\nseccomp.bpf\n" {
		t.Fatalf("/.opendsec in a second sandbox: %+v", res)
	}
}

// kernelAtLeast reports whether the running kernel is major.minor or later.
func kernelAtLeast(t *testing.T, major, minor int) bool {
	t.Helper()
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	var ma, mi int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &ma, &mi); err != nil {
		t.Fatalf("kernel release %q: %v", u.Release[:], err)
	}
	return ma > major || ma == major && mi >= minor
}

// An overlay that refuses the detached clone (a kernel before 6.15 takes
// no detached mount as a layer: EINVAL) is mounted again from the layer's
// directory, and later mounts go to the directory at once; other errors
// are the caller's.
func TestRootOverlayFallsBackToLayerDir(t *testing.T) {
	testutil.RequiresRoot(t) // open_tree's clone needs CAP_SYS_ADMIN
	r := &Runtime{}
	r.mpLayer.dir = t.TempDir()
	if err := r.mpLayer.detach(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(r.mpLayer.fd) })
	clone := r.mpLayer.detached
	var got []string
	mount := func(opts string) error {
		got = append(got, opts)
		if strings.Contains(opts, clone) {
			return fmt.Errorf("mount overlay root: %w", unix.EINVAL)
		}
		return nil
	}
	if err := r.mountRootOverlay(r.mpLayer.dir, []string{"/l1", "/l2"}, "/u", "/w", mount); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"lowerdir=" + clone + ":/l1:/l2,upperdir=/u,workdir=/w",
		"lowerdir=" + r.mpLayer.dir + ":/l1:/l2,upperdir=/u,workdir=/w",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("mounts %q, want %q", got, want)
	}
	got = nil
	if err := r.mountRootOverlay(r.mpLayer.dir, []string{"/l1"}, "/u", "/w", mount); err != nil || len(got) != 1 || strings.Contains(got[0], "/proc/self/fd") {
		t.Fatalf("after a refusal: mounts %q (%v), want one from the directory", got, err)
	}

	// Another error is returned as it is, with no second mount.
	r2 := &Runtime{}
	r2.mpLayer.dir = t.TempDir()
	if err := r2.mpLayer.detach(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(r2.mpLayer.fd) })
	got = nil
	busy := func(opts string) error { got = append(got, opts); return unix.EBUSY }
	if err := r2.mountRootOverlay(r2.mpLayer.dir, []string{"/l1"}, "/u", "/w", busy); !errors.Is(err, unix.EBUSY) || len(got) != 1 || r2.mpLayer.refused.Load() {
		t.Fatalf("EBUSY: err %v, mounts %q, refused %v; want EBUSY from one mount", err, got, r2.mpLayer.refused.Load())
	}
	// A root without the shared layer, or with an older one, is mounted
	// from what its handle says.
	got = nil
	if err := r2.mountRootOverlay("/shared/mountpoints-old", []string{"/l1"}, "/u", "/w", mount); err != nil || len(got) != 1 || !strings.HasPrefix(got[0], "lowerdir=/shared/mountpoints-old:") {
		t.Fatalf("older layer: mounts %q (%v)", got, err)
	}
	// A clone's fd that now names another file is never taken.
	r3 := &Runtime{}
	r3.mpLayer.dir = t.TempDir()
	if err := r3.mpLayer.detach(); err != nil {
		t.Fatal(err)
	}
	other, err := unix.Open(t.TempDir(), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Dup3(other, r3.mpLayer.fd, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	unix.Close(other)
	t.Cleanup(func() { unix.Close(r3.mpLayer.fd) })
	if got := r3.overlayLower(r3.mpLayer.dir); got != r3.mpLayer.dir || !r3.mpLayer.refused.Load() {
		t.Fatalf("clone's fd replaced by another directory: overlay lower %q (refused %v), want the layer's directory %q", got, r3.mpLayer.refused.Load(), r3.mpLayer.dir)
	}
}
