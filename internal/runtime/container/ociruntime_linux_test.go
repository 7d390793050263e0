package container

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// testOCIRuntimeEnv names the OCI runtime the package's root tests run
// under: auto (the default, what users get: crun where it works), runc or
// crun. CI runs the package once with the default and once with runc
// (Makefile, test-go).
const testOCIRuntimeEnv = "OPENDSEC_TEST_OCI_RUNTIME"

// testOCIRuntime is the OCI runtime the package's tests use.
func testOCIRuntime(t testing.TB) string {
	t.Helper()
	switch v := os.Getenv(testOCIRuntimeEnv); v {
	case "", OCIRuntimeAuto:
		return OCIRuntimeAuto
	case OCIRuntimeRunc, OCIRuntimeCrun:
		requireOCIRuntime(t, v)
		return v
	default:
		t.Fatalf("%s=%q: give auto, runc or crun", testOCIRuntimeEnv, v)
		return ""
	}
}

// requireOCIRuntime skips the test when the runtime's binary is not
// installed, except under CI (CI=true), which installs both
// (scripts/install-deps.sh): there it fails.
func requireOCIRuntime(t testing.TB, kind string) {
	t.Helper()
	if _, err := exec.LookPath(kind); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s is not installed (%v); CI installs it with scripts/install-deps.sh", kind, err)
		}
		t.Skipf("%s is not installed (%v): apt-get install %s", kind, err, kind)
	}
}

// ociRuntimes are the runtimes a test runs under, one subtest each.
var ociRuntimes = []string{OCIRuntimeRunc, OCIRuntimeCrun}

// testOCIKind is the runtime testOCIRuntime resolves to: auto is crun
// where it is installed (New's probe decides; tests that depend on it
// check Runtime.oci.kind), else runc.
func testOCIKind(t testing.TB) string {
	t.Helper()
	kind := testOCIRuntime(t)
	if kind != OCIRuntimeAuto {
		return kind
	}
	if _, err := exec.LookPath(OCIRuntimeCrun); err == nil {
		return OCIRuntimeCrun
	}
	return OCIRuntimeRunc
}

// withOCIBinary sets the config's runtime to kind, run from path (a
// wrapper of the real binary, say).
func withOCIBinary(c *Config, kind, path string) {
	c.OCIRuntime = kind
	if kind == OCIRuntimeCrun {
		c.CrunPath = path
	} else {
		c.RuncPath = path
	}
}

// isProbeCall reports whether a wrapper's log line is of New's crun probe.
func isProbeCall(line string) bool { return strings.Contains(line, "opendsec-crun-probe") }

