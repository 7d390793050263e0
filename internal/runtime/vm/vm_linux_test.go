package vm

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// pvhHaltKernel writes an ELF64 with a PVH entry note whose code is
// `hlt; jmp hlt`: a guest that QEMU boots and that runs until killed.
// It stands in for the guest kernel until the guest assets are merged.
func pvhHaltKernel(t testing.TB, path string) {
	t.Helper()
	const base = 0x100000
	const ehsize, phsize = 64, 56
	noteOff := ehsize + 2*phsize
	var note bytes.Buffer
	_ = binary.Write(&note, binary.LittleEndian, []uint32{4, 8, 18}) // namesz, descsz, XEN_ELFNOTE_PHYS32_ENTRY
	note.WriteString("Xen\x00")
	codeOff := noteOff + note.Len() + 8
	_ = binary.Write(&note, binary.LittleEndian, uint64(base+codeOff))
	code := []byte{0xf4, 0xeb, 0xfd}
	total := codeOff + len(code)
	var b bytes.Buffer
	b.Write([]byte{0x7f, 'E', 'L', 'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	w := func(v any) { _ = binary.Write(&b, binary.LittleEndian, v) }
	w(uint16(2))
	w(uint16(62))
	w(uint32(1))
	w(uint64(base + codeOff))
	w(uint64(ehsize))
	w(uint64(0))
	w(uint32(0))
	w(uint16(ehsize))
	w(uint16(phsize))
	w(uint16(2))
	w(uint16(64))
	w(uint16(0))
	w(uint16(0))
	// PT_LOAD of the whole file at base
	w(uint32(1))
	w(uint32(5))
	w(uint64(0))
	w(uint64(base))
	w(uint64(base))
	w(uint64(total))
	w(uint64(total))
	w(uint64(0x1000))
	// PT_NOTE
	w(uint32(4))
	w(uint32(4))
	w(uint64(noteOff))
	w(uint64(base + noteOff))
	w(uint64(base + noteOff))
	w(uint64(note.Len()))
	w(uint64(note.Len()))
	w(uint64(4))
	b.Write(note.Bytes())
	b.Write(code)
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

func rootOnly(t *testing.T) {
	t.Helper()
	if os.Getenv("OPENDSEC_ROOT_TESTS") != "1" {
		t.Skip("OPENDSEC_ROOT_TESTS=1 runs the vm backend's QEMU tests")
	}
	if os.Geteuid() != 0 {
		t.Fatal("OPENDSEC_ROOT_TESTS=1 needs root")
	}
}

func newTestRuntime(t *testing.T) (*Runtime, string) { return newBenchRuntime(t) }

func newBenchRuntime(t testing.TB) (*Runtime, string) {
	t.Helper()
	if os.Getenv("OPENDSEC_ROOT_TESTS") != "1" {
		if _, ok := t.(*testing.B); ok {
			t.Skip("OPENDSEC_ROOT_TESTS=1 runs the vm benchmarks")
		}
	}
	assets := t.TempDir()
	pvhHaltKernel(t, filepath.Join(assets, "vmlinux"))
	if err := os.WriteFile(filepath.Join(assets, "initrd.cpio"), []byte("07070100"), 0o644); err != nil {
		t.Fatal(err)
	}
	rt, err := New(context.Background(), Config{AssetsDir: assets, Accel: "tcg", MemoryMB: 64, NodeID: "test"})
	if err != nil {
		t.Fatal(err)
	}
	r := rt.(*Runtime)
	r.cfg.noAgentWait = true // the stand-in kernel has no agent
	return r, assets
}

func TestQEMULifecycle(t *testing.T) {
	rootOnly(t)
	r, _ := newTestRuntime(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sd := t.TempDir()
	h, err := r.Create(ctx, runtime.Spec{ID: "vm-life", StateDir: sd, Rootfs: haltRootfs(), Resources: haltRes(64)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), h.ID) }()
	if fi, err := os.Stat(filepath.Join(sd, "rw.ext4")); err != nil || fi.Size() != 64<<20 {
		t.Fatalf("writable disk: %v %v", fi, err)
	}
	start := time.Now()
	if err := r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	t.Logf("exec to qmp running: %s", time.Since(start))
	st, err := r.Status(ctx, h.ID)
	if err != nil || st.State != runtime.StateRunning || st.Pid == 0 {
		t.Fatalf("status after start: %+v %v", st, err)
	}
	mem, err := readInt(filepath.Join(cgroupRoot, "memory", r.cgroupPath(h.ID), "memory.limit_in_bytes"))
	if err != nil || mem != (64+MemoryOverheadMB)<<20 {
		t.Fatalf("memory limit %d (%v), want %d", mem, err, (64+MemoryOverheadMB)<<20)
	}
	procs, _ := os.ReadFile(filepath.Join(cgroupRoot, "memory", r.cgroupPath(h.ID), "cgroup.procs"))
	if !bytes.Contains(procs, []byte(itoa(st.Pid))) {
		t.Fatalf("qemu %d not in its cgroup: %q", st.Pid, procs)
	}
	if err := r.Pause(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	if st, _ := r.Status(ctx, h.ID); st.State != runtime.StatePaused {
		t.Fatalf("status after pause: %+v", st)
	}
	if err := r.Resume(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	if st, _ := r.Status(ctx, h.ID); st.State != runtime.StateRunning {
		t.Fatalf("status after resume: %+v", st)
	}

	// A second backend (the node after a restart) recovers the running QEMU.
	// QMP serves one client at a time: the first node's connection ends with it.
	h, _ = r.Handle(h.ID)
	_ = r.sbs.Lookup(h.ID).qmp.Close()
	r2, _ := newTestRuntime(t)
	if err := r2.Recover(ctx, h); err != nil {
		t.Fatal(err)
	}
	if st, err := r2.Status(ctx, h.ID); err != nil || st.State != runtime.StateRunning {
		t.Fatalf("status after recover: %+v %v", st, err)
	}
	if err := r2.Pause(ctx, h.ID); err != nil {
		t.Fatalf("pause through the recovered qmp: %v", err)
	}
	if err := r2.Resume(ctx, h.ID); err != nil {
		t.Fatal(err)
	}

	// kill -9 of QEMU: Wait returns within a second, in both backends.
	if err := unix.Kill(st.Pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	wctx, wcancel := context.WithTimeout(ctx, time.Second)
	defer wcancel()
	if _, err := r.Wait(wctx, h.ID); err != nil {
		t.Fatalf("wait after kill -9: %v", err)
	}
	if _, err := r2.Wait(wctx, h.ID); err != nil {
		t.Fatalf("wait of the recovered sandbox after kill -9: %v", err)
	}
	t.Logf("kill -9 to wait: %s", time.Since(killed))
	if st, _ := r.Status(ctx, h.ID); st.State != runtime.StateStopped {
		t.Fatalf("status after kill: %+v", st)
	}
	if err := r.Delete(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	for _, f := range ownedFiles {
		if _, err := os.Stat(filepath.Join(sd, f)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left after delete: %v", f, err)
		}
	}
	for _, c := range cgroupControllers {
		if _, err := os.Stat(filepath.Join(cgroupRoot, c, r.cgroupPath(h.ID))); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s left after delete: %v", c, err)
		}
	}
}

func TestQEMUStop(t *testing.T) {
	rootOnly(t)
	r, _ := newTestRuntime(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	h, err := r.Create(ctx, runtime.Spec{ID: "vm-stop", StateDir: t.TempDir(), Rootfs: haltRootfs(), Resources: haltRes(16)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), h.ID) }()
	if err := r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	// The halting guest ignores the ACPI power-down: QMP quit ends it.
	if err := r.Stop(ctx, h.ID, runtime.StopOptions{Timeout: 200 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	es, err := r.Wait(ctx, h.ID)
	if err != nil || es.Reason != "stopped" {
		t.Fatalf("wait after stop: %+v %v", es, err)
	}
}

func TestQEMUAccelMismatchIsFatal(t *testing.T) {
	rootOnly(t)
	r, _ := newTestRuntime(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sd := t.TempDir()
	h, err := r.Create(ctx, runtime.Spec{ID: "vm-accel", StateDir: sd, Rootfs: haltRootfs(), Resources: haltRes(16)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), h.ID) }()
	if err := r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	// What QEMU prints when KVM's emulator gives up on the guest.
	f, err := os.OpenFile(filepath.Join(sd, "qemu.log"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = f.WriteString("KVM internal error. Suberror: 1\nemulation failure\n")
	_ = f.Close()
	es, err := r.Wait(ctx, h.ID)
	if err != nil || es.Reason != "accelerator mismatch" {
		t.Fatalf("wait: %+v %v", es, err)
	}
	if err := r.exitError(r.sbs.Lookup(h.ID)); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("error %v, want failed precondition naming the accelerator", err)
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

// A kernel QEMU cannot load: Start fails with QEMU's own words, and no
// QEMU is left.
func TestQEMUStartFailsOnBadKernel(t *testing.T) {
	rootOnly(t)
	r, assets := newTestRuntime(t)
	if err := os.WriteFile(filepath.Join(assets, "vmlinux"), []byte("not a kernel"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, err := r.Create(ctx, runtime.Spec{ID: "vm-badkernel", StateDir: t.TempDir(), Rootfs: haltRootfs(), Resources: haltRes(16)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), h.ID) }()
	err = r.Start(ctx, h.ID)
	if err == nil || !strings.Contains(err.Error(), "qemu exited") {
		t.Fatalf("start error %v, want qemu's exit", err)
	}
	if st, _ := r.Status(ctx, h.ID); st.State != runtime.StateStopped {
		t.Fatalf("status %+v after a failed start", st)
	}
	t.Log(err)
}
