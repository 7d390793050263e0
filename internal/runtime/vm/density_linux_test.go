package vm

import (
	"context"
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
	"github.com/kernflux/opendsec/internal/runtime/sched"
)

// TestBestEffortQEMU: a best_effort VM's QEMU runs every thread (vCPUs
// included) under SCHED_IDLE, in a cgroup with the least CPU weight; a
// latency one under the normal policy.
func TestBestEffortQEMU(t *testing.T) {
	rootOnly(t)
	r, _ := newTestRuntime(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, class := range []runtime.CPUClass{runtime.CPUBestEffort, runtime.CPULatency} {
		id := "vm-class-" + strings.ReplaceAll(string(class), "_", "-")
		if _, err := r.Create(ctx, runtime.Spec{ID: id, StateDir: t.TempDir(), Rootfs: haltRootfs(), Resources: haltRes(16), CPUClass: class}); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = r.Delete(context.Background(), id) }()
		if err := r.Start(ctx, id); err != nil {
			t.Fatal(err)
		}
		st, err := r.Status(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		tasks, err := os.ReadDir("/proc/" + strconv.Itoa(st.Pid) + "/task")
		if err != nil {
			t.Fatal(err)
		}
		if len(tasks) < 2 {
			t.Fatalf("%s: qemu has %d threads; want its vCPU thread too", class, len(tasks))
		}
		for _, e := range tasks {
			tid, _ := strconv.Atoi(e.Name())
			p, err := sched.Policy(tid)
			if err != nil {
				continue // ended meanwhile
			}
			if idle := p == unix.SCHED_IDLE; idle != (class == runtime.CPUBestEffort) {
				comm, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(st.Pid), "task", e.Name(), "comm"))
				t.Fatalf("%s: qemu thread %d (%s) has policy %d", class, tid, strings.TrimSpace(string(comm)), p)
			}
		}
		want := "1024"
		if class == runtime.CPUBestEffort {
			want = "2"
		}
		f := filepath.Join(cgroupRoot, "cpu", r.cgroupPath(id), "cpu.shares")
		if unified() {
			f, want = filepath.Join(cgroupRoot, r.cgroupPath(id), "cpu.weight"), map[string]string{"2": "1", "1024": "100"}[want]
		}
		if b, err := os.ReadFile(f); err != nil || strings.TrimSpace(string(b)) != want {
			t.Fatalf("%s: %s is %q (%v), want %s", class, f, b, err, want)
		}
	}
}

// balloonBound says whether the guest's virtio_balloon driver has a device.
func balloonBound(t testing.TB, r *Runtime, id string) bool {
	t.Helper()
	return strings.Contains(guestRun(t, r, id, "ls /sys/bus/virtio/drivers/virtio_balloon/ 2>/dev/null; true"), "virtio")
}