// TestSecurityDevicesCgroup checks, under each OCI runtime, that the
// devices cgroup config.json asks for is applied: root in the sandbox
// (which has CAP_MKNOD) makes a node of the host's root disk and cannot
// read it (the host can), while the default devices work.
func TestSecurityDevicesCgroup(t *testing.T) {
	disk := hostBlockDevice(t)
	var st unix.Stat_t
	if err := unix.Stat(disk, &st); err != nil {
		t.Fatal(err)
	}
	maj, mnr := unix.Major(st.Rdev), unix.Minor(st.Rdev)
	f, err := os.Open(disk)
	if err != nil {
		t.Fatalf("the host cannot open %s: %v", disk, err)
	}
	n, err := f.Read(make([]byte, 512))
	f.Close()
	if err != nil || n != 512 {
		t.Fatalf("the host reads %d bytes of %s: %v (the test would prove nothing)", n, disk, err)
	}
	for _, kind := range ociRuntimes {
		t.Run(kind, func(t *testing.T) {
			requireOCIRuntime(t, kind)
			f := newFactoryWith(t, func(c *Config) { c.OCIRuntime = kind })
			rt, tmpl := f(t)
			spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
			res := sh(t, rt, spec.ID, fmt.Sprintf(`mknod /devtest b %d %d; echo "mknod $?"; head -c 512 /devtest | wc -c; rm -f /devtest
mknod /memtest c 1 1; head -c 16 /memtest | wc -c; rm -f /memtest
mknod /contest c 5 1; echo x >/contest; echo "console $?"; rm -f /contest
head -c 16 /dev/zero | wc -c; head -c 16 /dev/urandom | wc -c; echo x >/dev/null && echo null-ok`, maj, mnr))
			lines := strings.Split(strings.TrimSpace(res.Stdout), "\n")
			// mknod itself may be refused ("m" is not allowed); either
			// way nothing is read.
			if len(lines) != 7 || lines[1] != "0" || lines[2] != "0" || lines[3] == "console 0" {
				t.Fatalf("devices in the sandbox: stdout %q stderr %q; want 0 bytes of the disk and of /dev/mem, and no write to the host's console", res.Stdout, res.Stderr)
			}
			if lines[4] != "16" || lines[5] != "16" || lines[6] != "null-ok" {
				t.Fatalf("default devices in the sandbox: stdout %q stderr %q; want /dev/zero, /dev/urandom, /dev/null usable", res.Stdout, res.Stderr)
			}
			if !strings.Contains(res.Stderr, "Operation not permitted") {
				t.Fatalf("devices in the sandbox: stderr %q; want the devices cgroup's EPERM", res.Stderr)
			}
			t.Logf("%s: stdout %q stderr %q", kind, res.Stdout, res.Stderr)
			c := rt.(*Runtime)
			if !c.cg.v2 {
				b, err := os.ReadFile(filepath.Join(c.cg.v1["devices"], c.cgroupPath(spec.ID), "devices.list"))
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("%s: devices.list:\n%s", kind, b)
				if strings.Contains(string(b), "a *:* rwm") || strings.Contains(string(b), "c 5:1 ") {
					t.Fatalf("devices.list of the sandbox allows everything:\n%s", b)
				}
			}
		})
	}
}

// hostBlockDevice returns a loop device backed by a file of 4 KiB of 'x'
// (made for the test, detached after it).
func hostBlockDevice(t *testing.T) string {
	t.Helper()
	img := filepath.Join(t.TempDir(), "disk")
	if err := os.WriteFile(img, []byte(strings.Repeat("x", 4096)), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup %s: %v: %s", img, err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			t.Errorf("losetup -d %s: %v: %s", dev, err, out)
		}
	})
	return dev
}

