package container

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// sourceScript leaves in a sandbox's writable layer what a fork must copy
// exactly: a file with a hard link and a symlink, a sparse file, a setuid
// file, a file of another owner, a fifo, an image file deleted (a
// whiteout) and an image directory replaced (an opaque directory).
const sourceScript = `set -e
mkdir -p /data
echo root > /data/a
ln /data/a /data/hard
ln -s a /data/sym
dd if=/dev/zero of=/data/sparse bs=1 count=1 seek=20971520 2>/dev/null
echo s > /data/suid; chmod 4755 /data/suid
echo o > /data/owned; chown 1234:5678 /data/owned
mkfifo /data/fifo
rm /usr/bin/yes
rm -rf /usr/sbin; mkdir /usr/sbin; echo only > /usr/sbin/only
`

// describeScript prints what sourceScript made, the same in the source and
// in every fork.
const describeScript = `cd /data && for f in *; do stat -c '%n %F %a %u:%g %h %s' "$f"; done
cat a; readlink sym
test -e /usr/bin/yes && echo yes-is-back
ls /usr/sbin
b=$(stat -c %b sparse); test "$b" -lt 1024 || echo "sparse file has $b blocks"
`

func runOK(t *testing.T, rt runtime.Runtime, id, script string) string {
	t.Helper()
	res, err := runtimetest.Run(t.Context(), rt, id, "root", "/bin/sh", "-c", script)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("run in %s: %v, exit %d, stdout %q, stderr %q", id, err, res.ExitCode, res.Stdout, res.Stderr)
	}
	return res.Stdout
}

// forkSpecs returns n specs from tmpl with fresh IDs, state dirs under
// parent (a temp dir if empty) and hostnames; each is deleted at the end.
func forkSpecs(t *testing.T, rt runtime.Runtime, tmpl runtime.Spec, n int, parent string) []runtime.Spec {
	t.Helper()
	out := make([]runtime.Spec, n)
	for i := range out {
		s := runtimetest.Prepare(t, rt, tmpl)
		if parent != "" {
			s.StateDir = filepath.Join(parent, s.ID)
		}
		s.Guest.Hostname = fmt.Sprintf("fork-%d", i)
		out[i] = s
	}
	return out
}

