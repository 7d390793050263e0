package vm

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// startAsNode does what the node does: Create (whose Handle it keeps in
// its table: no pid in it), then Start. Then the first instance lets go of
// QMP as a node killed with -9 would (QMP serves one client at a time).
// It returns the Create Handle, the StateDir and QEMU's pid.
func startAsNode(t *testing.T, ctx context.Context, r *Runtime, id string) (runtime.Handle, string, int) {
	t.Helper()
	sd := t.TempDir()
	h, err := r.Create(ctx, runtime.Spec{ID: id, StateDir: sd, Rootfs: haltRootfs(), Resources: haltRes(16)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Delete(context.Background(), id) })
	if err := r.Start(ctx, id); err != nil {
		t.Fatal(err)
	}
	st, err := r.Status(ctx, id)
	if err != nil || st.State != runtime.StateRunning || st.Pid == 0 {
		t.Fatalf("status after start: %+v %v", st, err)
	}
	sb := r.sbs.Lookup(id)
	sb.mu.Lock()
	_ = sb.qmp.Close()
	sb.qmp = nil
	sb.mu.Unlock()
	return h, sd, st.Pid
}

// assertNothingLeft: no QEMU process, no file of the backend in sd, no RAM
// file, no cgroup.
func assertNothingLeft(t *testing.T, r *Runtime, id, sd string, pid int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, err := os.ReadFile("/proc/" + itoa(pid) + "/stat")
		if err != nil {
			break
		}
		if i := bytes.LastIndexByte(b, ')'); i > 0 && i+2 < len(b) && b[i+2] == 'Z' {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("qemu %d still runs after delete: %s", pid, b)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if pids := r.findQEMU(id, ""); len(pids) > 0 {
		t.Errorf("qemu of %s still runs after delete: %v", id, pids)
	}
	for _, f := range ownedFiles {
		if _, err := os.Stat(filepath.Join(sd, f)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left after delete: %v", f, err)
		}
	}
	if _, err := os.Stat(r.memPath(id)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("RAM file %s left after delete: %v", r.memPath(id), err)
	}
	dirs := []string{filepath.Join(cgroupRoot, r.cgroupPath(id))}
	if !unified() {
		dirs = dirs[:0]
		for _, c := range cgroupControllers {
			dirs = append(dirs, filepath.Join(cgroupRoot, c, r.cgroupPath(id)))
		}
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s left after delete: %v", d, err)
		}
	}
}

// The node's real path through a restart: it kept the Handle Create
// returned; a second backend instance recovers the running QEMU from it,
// drives it through QMP, and reports a kill -9 of QEMU within a second.
func TestQEMURecoverFromCreateHandle(t *testing.T) {
	rootOnly(t)
	r, _ := newTestRuntime(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const id = "vm-rec-create"
	h, sd, pid := startAsNode(t, ctx, r, id)

	r2, _ := newTestRuntime(t)
	t.Cleanup(func() { _ = r2.Delete(context.Background(), id) })
	if err := r2.Recover(ctx, h); err != nil {
		t.Fatalf("recover from the create handle: %v", err)
	}
	st, err := r2.Status(ctx, id)
	if err != nil || st.State != runtime.StateRunning || st.Pid != pid {
		t.Fatalf("status after recover: %+v %v, want running with pid %d", st, err, pid)
	}
	if err := r2.Pause(ctx, id); err != nil {
		t.Fatalf("pause through the recovered qmp: %v", err)
	}
	if st, _ := r2.Status(ctx, id); st.State != runtime.StatePaused {
		t.Fatalf("status after pause: %+v", st)
	}
	if err := r2.Resume(ctx, id); err != nil {
		t.Fatal(err)
	}
	// Its state dir is not another sandbox's.
	gone := h
	gone.ID = "vm-rec-gone"
	if err := r2.Recover(ctx, gone); !errdefs.IsNotFound(err) {
		t.Fatalf("recover of a sandbox that does not exist: %v, want not found", err)
	}

	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	wctx, wcancel := context.WithTimeout(ctx, time.Second)
	defer wcancel()
	es, err := r2.Wait(wctx, id)
	if err != nil {
		t.Fatalf("wait of the recovered sandbox after kill -9 of qemu: %v", err)
	}
	t.Logf("kill -9 to wait: %s (%+v)", time.Since(killed), es)
	if st, _ := r2.Status(ctx, id); st.State != runtime.StateStopped {
		t.Fatalf("status after kill: %+v", st)
	}
	if err := r2.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, r2, id, sd, pid)

	// A third instance (another restart) finds it gone.
	r3, _ := newTestRuntime(t)
	if err := r3.Recover(ctx, h); !errdefs.IsNotFound(err) {
		t.Fatalf("recover after delete: %v, want not found", err)
	}
}