// TestOCIRuntimeChoice checks how container.oci_runtime picks the runtime:
// auto takes crun where it works and says why, falls back to runc (saying
// why) when crun is missing, too old or fails its probe; an explicit crun
// that cannot work is an error naming the key and the fix, and changes
// nothing.
func TestOCIRuntimeChoice(t *testing.T) {
	requireOCIRuntime(t, OCIRuntimeRunc)
	requireOCIRuntime(t, OCIRuntimeCrun)
	// On cgroup v2 crun needs the device program on the sandboxes'
	// parent: where it cannot be attached (here: a parent that is no
	// cgroup), auto keeps runc and says why, and an explicit crun fails.
	v2 := cgroupMounts{v2: true, unified: t.TempDir()}
	cfg := Config{OCIRuntime: OCIRuntimeAuto, CgroupParent: "/nowhere"}
	cfg.setDefaults()
	if o, err := chooseOCIRuntime(&cfg, v2); err != nil || o.kind != OCIRuntimeRunc || !strings.Contains(o.reason, "/dev/console") {
		t.Fatalf("auto on cgroup v2 without the device program: %+v %v; want runc, saying why", o, err)
	}
	cfg.OCIRuntime = OCIRuntimeCrun
	if _, err := chooseOCIRuntime(&cfg, v2); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "container.oci_runtime") || !strings.Contains(err.Error(), "/dev/console") {
		t.Fatalf("crun on cgroup v2 without the device program: %v; want failed_precondition naming container.oci_runtime and /dev/console", err)
	}
	dir := t.TempDir()
	fake := func(name, script string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte("#!/bin/sh\n"+script+"\n"), 0o755); err != nil { //nolint:gosec // an executable
			t.Fatal(err)
		}
		return p
	}
	old := fake("crun-old", `echo "crun version 1.4.5"; echo "commit: x"`)
	broken := fake("crun-broken", `case "$1" in --version) echo "crun version 1.9.0";; *) echo "cgroups in hybrid mode not supported" >&2; exit 1;; esac`)
	for _, tc := range []struct {
		name, runtime, crunPath string
		want                    string // kind; "" an error
		reason                  string // in Info().Detail or the error
	}{
		{"auto", OCIRuntimeAuto, "", OCIRuntimeCrun, "crun 1."},
		{"default", "", "", OCIRuntimeCrun, "auto"},
		{"runc", OCIRuntimeRunc, "", OCIRuntimeRunc, "container.oci_runtime is runc"},
		{"crun", OCIRuntimeCrun, "", OCIRuntimeCrun, "container.oci_runtime is crun"},
		{"auto missing crun", OCIRuntimeAuto, filepath.Join(dir, "nowhere"), OCIRuntimeRunc, "not found"},
		{"auto old crun", OCIRuntimeAuto, old, OCIRuntimeRunc, "older than 1.8"},
		{"auto broken crun", OCIRuntimeAuto, broken, OCIRuntimeRunc, "hybrid mode not supported"},
		{"crun missing", OCIRuntimeCrun, filepath.Join(dir, "nowhere"), "", "not found"},
		{"crun old", OCIRuntimeCrun, old, "", "older than 1.8"},
		{"crun broken", OCIRuntimeCrun, broken, "", "hybrid mode not supported"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFactoryWith(t, func(c *Config) {
				c.OCIRuntime, c.CrunPath = tc.runtime, tc.crunPath
				c.StateRoot = filepath.Join(t.TempDir(), "state")
			})
			if tc.want == "" {
				cfg := Config{StateRoot: filepath.Join(t.TempDir(), "state"), CgroupParent: "/opendsec-test", AgentPath: testutil.AgentBinary(t),
					OCIRuntime: tc.runtime, CrunPath: tc.crunPath}
				_, err := New(cfg)
				if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "container.oci_runtime") ||
					!strings.Contains(err.Error(), "apt-get install crun") || !strings.Contains(err.Error(), tc.reason) {
					t.Fatalf("New with oci_runtime %s, crun_path %s: %v; want failed_precondition naming container.oci_runtime, the fix and %q", tc.runtime, tc.crunPath, err, tc.reason)
				}
				if _, err := os.Stat(cfg.StateRoot); !os.IsNotExist(err) {
					t.Fatalf("a refused runtime made its state root: %v", err)
				}
				return
			}
			rt, _ := f(t)
			info := rt.Info()
			if got := rt.(*Runtime).oci.kind; got != tc.want || !strings.HasPrefix(info.Version, tc.want+" ") {
				t.Fatalf("runtime %s (version %q); want %s", got, info.Version, tc.want)
			}
			if !strings.Contains(info.Detail, tc.reason) || !strings.HasPrefix(info.Detail, "oci_runtime "+tc.want+": ") {
				t.Fatalf("Info().Detail %q; want the choice %s and %q", info.Detail, tc.want, tc.reason)
			}
		})
	}
}