// checkForks starts every fork and checks it has the source's files
// (describe is the source's describeScript output) and its own hostname,
// and that a write in one is seen by no other and not by the source.
func checkForks(t *testing.T, rt runtime.Runtime, src string, specs []runtime.Spec, res []runtime.ForkResult, describe string) {
	t.Helper()
	ctx := t.Context()
	if len(res) != len(specs) {
		t.Fatalf("fork made %d sandboxes, want %d", len(res), len(specs))
	}
	for i, s := range specs {
		if res[i].Handle.ID != s.ID || res[i].MemoryPreserved {
			t.Fatalf("fork %d: handle %q, memory preserved %v; want %q, false", i, res[i].Handle.ID, res[i].MemoryPreserved, s.ID)
		}
		if st, err := rt.Status(ctx, s.ID); err != nil || st.State != runtime.StateCreated {
			t.Fatalf("fork %d status %+v, %v; want created (prepared, not started)", i, st, err)
		}
	}
	var wg sync.WaitGroup
	for i, s := range specs {
		wg.Go(func() {
			if err := rt.Start(ctx, s.ID); err != nil {
				t.Errorf("start fork %d: %v", i, err)
				return
			}
			if err := runtimetest.WaitAgent(ctx, rt, s.ID, agentWait); err != nil {
				t.Errorf("fork %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	for i, s := range specs {
		if got := runOK(t, rt, s.ID, describeScript); got != describe {
			t.Errorf("fork %d sees\n%s\nwant the source's\n%s", i, got, describe)
		}
		if got := runOK(t, rt, s.ID, "hostname"); got != s.Guest.Hostname+"\n" {
			t.Errorf("fork %d hostname %q, want %q", i, got, s.Guest.Hostname)
		}
		if err := runtimetest.WriteFile(ctx, rt, s.ID, "/data/mine", []byte(s.ID)); err != nil {
			t.Fatal(err)
		}
	}
	for i, s := range specs {
		if b, err := runtimetest.ReadFile(ctx, rt, s.ID, "/data/mine"); err != nil || string(b) != s.ID {
			t.Errorf("fork %d reads %q, %v; want its own write %q", i, b, err, s.ID)
		}
	}
	if st, err := rt.Status(ctx, src); err == nil && st.State == runtime.StateRunning {
		if _, err := runtimetest.ReadFile(ctx, rt, src, "/data/mine"); err == nil {
			t.Errorf("the source sees a file its forks wrote")
		}
	}
}

const agentWait = 20e9

func TestFork(t *testing.T) {
	for _, kind := range []struct {
		name   string
		diskMB int64
	}{{"image", 64}, {"dir", 0}} {
		t.Run(kind.name, func(t *testing.T) {
			f := newFactory(t)
			rt, tmpl := f(t)
			tmpl.Resources.DiskMB = kind.diskMB
			src, _ := runtimetest.StartSandbox(t, rt, tmpl)
			runOK(t, rt, src.ID, sourceScript)
			describe := runOK(t, rt, src.ID, describeScript)
			if !strings.Contains(describe, "only\n") || strings.Contains(describe, "yes-is-back") {
				t.Fatalf("test setup: the source's own layer reads %q", describe)
			}
			for _, n := range []int{1, 8} {
				t.Run(fmt.Sprint(n), func(t *testing.T) {
					specs := forkSpecs(t, rt, tmpl, n, "")
					res, err := rt.(runtime.Forker).Fork(t.Context(), src.ID, specs)
					if err != nil {
						t.Fatalf("fork: %v", err)
					}
					if res[0].SourceFrozen <= 0 {
						t.Errorf("source frozen %s for a running source; want > 0", res[0].SourceFrozen)
					}
					t.Logf("%d forks, source frozen %s", n, res[0].SourceFrozen)
					// The source was thawed and runs on.
					if st, err := rt.Status(t.Context(), src.ID); err != nil || st.State != runtime.StateRunning {
						t.Fatalf("source after fork: %+v, %v; want running", st, err)
					}
					runOK(t, rt, src.ID, "echo alive")
					checkForks(t, rt, src.ID, specs, res, describe)
					// Each fork's overlay has its own UUID (overlayfs uuid=on).
					srcUUID := overlayUUID(t, rt, src.ID)
					for i, s := range specs {
						if u := overlayUUID(t, rt, s.ID); u != "" && u == srcUUID {
							t.Errorf("fork %d's overlay has the source's uuid %x", i, u)
						}
					}
					if m, _ := filepath.Glob(filepath.Join(src.StateDir, forkSeedPrefix+"*")); len(m) > 0 {
						t.Errorf("fork seeds left in the source's bundle: %v", m)
					}
				})
			}
		})
	}
}

// overlayUUID reads the persistent overlay UUID on sandbox id's upper
// root ("" if it has none).
func overlayUUID(t *testing.T, rt runtime.Runtime, id string) string {
	t.Helper()
	sb, err := rt.(*Runtime).get(id)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 64)
	n, err := unix.Getxattr(sb.st.upper(), overlayUUIDXattr, b)
	if err != nil {
		return ""
	}
	return string(b[:n])
}

// TestForkPausedSourceStaysPaused: a paused source is not thawed by a
// fork (and the fork reports no frozen time of its own).
func TestForkPausedSourceStaysPaused(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	src, _ := runtimetest.StartSandbox(t, rt, tmpl)
	runOK(t, rt, src.ID, sourceScript)
	describe := runOK(t, rt, src.ID, describeScript)
	if err := rt.(runtime.Pauser).Pause(t.Context(), src.ID); err != nil {
		t.Fatal(err)
	}
	specs := forkSpecs(t, rt, tmpl, 2, "")
	res, err := rt.(runtime.Forker).Fork(t.Context(), src.ID, specs)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	if st, err := rt.Status(t.Context(), src.ID); err != nil || st.State != runtime.StatePaused {
		t.Fatalf("paused source after fork: %+v, %v; want paused", st, err)
	}
	if res[0].SourceFrozen != 0 {
		t.Errorf("source frozen %s by the fork of a paused source; want 0", res[0].SourceFrozen)
	}
	checkForks(t, rt, src.ID, specs, res, describe)
	if err := rt.(runtime.Pauser).Resume(t.Context(), src.ID); err != nil {
		t.Fatal(err)
	}
	if got := runOK(t, rt, src.ID, describeScript); got != describe {
		t.Errorf("source after resume reads %q", got)
	}
	if _, err := runtimetest.ReadFile(t.Context(), rt, src.ID, "/data/mine"); err == nil {
		t.Errorf("the source sees a file its forks wrote")
	}
}

// TestForkFailureLeavesNothing: a fork whose 3rd of 4 sandboxes cannot be
// made (its config.json cannot be written, after its layer was copied and
// mounted) makes none, and one with a bad 3rd spec makes nothing at all;
// either way the source is thawed and runs on.
func TestForkFailureLeavesNothing(t *testing.T) {
	for _, kind := range []struct {
		name   string
		diskMB int64
	}{{"image", 64}, {"dir", 0}} {
		t.Run(kind.name, func(t *testing.T) {
			f := newFactory(t)
			rt, tmpl := f(t)
			c := rt.(*Runtime)
			tmpl.Resources.DiskMB = kind.diskMB
			src, _ := runtimetest.StartSandbox(t, rt, tmpl)
			runOK(t, rt, src.ID, sourceScript)
			check := func(t *testing.T, specs []runtime.Spec) {
				t.Helper()
				for i, s := range specs {
					if _, err := rt.Status(t.Context(), s.ID); !errdefs.IsNotFound(err) {
						t.Errorf("fork %d still known after the failed fork: %v", i, err)
					}
					runtimetest.AssertNoLeftovers(t, s.StateDir, 0)
					if l := loopsBacking(s.StateDir); len(l) > 0 {
						t.Errorf("loop devices left for fork %d: %v", i, l)
					}
					if d := c.CgroupDirs(s.ID); len(d) > 0 {
						t.Errorf("cgroups left for fork %d: %v", i, d)
					}
					if _, err := os.Stat(c.intentPath(s.ID)); err == nil {
						t.Errorf("intent left for fork %d", i)
					}
				}
				if m, _ := filepath.Glob(filepath.Join(src.StateDir, forkSeedPrefix+"*")); len(m) > 0 {
					t.Errorf("fork seeds left in the source's bundle: %v", m)
				}
				if st, err := rt.Status(t.Context(), src.ID); err != nil || st.State != runtime.StateRunning {
					t.Fatalf("source after the failed fork: %+v, %v; want running", st, err)
				}
				runOK(t, rt, src.ID, "echo alive")
			}
			t.Run("create fails", func(t *testing.T) {
				specs := forkSpecs(t, rt, tmpl, 4, "")
				bad := specs[2].ID
				testHookConfigWrite = func(id string) error {
					if id == bad {
						return errors.New("test: config.json not writable")
					}
					return nil
				}
				t.Cleanup(func() { testHookConfigWrite = nil })
				if _, err := rt.(runtime.Forker).Fork(t.Context(), src.ID, specs); err == nil {
					t.Fatal("fork succeeded with a fork that cannot be made")
				} else {
					t.Logf("fork: %v", err)
				}
				check(t, specs)
			})
			t.Run("bad spec", func(t *testing.T) {
				specs := forkSpecs(t, rt, tmpl, 4, "")
				specs[2].Resources.MemoryMB = 0
				if _, err := rt.(runtime.Forker).Fork(t.Context(), src.ID, specs); !errdefs.IsInvalidArgument(err) {
					t.Fatalf("fork with a bad spec: %v; want invalid argument", err)
				}
				check(t, specs)
			})
			t.Run("disk size", func(t *testing.T) {
				specs := forkSpecs(t, rt, tmpl, 2, "")
				specs[1].Resources.DiskMB = 128
				if _, err := rt.(runtime.Forker).Fork(t.Context(), src.ID, specs); !errdefs.IsInvalidArgument(err) {
					t.Fatalf("fork with another disk_mb: %v; want invalid argument", err)
				}
				check(t, specs)
			})
		})
	}
}

// TestForkStoppedAndUnknown: a stopped or unknown source is refused.
func TestForkStoppedAndUnknown(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	src, _ := runtimetest.StartSandbox(t, rt, tmpl)
	if err := rt.Stop(t.Context(), src.ID, runtimetest.StopOptions()); err != nil {
		t.Fatal(err)
	}
	specs := forkSpecs(t, rt, tmpl, 1, "")
	if _, err := rt.(runtime.Forker).Fork(t.Context(), src.ID, specs); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("fork of a stopped sandbox: %v; want failed precondition", err)
	}
	if _, err := rt.(runtime.Forker).Fork(t.Context(), "nosuchsandbox", specs); !errdefs.IsNotFound(err) {
		t.Fatalf("fork of an unknown sandbox: %v; want not found", err)
	}
	runtimetest.AssertNoLeftovers(t, specs[0].StateDir, 0)
}

// TestForkAfterRecover: a fresh runtime (a node restart) forks a
// sandbox it recovered.
func TestForkAfterRecover(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	src, h := runtimetest.StartSandbox(t, rt, tmpl)
	runOK(t, rt, src.ID, sourceScript)
	describe := runOK(t, rt, src.ID, describeScript)
	rt2, _ := f(t)
	if err := rt2.Recover(t.Context(), h); err != nil {
		t.Fatal(err)
	}
	specs := forkSpecs(t, rt2, tmpl, 2, "")
	res, err := rt2.(runtime.Forker).Fork(t.Context(), src.ID, specs)
	if err != nil {
		t.Fatalf("fork after recover: %v", err)
	}
	checkForks(t, rt2, src.ID, specs, res, describe)
}

// TestForkImageIsClean: the layer image a fork copies from a source that
// writes all the time is a clean ext4 (e2fsck finds nothing to fix), since
// the source is frozen and its file system synced before the copy.
func TestForkImageIsClean(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	src, _ := runtimetest.StartSandbox(t, rt, tmpl)
	runOK(t, rt, src.ID, "(i=0; while :; do i=$((i+1)); echo $i > /w.$((i%50)); dd if=/dev/zero of=/big bs=64k count=$((i%16)) 2>/dev/null; done) >/dev/null 2>&1 </dev/null &")
	// The writer runs (its 50 files are there) before every copy.
	for deadline := time.Now().Add(10 * time.Second); ; {
		if _, err := runtimetest.ReadFile(t.Context(), rt, src.ID, "/w.49"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the writer did not write /w.49 in 10 s")
		}
		time.Sleep(10 * time.Millisecond) // polling
	}
	defer func() { forkFIFreeze = false }()
	for i := range 4 {
		forkFIFreeze = i == 3 // the last copy with FIFREEZE instead of syncfs
		seed, frozen, err := c.takeSeed(t.Context(), src.ID, []runtime.Spec{{ID: "x", Resources: tmpl.Resources}})
		if err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command("e2fsck", "-fn", seed.path).CombinedOutput()
		os.Remove(seed.path)
		if err != nil {
			t.Fatalf("copy %d (source frozen %s): e2fsck -fn: %v\n%s", i, frozen, err, out)
		}
	}
}

// fiemapShared reports whether any extent of file p is shared with
// another file (FIEMAP_EXTENT_SHARED), and how many extents it has.
func fiemapShared(t *testing.T, p string) (shared bool, extents int) {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const n = 512
	type extent struct {
		Logical, Physical, Length uint64
		_                         [2]uint64
		Flags                     uint32
		_                         [3]uint32
	}
	var buf struct {
		Start, Length                         uint64
		Flags, Mapped, ExtentCount, _reserved uint32
		Extents                               [n]extent
	}
	buf.Length = ^uint64(0)
	buf.Flags = 1 // FIEMAP_FLAG_SYNC
	buf.ExtentCount = n
	const fsIocFiemap = 0xc020660b
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fsIocFiemap, uintptr(unsafe.Pointer(&buf))); e != 0 {
		t.Fatalf("FIEMAP %s: %v", p, e)
	}
	for _, x := range buf.Extents[:buf.Mapped] {
		if x.Flags&0x2000 != 0 { // FIEMAP_EXTENT_SHARED
			shared = true
		}
	}
	return shared, int(buf.Mapped)
}

// TestForkReflink: with the state dirs on XFS (reflink=1, a loop-mounted
// file) a fork's layer shares its extents with the source's (the image
// file, or each file of an upper directory); on ext4 it is a copy that
// shares nothing.
func TestForkReflink(t *testing.T) {
	xfs, err := xfsMountWith(t, 1024, "", "-m", "reflink=1")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, parent string
		diskMB       int64
		shared       bool
	}{{"xfs-image", xfs, 64, true}, {"xfs-dir", xfs, 0, true}, {"ext4-image", "", 64, false}, {"ext4-dir", "", 0, false}} {
		t.Run(c.name, func(t *testing.T) {
			parent := c.parent
			if parent == "" {
				parent = t.TempDir()
				var fs unix.Statfs_t
				if err := unix.Statfs(parent, &fs); err != nil || fs.Type != unix.EXT4_SUPER_MAGIC {
					t.Skipf("the temp dir is not on ext4 (type %#x): no fallback to show", fs.Type)
				}
			}
			f := newFactory(t)
			rt, tmpl := f(t)
			tmpl.Resources.DiskMB = c.diskMB
			src, _ := startIn(t, rt, tmpl, parent)
			runOK(t, rt, src.ID, sourceScript+"dd if=/dev/urandom of=/data/big bs=1M count=8 2>/dev/null\n")
			describe := runOK(t, rt, src.ID, describeScript)
			specs := forkSpecs(t, rt, tmpl, 2, parent)
			res, err := rt.(runtime.Forker).Fork(t.Context(), src.ID, specs)
			if err != nil {
				t.Fatalf("fork: %v", err)
			}
			t.Logf("source frozen %s", res[0].SourceFrozen)
			for i, s := range specs {
				p := filepath.Join(s.StateDir, layerImage)
				if c.diskMB == 0 {
					p = filepath.Join(s.StateDir, upperDir, "data", "big")
				}
				shared, n := fiemapShared(t, p)
				if shared != c.shared {
					t.Errorf("fork %d: %s has shared extents: %v (of %d extents); want %v", i, p, shared, n, c.shared)
				}
			}
			checkForks(t, rt, src.ID, specs, res, describe)
		})
	}
}
