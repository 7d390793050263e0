package container

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// xfsMount makes a sparse XFS image of size MiB in a temp dir and mounts
// it (loop, with opts) for the test; it returns the mount point.
func xfsMount(t *testing.T, sizeMB int64, opts string) (string, error) {
	t.Helper()
	return xfsMountWith(t, sizeMB, opts)
}

// xfsMountWith is xfsMount with extra mkfs.xfs arguments.
func xfsMountWith(t *testing.T, sizeMB int64, opts string, mkfsArgs ...string) (string, error) {
	t.Helper()
	testutil.RequiresRoot(t)
	mkfs, err := exec.LookPath("mkfs.xfs")
	if err != nil {
		t.Fatalf("mkfs.xfs not found (apt-get install xfsprogs; scripts/install-deps.sh installs it): %v", err)
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "xfs.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(sizeMB << 20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(mkfs, append(append([]string{"-q"}, mkfsArgs...), img)...).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.xfs: %v: %s", err, out)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := loopMount(f, mnt, "xfs", 0, opts, false); err != nil {
		return "", err
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			t.Errorf("unmount test xfs: %v", err)
		}
	})
	return mnt, nil
}

// startIn creates and starts a sandbox from tmpl with its state dir in
// parent; it is deleted when the test ends.
func startIn(t testing.TB, rt runtime.Runtime, tmpl runtime.Spec, parent string) (runtime.Spec, runtime.Handle) {
	t.Helper()
	spec := tmpl
	spec.ID = runtimetest.NewID("dq")
	spec.StateDir = filepath.Join(parent, spec.ID)
	t.Cleanup(func() {
		if err := rt.Delete(context.Background(), spec.ID); err != nil {
			t.Errorf("cleanup: delete %s: %v", spec.ID, err)
		}
	})
	h, err := rt.Create(t.Context(), spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if err := rt.Start(t.Context(), spec.ID); err != nil {
		t.Fatalf("start: %v", err)
	}
	if err := runtimetest.WaitAgent(t.Context(), rt, spec.ID, 20e9); err != nil {
		t.Fatal(err)
	}
	return spec, h
}

// hostUse returns the bytes allocated to and the inodes of the files under
// dir on dir's own filesystem (mounts below it are not entered).
func hostUse(t *testing.T, dir string) (bytes, inodes int64) {
	t.Helper()
	var root unix.Stat_t
	if err := unix.Stat(dir, &root); err != nil {
		t.Fatal(err)
	}
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return nil
		}
		st := fi.Sys().(*syscall.Stat_t)
		if st.Dev != root.Dev {
			return filepath.SkipDir // a mount: the layer image, tmpfs, the overlay
		}
		bytes += st.Blocks * 512
		inodes++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return bytes, inodes
}

// loopsBacking lists loop devices whose backing file is under dir.
func loopsBacking(dir string) []string {
	var out []string
	ms, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, m := range ms {
		if b, err := os.ReadFile(m); err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), dir) {
			out = append(out, m)
		}
	}
	return out
}