// TestRecoverAcrossOCIRuntimes: a node restarted with another
// container.oci_runtime (runc's sandboxes when crun became the default,
// or back) recovers the sandboxes the other runtime made and keeps using
// that runtime for them (its state file is the proof of which one made
// it): a running one answers, pauses, resumes, stops and is deleted with
// nothing left; a prestarted one starts. New sandboxes get the node's
// runtime.
func TestRecoverAcrossOCIRuntimes(t *testing.T) {
	for _, tc := range []struct{ made, recovered string }{{OCIRuntimeRunc, OCIRuntimeCrun}, {OCIRuntimeCrun, OCIRuntimeRunc}} {
		t.Run(tc.made+"-then-"+tc.recovered, func(t *testing.T) {
			requireOCIRuntime(t, tc.made)
			requireOCIRuntime(t, tc.recovered)
			kind := tc.made
			f := newFactoryWith(t, func(c *Config) { c.OCIRuntime = kind })
			rt1, tmpl := f(t)
			ctx := t.Context()
			running, h := runtimetest.StartSandbox(t, rt1, tmpl)
			pre := runtimetest.Prepare(t, rt1, tmpl)
			hPre, err := rt1.Create(ctx, pre)
			if err != nil {
				t.Fatal(err)
			}
			if err := rt1.(*Runtime).Prestart(ctx, pre.ID); err != nil {
				t.Fatalf("prestart under %s: %v", tc.made, err)
			}
			root := rt1.(*Runtime).cfg.StateRoot
			for _, id := range []string{running.ID, pre.ID} {
				if _, err := os.Stat(filepath.Join(root, id, stateFileOf(tc.made))); err != nil {
					t.Fatalf("%s made %s without its state file: %v", tc.made, id, err)
				}
			}

			kind = tc.recovered // the node restarts with the other runtime
			rt2, _ := f(t)
			c2 := rt2.(*Runtime)
			if c2.oci.kind != tc.recovered {
				t.Fatalf("restarted node runs %s, want %s", c2.oci.kind, tc.recovered)
			}
			for _, hh := range []runtime.Handle{h, hPre} {
				if err := rt2.Recover(ctx, hh); err != nil {
					t.Fatalf("recover %s's sandbox under %s: %v", tc.made, tc.recovered, err)
				}
			}
			if st, err := rt2.Status(ctx, running.ID); err != nil || st.State != runtime.StateRunning {
				t.Fatalf("status of %s's running sandbox under %s: %+v %v", tc.made, tc.recovered, st, err)
			}
			if res := sh(t, rt2, running.ID, "echo still"); res.Stdout != "still\n" {
				t.Fatalf("exec after the switch: %+v", res)
			}
			if err := c2.Pause(ctx, running.ID); err != nil {
				t.Fatal(err)
			}
			if st, err := rt2.Status(ctx, running.ID); err != nil || st.State != runtime.StatePaused {
				t.Fatalf("status of a paused sandbox %s made: %+v %v; want paused", tc.made, st, err)
			}
			if err := c2.Resume(ctx, running.ID); err != nil {
				t.Fatal(err)
			}
			if st, err := rt2.Status(ctx, pre.ID); err != nil || st.State != runtime.StateCreated {
				t.Fatalf("status of %s's prestarted sandbox under %s: %+v %v; want created", tc.made, tc.recovered, st, err)
			}
			if err := rt2.Start(ctx, pre.ID); err != nil {
				t.Fatalf("start %s's prestarted sandbox under %s: %v", tc.made, tc.recovered, err)
			}
			if err := runtimetest.WaitAgent(ctx, rt2, pre.ID, 20*time.Second); err != nil {
				t.Fatal(err)
			}
			for _, id := range []string{running.ID, pre.ID} {
				if err := rt2.Stop(ctx, id, runtime.StopOptions{Timeout: time.Second}); err != nil {
					t.Fatalf("stop %s: %v", id, err)
				}
				if err := rt2.Delete(ctx, id); err != nil {
					t.Fatalf("delete %s: %v", id, err)
				}
				if _, err := os.Stat(filepath.Join(root, id)); !os.IsNotExist(err) {
					t.Fatalf("%s's state dir of %s after delete: %v; want it gone", tc.made, id, err)
				}
				for _, d := range c2.CgroupDirs(id) {
					t.Errorf("cgroup %s left after delete", d)
				}
			}
			fresh, _ := runtimetest.StartSandbox(t, rt2, tmpl)
			if _, err := os.Stat(filepath.Join(root, fresh.ID, stateFileOf(tc.recovered))); err != nil {
				t.Fatalf("a new sandbox is not %s's: %v", tc.recovered, err)
			}
		})
	}
}