// allocated is the bytes of path's file the host holds (its blocks).
func allocated(t testing.TB, path string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// TestFreePageReporting: memory a guest uses and frees goes back to the
// host. The guest fills 96 MiB of its tmpfs and removes it; the balloon's
// free page reporting makes QEMU punch the freed pages out of the guest's
// RAM file (a shared file mapping: fallocate PUNCH_HOLE), so the file's
// allocated size falls again.
func TestFreePageReporting(t *testing.T) {
	r, id := guestVM(t)
	sb, err := r.get(id)
	if err != nil {
		t.Fatal(err)
	}
	if !sb.st.Balloon {
		t.Fatalf("the shared guest has no balloon device: the assets (%s) lack %q or free_page_reporting is off", r.cfg.AssetsDir, featureBalloonControl)
	}
	if !balloonBound(t, r, id) {
		t.Fatal("the guest's virtio_balloon driver has no device")
	}
	mem := sb.st.MemPath
	before := allocated(t, mem)
	guestRun(t, r, id, "head -c 96m /dev/zero > /run/fill && sync")
	full := allocated(t, mem)
	guestRun(t, r, id, "rm /run/fill")
	// The guest reports free 2 MiB blocks about 2 s after they are freed.
	deadline := time.Now().Add(60 * time.Second)
	now := full
	for now > full-64<<20 {
		if time.Now().After(deadline) {
			t.Fatalf("guest RAM file: %d MiB before, %d MiB with 96 MiB in the guest's tmpfs, still %d MiB 60 s after it was removed: the freed pages did not go back",
				before>>20, full>>20, now>>20)
		}
		time.Sleep(200 * time.Millisecond) // polling the host's file, not synchronising with the guest
		now = allocated(t, mem)
	}
	t.Logf("guest RAM file: %d MiB before, %d MiB with 96 MiB in the guest, %d MiB after it was freed", before>>20, full>>20, now>>20)
}

// TestArgsDensityDevices: the balloon and the pmem layers on QEMU's
// command line, and the config refusing pmem on microvm.
func TestArgsDensityDevices(t *testing.T) {
	cfg := Config{Machine: "q35", LayerDevice: LayerPmem, AssetsDir: "/a"}
	if err := cfg.defaults(); err != nil {
		t.Fatal(err)
	}
	r := &Runtime{cfg: cfg, accel: "tcg"}
	spec := runtime.Spec{ID: "sb1", StateDir: "/s", Rootfs: runtime.Rootfs{Layers: []runtime.Layer{{Path: "/l/0.erofs"}, {Path: "/l/1.erofs"}}}}
	pm := []pmemLayer{{path: "/p/0.img", size: 4 << 20}, {path: "/p/1.img", size: 2 << 20}}
	a := strings.Join(r.args(spec, 1, 512, "/s/rw.ext4", "/m/sb1.mem", argOpts{balloon: true, pmem: pm}), " ")
	for _, want := range []string{
		"-m 512M,slots=2,maxmem=518M",
		"memory-backend-file,id=layer0,mem-path=/p/0.img,size=4194304,share=on,readonly=on -device virtio-pmem-pci,memdev=layer0",
		"memory-backend-file,id=layer1,mem-path=/p/1.img,size=2097152,share=on,readonly=on",
		"opendsec.layers=2 opendsec.rw=vda opendsec.config=vdb",
		"opendsec.layerdev=pmem swiotlb=noforce",
		"virtio-balloon-pci,free-page-reporting=on,deflate-on-oom=on",
	} {
		if !strings.Contains(a, want) {
			t.Errorf("pmem args lack %q:\n%s", want, a)
		}
	}
	if strings.Contains(a, "/l/0.erofs") {
		t.Errorf("pmem args still attach a layer as a disk:\n%s", a)
	}
	a = strings.Join(r.args(spec, 1, 512, "/s/rw.ext4", "/m/sb1.mem", argOpts{}), " ")
	for _, bad := range []string{"balloon", "pmem", "slots=", "swiotlb"} {
		if strings.Contains(a, bad) {
			t.Errorf("blk args without a balloon have %q:\n%s", bad, a)
		}
	}
	if !strings.Contains(a, "file=/l/1.erofs,format=raw,if=none,readonly=on,id=layer1") || !strings.Contains(a, "opendsec.rw=vdc opendsec.config=vdd") {
		t.Errorf("blk args:\n%s", a)
	}
	bad := Config{LayerDevice: LayerPmem}
	if err := bad.defaults(); err == nil || !strings.Contains(err.Error(), `needs machine "q35"`) {
		t.Errorf("pmem on microvm: %v, want an error naming q35", err)
	}
}

// TestPadCopy: a layer's pmem copy has its bytes and is padded to 2 MiB.
func TestPadCopy(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "l.erofs")
	if err := os.WriteFile(src, []byte("erofs bytes"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := &Runtime{cfg: Config{NodeStateDir: dir}}
	pm, err := r.pmemLayers([]runtime.Layer{{Path: src, Digest: "sha256:ab"}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(pm[0].path)
	if err != nil || len(b) != pmemAlign || pm[0].size != pmemAlign || string(b[:11]) != "erofs bytes" || pm[0].path != filepath.Join(dir, "vm-pmem", "sha256-ab.img") {
		t.Fatalf("pmem copy %s: %d bytes (size %d), %v", pm[0].path, len(b), pm[0].size, err)
	}
	// Without a digest, two layers of one basename get their own files,
	// named by content.
	other := filepath.Join(dir, "b", "l.erofs")
	if err := os.MkdirAll(filepath.Dir(other), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(other, []byte("other bytes"), 0o644); err != nil {
		t.Fatal(err)
	}
	pm, err = r.pmemLayers([]runtime.Layer{{Path: src}, {Path: other}})
	if err != nil {
		t.Fatal(err)
	}
	if pm[0].path == pm[1].path {
		t.Fatalf("two layers named l.erofs share the pmem file %s", pm[0].path)
	}
	// Without the node's state dir: refused, never a shared temp dir.
	if _, err := (&Runtime{}).pmemLayers([]runtime.Layer{{Path: src, Digest: "sha256:ab"}}); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "state dir") {
		t.Fatalf("pmem layers without a node state dir: %v; want failed precondition", err)
	}
}

// TestPmemLayers boots a q35 VM whose image layer is a virtio-pmem device
// mounted with DAX, reads the image in it, forks it and reads the image in
// the fork (its pmem backing stays the shared, read-only file).
func TestPmemLayers(t *testing.T) {
	rootOnly(t)
	dir, why := guestAssets()
	if dir == "" {
		skipOrFail(t, why)
	}
	rt, err := New(context.Background(), Config{AssetsDir: dir, Accel: "tcg", Machine: "q35", LayerDevice: LayerPmem, NodeID: "pmem",
		NodeStateDir: t.TempDir(), BootTimeoutSec: int(guestBootTimeout / time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	r := rt.(*Runtime)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	spec := runtime.Spec{ID: "pmem-src", StateDir: t.TempDir(), Rootfs: guestRootfs(t), Resources: guestRes(16)}
	if _, err := r.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), spec.ID) }()
	sb, _ := r.get(spec.ID)
	if a := strings.Join(sb.st.Args, " "); !strings.Contains(a, "virtio-pmem-pci,memdev=layer0") {
		t.Fatalf("no pmem layer on the command line: %s", a)
	}
	if err := r.Start(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if out := guestRun(t, r, spec.ID, "dmesg | grep -c 'erofs: DAX enabled'; ls /bin/busybox"); !strings.HasPrefix(out, "1\n") {
		t.Fatalf("the layer is not mounted with DAX: %q", out)
	}
	fspec := runtime.Spec{ID: "pmem-fork", StateDir: t.TempDir(), Rootfs: spec.Rootfs, Resources: spec.Resources}
	if _, err := r.Fork(ctx, spec.ID, []runtime.Spec{fspec}); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), fspec.ID) }()
	if err := r.Start(ctx, fspec.ID); err != nil {
		t.Fatal(err)
	}
	fsb, _ := r.get(fspec.ID)
	if a := strings.Join(fsb.st.Args, " "); !strings.Contains(a, "size=") || strings.Contains(a, "readonly=on,share=off") || !strings.Contains(a, "share=on,readonly=on") {
		t.Fatalf("the fork's pmem backing is not the shared read-only file: %s", a)
	}
	if out := guestRun(t, r, fspec.ID, "ls /bin/busybox && busybox true && echo read"); !strings.HasSuffix(out, "read") {
		t.Fatalf("the fork cannot read its image: %q", out)
	}
}