// Delete through the restarted node leaves no QEMU, file or cgroup: after
// Recover of the Create handle, after Recover when the node died before
// recording QEMU's pid, and without any Recover (the node lost the handle).
func TestQEMUDeleteAfterRestartLeavesNothing(t *testing.T) {
	rootOnly(t)
	for _, tc := range []struct {
		name     string
		unrecord bool // the run file lost QEMU's pid
		recover  bool
	}{
		{"recovered", false, true},
		{"pid-not-recorded", true, true},
		{"without-recover", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, _ := newTestRuntime(t)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			id := "vm-rec-del-" + tc.name
			h, sd, pid := startAsNode(t, ctx, r, id)
			if tc.unrecord {
				if err := writeRunState(sd, runState{ID: id}); err != nil {
					t.Fatal(err)
				}
			}
			r2, _ := newTestRuntime(t)
			if tc.recover {
				if err := r2.Recover(ctx, h); err != nil {
					t.Fatalf("recover: %v", err)
				}
				if st, err := r2.Status(ctx, id); err != nil || st.State != runtime.StateRunning || st.Pid != pid {
					t.Fatalf("status after recover: %+v %v, want running with pid %d", st, err, pid)
				}
			}
			if err := r2.Delete(ctx, id); err != nil {
				t.Fatalf("delete: %v", err)
			}
			assertNothingLeft(t, r2, id, sd, pid)
		})
	}
}