// TestCrunStartViaExecFifo: Launch starts a container crun created the way
// `crun start` does, without the binary: one byte to crun's init, which
// holds the fifo open for reading, and the fifo removed (what makes `crun
// state` say running); with no reader (init gone or started) it fails
// at once; with no fifo the caller falls back to `crun start`.
func TestCrunStartViaExecFifo(t *testing.T) {
	dir := t.TempDir()
	if err := crunStartViaExecFifo(dir, 0); !errors.Is(err, errNoExecFifo) {
		t.Fatalf("no fifo: %v; want errNoExecFifo", err)
	}
	fifo := filepath.Join(dir, execFifo)
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := crunStartViaExecFifo(dir, 0); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("fifo without a reader: %v; want failed_precondition", err)
	}
	// crun's init: the fifo open for reading (crun opens it O_NONBLOCK).
	r, err := os.OpenFile(fifo, os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := crunStartViaExecFifo(dir, 0); err != nil {
		t.Fatalf("start: %v", err)
	}
	if _, err := os.Lstat(fifo); !os.IsNotExist(err) {
		t.Fatalf("fifo after start: %v; want it removed", err)
	}
	b := make([]byte, 4)
	if n, err := r.Read(b); err != nil || n != 1 {
		t.Fatalf("init read %d bytes (%v); want the one byte that lets it exec", n, err)
	}
}

// TestDenyDeviceBPF checks the cgroup v2 device program the node attaches
// to the sandboxes' parent where crun runs on cgroup v2 (it refuses
// /dev/console there; this host's console is closed to the test itself, so
// the test has the program refuse /dev/full, c 1:7): a process in a
// cgroup below it cannot open the device, which it could before, and
// still opens /dev/null; a second attach (a node restart) is a no-op. It
// runs on the host's cgroup2 hierarchy (the unified one of a hybrid host).
func TestDenyDeviceBPF(t *testing.T) {
	testutil.RequiresRoot(t)
	cg, err := detectCgroups()
	if err != nil {
		t.Fatal(err)
	}
	if cg.unified == "" {
		t.Skip("no cgroup2 hierarchy mounted")
	}
	node, maj, mnr := "/dev/full", uint32(1), uint32(7)
	parent := filepath.Join(cg.unified, fmt.Sprintf("opendsec-bpftest-%d", os.Getpid()))
	child := filepath.Join(parent, "sb")
	if err := os.MkdirAll(child, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = os.Remove(child)
		_ = os.Remove(parent)
	})
	probe := func() string {
		t.Helper()
		out, err := exec.Command("sh", "-c", `echo $$ > `+child+`/cgroup.procs || exit 9
head -c 0 <`+node+` && echo dev-ok || echo dev-denied
head -c 0 </dev/null && echo null-ok || echo null-denied`).CombinedOutput()
		if err != nil {
			t.Fatalf("probe in %s: %v: %s", child, err, out)
		}
		return string(out)
	}
	got := probe()
	if strings.Contains(got, "dev-ok") && strings.Contains(got, "null-ok") {
		t.Logf("before the program: %q", got)
	} else {
		t.Fatalf("before the program: %q; want %s (c %d:%d) and /dev/null usable (the test would prove nothing)", got, node, maj, mnr)
	}
	for range 2 {
		if err := denyCharDeviceBPF(parent, int32(maj), int32(mnr)); err != nil { //nolint:gosec // device numbers fit
			t.Fatalf("attach: %v", err)
		}
	}
	got = probe()
	if !strings.Contains(got, "dev-denied") || !strings.Contains(got, "null-ok") {
		t.Fatalf("with the program: %q; want c %d:%d refused, /dev/null usable", got, maj, mnr)
	}
	t.Logf("with the program: %q", got)
}