// checkDiskQuota fills the disk and the inodes of a sandbox with disk_mb
// 64 whose state dir is in parent, and checks that the sandbox stops at
// its quota, the filesystem of parent loses at most that, and another
// sandbox still starts and writes.
func checkDiskQuota(t *testing.T, rt runtime.Runtime, tmpl runtime.Spec, parent, wantKind string) {
	const mb = 64
	tmpl.Resources.DiskMB = mb
	spec, _ := startIn(t, rt, tmpl, parent)
	defer func() {
		sb, err := rt.(*Runtime).get(spec.ID)
		if err != nil {
			t.Fatal(err)
		}
		if sb.st.Disk == nil || sb.st.Disk.Kind != wantKind {
			t.Errorf("writable layer quota is %+v, want kind %s", sb.st.Disk, wantKind)
		}
	}()

	// Bytes: dd past the quota fails with ENOSPC or EDQUOT.
	res := sh(t, rt, spec.ID, "dd if=/dev/zero of=/big bs=1M count=100 2>&1; echo rc=$?; sync; ls -l /big")
	t.Logf("dd: %s", res.Stdout)
	if strings.Contains(res.Stdout, "rc=0") || !strings.Contains(res.Stdout, "No space left") && !strings.Contains(res.Stdout, "quota exceeded") {
		t.Fatalf("dd of 100 MiB into a %d MiB layer did not fail with ENOSPC/EDQUOT:\n%s", mb, res.Stdout)
	}
	// What the sandbox holds of the host filesystem: its state dir (the
	// machine is shared, so free space is not a measure).
	if used, _ := hostUse(t, spec.StateDir); used > (mb+4)<<20 {
		t.Errorf("the sandbox's state dir holds %d MiB of the host filesystem with a %d MiB quota", used>>20, mb)
	}
	st, err := rt.(runtime.StatsReader).Stats(t.Context(), spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("stats after dd: used %d KiB of %d KiB, inodes %d of %d", st.DiskUsedBytes>>10, st.DiskTotalBytes>>10, st.DiskInodes, st.DiskInodesLimit)
	if st.DiskTotalBytes > mb<<20 || st.DiskTotalBytes < (mb-4)<<20 || st.DiskUsedBytes < (mb-8)<<20 {
		t.Errorf("stats: disk used %d of %d bytes, want about %d of %d MiB", st.DiskUsedBytes, st.DiskTotalBytes, mb, mb)
	}

	// A removed file gives its space back to the host, not only to the
	// layer (the image is mounted with discard).
	sh(t, rt, spec.ID, "rm -f /big; sync")
	if used, _ := hostUse(t, spec.StateDir); used > 16<<20 {
		t.Errorf("after removing the fill the sandbox's state dir still holds %d MiB of the host filesystem", used>>20)
	}

	// Inodes: empty files stop at the inode quota (the shell's own
	// redirection: no process per file).
	res = sh(t, rt, spec.ID, "mkdir /f; i=0; while true 2>/dev/null >/f/$i; do i=$((i+1)); [ $i -ge 20000 ] && break; done; echo $i; (true >/f/x) 2>&1")
	t.Logf("files: %s", res.Stdout)
	n, err := strconv.Atoi(strings.Fields(res.Stdout + " x")[0])
	if err != nil {
		t.Fatalf("file count: %q", res.Stdout)
	}
	if _, limit := diskLimits(mb); n >= int(limit) || n < int(limit)/2 {
		t.Fatalf("made %d empty files in a layer with an inode quota of %d", n, limit)
	}
	if !strings.Contains(res.Stdout, "No space left") && !strings.Contains(res.Stdout, "quota exceeded") {
		t.Errorf("the file past the inode quota did not fail with ENOSPC/EDQUOT: %q", res.Stdout)
	}
	if _, inodes := hostUse(t, spec.StateDir); inodes > int64(n)+64 {
		t.Errorf("the sandbox's state dir holds %d inodes of the host filesystem for %d files", inodes, n)
	}

	// Another sandbox still creates and writes.
	tmpl.Resources.DiskMB = 16
	other, _ := startIn(t, rt, tmpl, parent)
	if r := sh(t, rt, other.ID, "echo hello > /x && cat /x"); r.Stdout != "hello\n" {
		t.Fatalf("second sandbox: %+v", r)
	}
}

// TestSecurityDiskQuotaImage: on a filesystem without project quotas (the
// test's temp dir on ext4) each sandbox's writable layer is a sparse ext4
// image; deleting the sandbox, also from a restarted node, leaves no mount
// or loop device.
func TestSecurityDiskQuotaImage(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	parent := t.TempDir()
	if (&projectQuota{}).supported(parent) == nil {
		t.Fatalf("%s enforces project quotas: this test needs a filesystem without them", parent)
	}
	checkDiskQuota(t, rt, tmpl, parent, DiskQuotaImage)

	// A node restart: a new backend recovers the sandbox and deletes it.
	tmpl.Resources.DiskMB = 32
	spec, h := startIn(t, rt, tmpl, parent)
	rt2, _ := f(t)
	if err := rt2.Recover(t.Context(), h); err != nil {
		t.Fatal(err)
	}
	st, err := rt2.(runtime.StatsReader).Stats(t.Context(), spec.ID)
	if err != nil || st.DiskTotalBytes > 32<<20 || st.DiskTotalBytes < 28<<20 {
		t.Fatalf("stats after recover: %+v %v", st, err)
	}
	if err := rt2.Delete(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if l := loopsBacking(spec.StateDir); len(l) > 0 {
		t.Errorf("loop devices left after delete: %v", l)
	}
	if _, err := os.Stat(spec.StateDir); !os.IsNotExist(err) {
		t.Errorf("state dir left after delete: %v", err)
	}
}

// TestSecurityDiskQuotaXFSWithoutProjectQuota: on XFS mounted without
// prjquota the probe picks the image, and a node configured for project
// quotas refuses the create, naming the setting.
func TestSecurityDiskQuotaXFSWithoutProjectQuota(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	parent, err := xfsMount(t, 512, "")
	if err != nil {
		t.Fatal(err)
	}
	checkDiskQuota(t, rt, tmpl, parent, DiskQuotaImage)

	rtp, _ := newFactoryWith(t, func(c *Config) { c.DiskQuota = DiskQuotaProject })(t)
	tmpl.Resources.DiskMB = 16
	spec := tmpl
	spec.ID = runtimetest.NewID("dq")
	spec.StateDir = filepath.Join(parent, spec.ID)
	_, err = rtp.Create(t.Context(), spec)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "container.disk_quota") {
		t.Fatalf("create with disk_quota project on XFS without prjquota: %v, want failed_precondition naming container.disk_quota", err)
	}
	if _, serr := os.Stat(spec.StateDir); !os.IsNotExist(serr) {
		t.Errorf("refused create left its state dir: %v", serr)
	}
}

// TestSecurityDiskQuotaProject: on XFS mounted with prjquota the writable
// layer gets a project quota; deleting the sandbox drops it. It needs a
// kernel with CONFIG_XFS_QUOTA.
func TestSecurityDiskQuotaProject(t *testing.T) {
	f := newFactoryWith(t, func(c *Config) { c.DiskQuota = DiskQuotaProject })
	rt, tmpl := f(t)
	parent, err := xfsMount(t, 512, "prjquota")
	if errors.Is(err, unix.EINVAL) && !kernelHas("CONFIG_XFS_QUOTA") {
		t.Skipf("this kernel has no XFS quota support (CONFIG_XFS_QUOTA is not set): mounting XFS with prjquota fails (%v); the image mechanism is what runs here", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	checkDiskQuota(t, rt, tmpl, parent, DiskQuotaProject)

	spec, _ := startIn(t, rt, tmpl, parent)
	pid := rt.(*Runtime).sandboxes[spec.ID].st.Disk.ProjectID
	if err := rt.Delete(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(rt.(*Runtime).projects.claims, strconv.Itoa(int(pid)))); !os.IsNotExist(err) {
		t.Errorf("project ID %d still claimed after delete: %v", pid, err)
	}
}

// kernelHas reports whether the running kernel's config sets opt (=y);
// false when the config is not readable.
func kernelHas(opt string) bool {
	out, err := exec.Command("sh", "-c", "zcat /proc/config.gz 2>/dev/null || cat /boot/config-$(uname -r)").Output()
	return err == nil && strings.Contains(string(out), "\n"+opt+"=y")
}

// TestDiskQuotaCrashedCreate: a create that died after its layer was
// mounted (no handle; only the intent) is cleaned by Delete.
func TestDiskQuotaCrashedCreate(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	tmpl.Resources.DiskMB = 16
	spec := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	// Forget it, as a node killed before it stored the handle would.
	c := rt.(*Runtime)
	c.mu.Lock()
	delete(c.sandboxes, spec.ID)
	c.mu.Unlock()
	if err := rt.Delete(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if l := loopsBacking(spec.StateDir); len(l) > 0 {
		t.Errorf("loop devices left: %v", l)
	}
	if _, err := os.Stat(filepath.Join(spec.StateDir, layerImage)); !os.IsNotExist(err) {
		t.Errorf("layer image left: %v", err)
	}
}

// TestLayerTemplateHasUpperAndWork: the writable layer's upper and work
// come from the formatted template (no directory made per create), with
// the modes and owner a create used to give them, on the image's ext4.
func TestLayerTemplateHasUpperAndWork(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(t.Context(), spec); err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { rt.Delete(context.Background(), spec.ID) })
	for name, mode := range map[string]os.FileMode{upperDir: 0o755, workDir: 0o700} {
		p := filepath.Join(layerMount(spec.StateDir), name)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR || os.FileMode(st.Mode&0o7777) != mode || st.Uid != 0 || st.Gid != 0 {
			t.Errorf("%s: mode %o uid %d gid %d, want a directory %o of root's", name, st.Mode, st.Uid, st.Gid, mode)
		}
		var fs unix.Statfs_t
		if err := unix.Statfs(p, &fs); err != nil || fs.Type != unix.EXT4_SUPER_MAGIC {
			t.Errorf("%s is not on the layer image's ext4 (%x, %v)", name, fs.Type, err)
		}
	}
	// The layer's block allocator prefetches no bitmaps (mountLayer).
	var st unix.Stat_t
	if err := unix.Stat(layerMount(spec.StateDir), &st); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("/sys/fs/ext4/loop" + strconv.Itoa(int(unix.Minor(st.Dev))) + "/mb_prefetch_limit")
	if err != nil || strings.TrimSpace(string(b)) != "0" {
		t.Errorf("the layer's mb_prefetch_limit is %q (%v), want 0", b, err)
	}
}

// TestLayerTemplateFewExtents: a layer template's blocks lie in a few
// runs whatever its size (no backup superblocks, one flex group for all
// block groups' metadata): each run of a sandbox's copy is a block
// allocation on the host's file system. The template is a valid ext4.
func TestLayerTemplateFewExtents(t *testing.T) {
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		t.Fatalf("mkfs.ext4 not found (apt-get install e2fsprogs): %v", err)
	}
	for _, mb := range []int64{1024, 5120, 102400} {
		q := &imageQuota{mkfs: mkfs, dir: t.TempDir()}
		d := &diskState{Kind: DiskQuotaImage}
		d.Bytes, d.Inodes = diskLimits(mb)
		p, err := q.template(t.Context(), d)
		if err != nil {
			t.Fatalf("%d MiB: %v", mb, err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		runs := 0
		for off := int64(0); ; runs++ {
			data, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
			if errors.Is(err, unix.ENXIO) {
				break
			} else if err != nil {
				t.Fatal(err)
			}
			if off, err = unix.Seek(int(f.Fd()), data, unix.SEEK_HOLE); err != nil {
				t.Fatal(err)
			}
		}
		f.Close()
		// 13 runs for 5 GiB and 67 for 100 GiB with mkfs's defaults.
		if runs == 0 || runs > 6 {
			t.Errorf("%d MiB: the template's data is in %d runs, want 1 to 6", mb, runs)
		}
		if out, err := exec.Command("e2fsck", "-fn", p).CombinedOutput(); err != nil {
			t.Errorf("%d MiB: e2fsck: %v: %s", mb, err, out)
		}
	}
}

// TestLoopMountGuess: loopMount tries the loop device after the last one
// it attached before asking the kernel for a free one; a guess that is
// bound or does not exist falls back to the kernel's choice, and no two
// layers share a device.
func TestLoopMountGuess(t *testing.T) {
	testutil.RequiresRoot(t)
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		t.Fatalf("mkfs.ext4 not found (apt-get install e2fsprogs): %v", err)
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "t.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(mkfs, "-q", "-F", "-b", "4096", "-O", "^has_journal", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v: %s", err, out)
	}
	devs := map[uint64]string{}
	mount := func(name string) uint64 {
		t.Helper()
		p := filepath.Join(dir, name)
		b, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p+".img", b, 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(p+".img", os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
		if _, err := loopMount(f, p, "ext4", 0, "", true); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Cleanup(func() { unix.Unmount(p, 0) })
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		if unix.Major(st.Dev) != 7 {
			t.Fatalf("%s: mounted from device %d:%d, not a loop device", name, unix.Major(st.Dev), unix.Minor(st.Dev))
		}
		if prev, ok := devs[st.Dev]; ok {
			t.Fatalf("%s and %s are both on loop device minor %d", prev, name, unix.Minor(st.Dev))
		}
		devs[st.Dev] = name
		return st.Dev
	}
	first := mount("first")
	// The guess is the device just attached: bound.
	loopNext.Store(int64(unix.Minor(first)))
	mount("bound-guess")
	// The guess is no device at all.
	loopNext.Store(1 << 20)
	mount("missing-guess")
	mount("after")
}
