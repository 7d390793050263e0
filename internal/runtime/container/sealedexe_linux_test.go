package container

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// TestCrunRunsFromSealedMemfd: the node runs crun from one sealed memfd.
// A prestarted container's init (crun, before it execs the sandbox's init)
// has as its executable that very memfd, the node's own (same inode: crun
// did not copy itself for the create), sealed with exactly the four seals
// crun requires; nothing can write, grow or shrink it, not through the
// node's fd and not through /proc/<pid>/exe; a second runtime in the
// process shares the copy.
func TestCrunRunsFromSealedMemfd(t *testing.T) {
	requireOCIRuntime(t, OCIRuntimeCrun)
	f := newFactoryWith(t, func(c *Config) { c.OCIRuntime = OCIRuntimeCrun })
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	if c.oci.exeErr != nil || !strings.HasPrefix(c.oci.exe, "/proc/self/fd/") {
		t.Fatalf("crun runs from %q (%v); want a sealed memfd at /proc/self/fd/<n>", c.oci.exe, c.oci.exeErr)
	}
	if n, _ := strconv.Atoi(strings.TrimPrefix(c.oci.exe, "/proc/self/fd/")); n < sealedExeMinFD {
		t.Fatalf("the sealed copy is fd %d: a child's stdio or ExtraFiles would replace it before the exec", n)
	}
	rt2, _ := f(t)
	if got := rt2.(*Runtime).oci.exe; got != c.oci.exe {
		t.Fatalf("a second runtime runs crun from %s, the first from %s: one copy per process", got, c.oci.exe)
	}
	var node unix.Stat_t
	if err := unix.Stat(c.oci.exe, &node); err != nil {
		t.Fatal(err)
	}

	spec := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rt.Delete(t.Context(), spec.ID) })
	if err := c.Prestart(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	s, err := c.runcState(t.Context(), c.cfg.StateRoot, spec.ID)
	if err != nil || s.Status != "created" || s.Pid <= 0 {
		t.Fatalf("crun state of the prestarted container: %+v, %v", s, err)
	}
	exe := filepath.Join("/proc", strconv.Itoa(s.Pid), "exe")
	link, err := os.Readlink(exe)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(link, "/memfd:crun") {
		t.Fatalf("the container's init (crun, pid %d) runs %q; want the node's memfd /memfd:crun", s.Pid, link)
	}
	fd, err := unix.Open(exe, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	if st.Dev != node.Dev || st.Ino != node.Ino {
		t.Fatalf("the container's init runs memfd inode %d, the node's copy is %d: crun copied itself for the create", st.Ino, node.Ino)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals != sealedExeSeals {
		t.Fatalf("seals of the container init's executable: %#x, %v; want exactly %#x", seals, err, sealedExeSeals)
	}
	for _, p := range []string{exe, c.oci.exe} {
		if w, err := os.OpenFile(p, os.O_WRONLY, 0); err == nil {
			_, werr := w.Write([]byte("x"))
			terr := w.Truncate(0)
			w.Close()
			if werr == nil || terr == nil {
				t.Fatalf("write %s: %v, truncate: %v; want both refused", p, werr, terr)
			}
		}
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_FUTURE_WRITE); !errors.Is(err, unix.EPERM) {
		t.Fatalf("add a seal: %v; want EPERM (F_SEAL_SEAL)", err)
	}
	if err := c.Launch(t.Context(), spec.ID, nil); err != nil {
		t.Fatal(err)
	}
	if err := rt.Stop(t.Context(), spec.ID, runtimetest.StopOptions()); err != nil {
		t.Fatal(err)
	}
}

// TestCrunSealedExeFallback: crun that is no ELF binary (a wrapper script
// here) cannot run from a memfd (its interpreter would open the fd's path
// after close-on-exec): the node runs it from its path and says why.
func TestCrunSealedExeFallback(t *testing.T) {
	requireOCIRuntime(t, OCIRuntimeCrun)
	testutil.RequiresRoot(t)
	real, err := exec.LookPath(OCIRuntimeCrun)
	if err != nil {
		t.Fatal(err)
	}
	wrapper := filepath.Join(t.TempDir(), "crun")
	if err := os.WriteFile(wrapper, []byte("#!/bin/sh\nexec "+real+" \"$@\"\n"), 0o755); err != nil { //nolint:gosec // an executable
		t.Fatal(err)
	}
	o, err := crunRuntime(&Config{CrunPath: wrapper}, "")
	if err != nil {
		t.Fatal(err)
	}
	if o.exe != wrapper || o.exeErr == nil || !strings.Contains(o.exeErr.Error(), "not an ELF binary") {
		t.Fatalf("crun wrapper runs from %q (%v); want its path and why", o.exe, o.exeErr)
	}
	o, err = crunRuntime(&Config{CrunPath: real}, "")
	if err != nil || o.exeErr != nil || !strings.HasPrefix(o.exe, "/proc/self/fd/") {
		t.Fatalf("crun at %s runs from %q (%v, %v); want a sealed memfd", real, o.exe, o.exeErr, err)
	}
}

// TestSealedCopyLostRunsFromPath: when the sealed copy's fd stops being
// the copy (closed by mistake somewhere in the process and its number
// reused: here a directory put in its place), the node never executes
// what the fd now is: the next create runs crun from its path and works,
// every later command does too, and a runtime made afterwards gets a new
// sealed copy.
func TestSealedCopyLostRunsFromPath(t *testing.T) {
	requireOCIRuntime(t, OCIRuntimeCrun)
	f := newFactoryWith(t, func(c *Config) { c.OCIRuntime = OCIRuntimeCrun })
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	if c.oci.sealed == nil {
		t.Fatalf("crun runs from %q (%v); want a sealed memfd", c.oci.exe, c.oci.exeErr)
	}
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	fd := int(c.oci.sealed.f.Fd())
	if err := unix.Dup3(int(dir.Fd()), fd, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	spec := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rt.Delete(t.Context(), spec.ID) })
	if err := rt.Start(t.Context(), spec.ID); err != nil {
		t.Fatalf("start with the sealed copy's fd reused: %v", err)
	}
	if !c.oci.sealed.lost.Load() || c.oci.exeNow(t.Context()) != c.oci.path {
		t.Fatalf("after the fd stopped being the sealed copy crun runs from %q; want its path %s", c.oci.exeNow(t.Context()), c.oci.path)
	}
	if err := rt.Stop(t.Context(), spec.ID, runtimetest.StopOptions()); err != nil {
		t.Fatal(err)
	}
	rt2, _ := f(t)
	o2 := rt2.(*Runtime).oci
	if o2.sealed == nil || o2.sealed == c.oci.sealed || o2.sealed.check() != nil {
		t.Fatalf("a runtime made after the copy was lost runs crun from %q (%v); want a new sealed copy", o2.exe, o2.exeErr)
	}
}

// TestExecFailureOfSealedCopyRetries: a fork/exec failure of the sealed
// copy (nothing ran) has the caller run the command again from the path;
// the copy stays in use while its fd is intact and is lost for good once
// it is not. Any other failure, or a command of another binary, is the
// caller's error as it is.
func TestExecFailureOfSealedCopyRetries(t *testing.T) {
	real, err := exec.LookPath("true")
	if err != nil {
		t.Skip("no true binary")
	}
	src, err := os.Open(real)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	fi, err := src.Stat()
	if err != nil {
		t.Fatal(err)
	}
	f, err := sealedCopy(src, fi.Size())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	o := &ociRuntime{kind: OCIRuntimeCrun, path: real, exe: fdPath(f), sealed: &sealedFile{f: f, dev: st.Dev, ino: st.Ino}}
	cmd := o.command(t.Context())
	if cmd.Path != o.exe {
		t.Fatalf("an intact copy: the command runs %s, want %s", cmd.Path, o.exe)
	}
	if o.execFailed(t.Context(), cmd, errors.New("exit status 1")) {
		t.Fatal("a command that ran and failed counted as an exec failure of the sealed copy")
	}
	if o.execFailed(t.Context(), exec.Command("/bin/true"), &os.PathError{Op: "fork/exec", Path: "/bin/true", Err: unix.EACCES}) {
		t.Fatal("an exec failure of another binary counted as the sealed copy's")
	}
	if !o.execFailed(t.Context(), cmd, &os.PathError{Op: "fork/exec", Path: o.exe, Err: unix.EACCES}) {
		t.Fatal("fork/exec EACCES of the sealed copy: want a retry from the path")
	}
	if o.sealed.lost.Load() || o.command(t.Context()).Path != o.exe {
		t.Fatal("one refused exec of an intact copy: want the copy kept for later commands")
	}
	o.sealed.ino++ // the fd is no longer what was made
	if !o.execFailed(t.Context(), cmd, &os.PathError{Op: "fork/exec", Path: o.exe, Err: unix.EACCES}) || !o.sealed.lost.Load() {
		t.Fatal("fork/exec failure with the fd no longer the copy: want a retry and the copy lost")
	}
	if got := o.command(t.Context(), "--version"); got.Path != o.path || got.Args[0] != o.path {
		t.Fatalf("after the copy was lost a command runs %s (argv0 %s); want %s", got.Path, got.Args[0], o.path)
	}
}