// A sandbox created but never started, recovered from its Handle, is
// "created" (the node removes it), and its Stop and Delete leave nothing.
func TestQEMURecoverCreatedOnly(t *testing.T) {
	rootOnly(t)
	r, _ := newTestRuntime(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const id = "vm-rec-created"
	sd := t.TempDir()
	h, err := r.Create(ctx, runtime.Spec{ID: id, StateDir: sd, Rootfs: haltRootfs(), Resources: haltRes(16)})
	if err != nil {
		t.Fatal(err)
	}
	r2, _ := newTestRuntime(t)
	if err := r2.Recover(ctx, h); err != nil {
		t.Fatal(err)
	}
	if st, err := r2.Status(ctx, id); err != nil || st.State != runtime.StateCreated {
		t.Fatalf("status: %+v %v, want created", st, err)
	}
	if err := r2.Stop(ctx, id, runtime.StopOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := r2.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, r2, id, sd, 0)
	r.sbs.Remove(id) // the first instance died with the node
}

// argsOf's match: the sandbox's -name, its RAM file on this node and,
// when asked, its pidfile in the state dir; as QEMU or as the nsenter
// that execs it.
func TestArgsOfMatchesOnlyThisSandbox(t *testing.T) {
	r := &Runtime{cfg: Config{NodeID: "n1", MemoryDir: "/dev/shm/opendsec-vm"}}
	other := &Runtime{cfg: Config{NodeID: "n2", MemoryDir: "/dev/shm/opendsec-vm"}}
	spec := runtime.Spec{ID: "sb1", StateDir: "/var/lib/opendsec/sandboxes/sb1"}
	args := r.args(spec, 1, 64, "/x/rw.ext4", r.memPath("sb1"), argOpts{})
	nsenter := append([]string{"nsenter", "--net=/run/netns/x", "--", "/usr/bin/qemu-system-x86_64"}, args...)
	for _, tc := range []struct {
		name string
		r    *Runtime
		args []string
		id   string
		sd   string
		want bool
	}{
		{"qemu", r, append([]string{"qemu"}, args...), "sb1", spec.StateDir, true},
		{"nsenter", r, nsenter, "sb1", spec.StateDir, true},
		{"any state dir", r, args, "sb1", "", true},
		{"other id", r, args, "sb10", "", false},
		{"other state dir", r, args, "sb1", "/var/lib/opendsec/sandboxes/sb2", false},
		{"other node", other, args, "sb1", "", false},
	} {
		if got := tc.r.argsOf(tc.args, tc.id, tc.sd); got != tc.want {
			t.Errorf("%s: argsOf = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestRunStateRoundTrip(t *testing.T) {
	sd := t.TempDir()
	want := runState{ID: "a", Pid: 42, StartTime: 7, Reclaimed: true, Args: []string{"-m", "64M"}}
	if err := writeRunState(sd, want); err != nil {
		t.Fatal(err)
	}
	rs, err := readRunState(sd)
	if err != nil || !reflect.DeepEqual(rs, want) {
		t.Fatalf("read %+v %v", rs, err)
	}
	if _, err := os.Stat(filepath.Join(sd, runFile+".tmp")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("temporary file left: %v", err)
	}
}

// TestArgsBalloon: a VM has a balloon when its arguments have the
// device, PCI or MMIO, and not otherwise.
func TestArgsBalloon(t *testing.T) {
	for _, c := range []struct {
		args []string
		want bool
	}{
		{[]string{"-device", "virtio-balloon-pci,free-page-reporting=on"}, true},
		{[]string{"-device", "virtio-balloon-device,free-page-reporting=on"}, true},
		{[]string{"-device", "virtio-blk-pci,drive=rw", "-name", "virtio-balloon"}, false},
		{nil, false},
	} {
		if got := argsBalloon(c.args); got != c.want {
			t.Errorf("argsBalloon(%q) = %v, want %v", c.args, got, c.want)
		}
	}
}

// TestReclaimRefusesPmem: a VM whose layers are pmem devices is not
// reclaimed (its restore would write into their read-only mappings), and
// the error says why and what to use.
func TestReclaimRefusesPmem(t *testing.T) {
	sb := &sandbox{id: "sb-pmem", started: true, exit: runtime.NewExitLatch(),
		st: handleState{Args: []string{"-object", "memory-backend-file,id=l0,share=on,readonly=on", "-device", "virtio-pmem-pci,memdev=l0,id=pl0"}}}
	r := &Runtime{}
	r.sbs.Add(sb.id, sb)
	_, err := r.Reclaim(context.Background(), sb.id)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "layer_device") {
		t.Fatalf("reclaim of a pmem VM: %v; want failed precondition naming layer_device", err)
	}
}

// TestFreePageReportingDefaultOff: free page reporting is off unless
// configured on (and then only with assets that can unbind the driver),
// and the reason says why.
func TestFreePageReportingDefaultOff(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "manifest.json"), []byte(`{"features":["balloon-control"]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	on, off := true, false
	for _, c := range []struct {
		cfg  *bool
		want bool
		why  string
	}{{nil, false, "siblings"}, {&off, false, "free_page_reporting: false"}, {&on, true, "unsafe"}} {
		r := &Runtime{cfg: Config{AssetsDir: dir, FreePageReporting: c.cfg}}
		got, why := r.freePageReportingWhy()
		if got != c.want || !strings.Contains(why, c.why) {
			t.Errorf("free_page_reporting %v: %v %q; want %v, a reason naming %q", c.cfg, got, why, c.want, c.why)
		}
	}
}
