package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
)

func rootOnly(t testing.TB) {
	t.Helper()
	if os.Getenv("OPENDSEC_ROOT_TESTS") != "1" {
		t.Skip("OPENDSEC_ROOT_TESTS=1 runs the microvm backend's process tests (jails, uids, cgroups, netns)")
	}
	if os.Geteuid() != 0 {
		t.Fatal("OPENDSEC_ROOT_TESTS=1 needs root")
	}
}

var (
	standinOnce sync.Once
	standinDir  string
	standinErr  error
)

// standin builds fcfake/fcstandin (static: it runs inside the jail) as
// "firecracker" and "jailer" and returns their directory.
func standin(t *testing.T) string {
	t.Helper()
	standinOnce.Do(func() {
		standinDir, standinErr = os.MkdirTemp("", "fcstandin")
		if standinErr != nil {
			return
		}
		fc := filepath.Join(standinDir, "firecracker")
		cmd := exec.Command("go", "build", "-o", fc, "./fcfake/fcstandin")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			standinErr = fmt.Errorf("go build fcstandin: %v: %s", err, out)
			return
		}
		standinErr = os.Link(fc, filepath.Join(standinDir, "jailer"))
	})
	if standinErr != nil {
		t.Fatal(standinErr)
	}
	return standinDir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if standinDir != "" {
		_ = os.RemoveAll(standinDir)
	}
	os.Exit(code)
}

type standinEnv struct {
	r    *Runtime
	cfg  Config
	base string
	node string
}

// newStandin is the backend over the stand-in binaries, as on a host
// with hardware KVM; guest assets and a layer are small files (the
// stand-in only opens them).
func newStandin(t *testing.T) *standinEnv {
	t.Helper()
	rootOnly(t)
	bin := standin(t)
	base, err := os.MkdirTemp("", "fcj")
	if err != nil {
		t.Fatal(err)
	}
	guest := t.TempDir()
	for _, f := range []string{"vmlinux", "initrd.cpio"} {
		if err := os.WriteFile(filepath.Join(guest, f), []byte("stand-in "+f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cfg := Config{FirecrackerPath: filepath.Join(bin, "firecracker"), JailerPath: filepath.Join(bin, "jailer"), ChrootBase: base, GuestDir: guest}
	cfg.defaults()
	node := "t" + strconv.Itoa(os.Getpid())
	e := &standinEnv{cfg: cfg, base: base, node: node}
	e.r = e.instance()
	t.Cleanup(func() {
		if ents, _ := os.ReadDir(filepath.Join(base, "firecracker")); len(ents) != 0 {
			t.Errorf("left in the chroot base: %v", ents)
		}
		_ = unmountUnder(base)
		_ = os.RemoveAll(base)
		_ = removeCgroup(e.r.cgroupParent(), map[bool]int{true: 2, false: 1}[unified()])
	})
	return e
}

// instance is another backend instance of the same node (a node restart).
func (e *standinEnv) instance() *Runtime {
	r := New(e.cfg, runtime.Env{NodeID: e.node}, kvmprobe.Result{Accel: kvmprobe.AccelKVM, Kind: kvmprobe.KindHardware, Reason: "test"})
	r.agentWait = 10 * time.Second
	return r
}

func (e *standinEnv) spec(t *testing.T, id string) runtime.Spec {
	t.Helper()
	layer := filepath.Join(t.TempDir(), "l0.erofs")
	if err := os.WriteFile(layer, []byte("erofs layer"), 0o644); err != nil {
		t.Fatal(err)
	}
	return runtime.Spec{ID: id, StateDir: t.TempDir(),
		Rootfs:    runtime.Rootfs{Layers: []runtime.Layer{{Digest: "sha256:" + strings.Repeat("a", 64), Format: runtime.LayerEROFS, Path: layer}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 128, DiskMB: 16}}
}

// agentGet does GET path on the stand-in's agent through AgentConn.
func agentGet(t *testing.T, r *Runtime, id, path string) (int, []byte) {
	t.Helper()
	hc := r.agentHTTP(id)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent"+path, nil)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("agent GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

type standinInfo struct {
	UID      int    `json:"uid"`
	GID      int    `json:"gid"`
	Hostname string `json:"hostname"`
	Tap      string `json:"tap"`
	MemMiB   int64  `json:"mem_mib"`
}

func whoami(t *testing.T, r *Runtime, id string) standinInfo {
	t.Helper()
	code, b := agentGet(t, r, id, "/standin")
	var i standinInfo
	if code != http.StatusOK || json.Unmarshal(b, &i) != nil {
		t.Fatalf("GET /standin: %d %s", code, b)
	}
	return i
}

func procUID(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "Uid:" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	t.Fatal("no Uid in status")
	return -1
}

func ipNetns(t *testing.T) (nsPath string) {
	t.Helper()
	ns := "odfc" + strconv.Itoa(os.Getpid())
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	run("netns", "add", ns)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	run("-n", ns, "tuntap", "add", "tap0", "mode", "tap")
	return "/run/netns/" + ns
}

// TestStandinLifecycle: Create makes the jail (the assets and the layer
// hard links of the host's files, the disks the VM's uid's) and nothing
// runs; Start runs the jailer, which runs firecracker as that uid,
// chrooted, in the sandbox's netns and cgroup; the VM is configured and
// started through the API and the agent answers over vsock; pause and
// resume go through PATCH /vm; Stop sends Ctrl-Alt-Del and the VMM's
// exit reaches Wait through its pidfd; Delete leaves nothing.
func TestStandinLifecycle(t *testing.T) {
	e := newStandin(t)
	r := e.r
	ctx := context.Background()
	ns := ipNetns(t)
	spec := e.spec(t, "sb-life")
	mac, _ := net.ParseMAC("02:0d:5e:00:00:21")
	spec.Network = runtime.NetworkAttachment{Mode: runtime.NetworkTap, NetNS: ns, Device: "tap0", MAC: mac,
		GuestAddr: netip.MustParsePrefix("169.254.0.21/30"), Gateway: netip.MustParseAddr("169.254.0.22")}
	h, err := r.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(ctx, h.ID) }()
	root := e.cfg.Root("sb-life")
	sb, _ := r.get("sb-life")
	uid := sb.st.UID
	same := func(a, b string) bool {
		sa, err1 := os.Stat(a)
		sb, err2 := os.Stat(b)
		return err1 == nil && err2 == nil && os.SameFile(sa, sb)
	}
	if !same(filepath.Join(root, "vmlinux"), filepath.Join(e.cfg.GuestDir, "vmlinux")) || !same(filepath.Join(root, "layer0.erofs"), spec.Rootfs.Layers[0].Path) {
		t.Fatal("the kernel and the layer are not the host's files in the jail")
	}
	for _, f := range []string{"rw.img", "config.img"} {
		st, err := os.Stat(filepath.Join(root, f))
		if err != nil || st.Sys().(*syscall.Stat_t).Uid != uint32(uid) {
			t.Fatalf("%s: %v, want owned by %d", f, err, uid)
		}
	}
	if st, _ := r.Status(ctx, h.ID); st.State != runtime.StateCreated || st.Pid != 0 {
		t.Fatalf("after create: %+v", st)
	}
	if err := r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	st, _ := r.Status(ctx, h.ID)
	if st.State != runtime.StateRunning || st.Pid <= 0 {
		t.Fatalf("after start: %+v", st)
	}
	pid := st.Pid
	if got := procUID(t, pid); got != uid {
		t.Fatalf("firecracker runs as uid %d, want %d", got, uid)
	}
	if !same("/proc/"+strconv.Itoa(pid)+"/root", root) {
		t.Fatal("firecracker is not chrooted in its jail")
	}
	if !same("/proc/"+strconv.Itoa(pid)+"/ns/net", ns) {
		t.Fatal("firecracker is not in the sandbox's netns")
	}
	cg, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if !strings.Contains(string(cg), r.cgroupParent()+"/sb-life") {
		t.Fatalf("cgroup %s, want under %s", cg, r.cgroupParent())
	}
	limit := filepath.Join("/sys/fs/cgroup/memory", r.cgroupParent(), "sb-life", "memory.limit_in_bytes")
	if unified() {
		limit = filepath.Join("/sys/fs/cgroup", r.cgroupParent(), "sb-life", "memory.max")
	}
	if b, err := os.ReadFile(limit); err != nil || strings.TrimSpace(string(b)) != strconv.Itoa((128+MemoryOverheadMB)<<20) {
		t.Fatalf("memory limit %q %v", b, err)
	}
	if code, _ := agentGet(t, r, h.ID, "/health"); code != http.StatusNoContent {
		t.Fatalf("agent health %d", code)
	}
	if w := whoami(t, r, h.ID); w.UID != uid || w.Tap != "tap0" || w.MemMiB != 128 {
		t.Fatalf("the VMM says %+v", w)
	}
	if err := r.Pause(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	if st, _ := r.Status(ctx, h.ID); st.State != runtime.StatePaused {
		t.Fatalf("after pause: %+v", st)
	}
	if err := r.Resume(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	if st, _ := r.Status(ctx, h.ID); st.State != runtime.StateRunning {
		t.Fatalf("after resume: %+v", st)
	}
	if err := r.Stop(ctx, h.ID, runtime.StopOptions{Timeout: 10 * time.Second}); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ex, err := r.Wait(wctx, h.ID)
	if err != nil || ex.ExitCode != 0 || ex.Reason != "stopped" {
		t.Fatalf("wait after ctrl-alt-del: %+v %v (want exit 0: the guest powered off)", ex, err)
	}
	if err := r.Start(ctx, h.ID); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("start after stop: %v", err)
	}
	if err := r.Delete(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, r, "sb-life", spec.StateDir)
}

// assertGone checks Delete left no jail, cgroup, disk or run file.
func assertGone(t *testing.T, r *Runtime, jid, stateDir string) {
	t.Helper()
	if _, err := os.Stat(filepath.Dir(r.cfg.Root(jid))); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("jail left: %v", err)
	}
	for _, d := range []string{filepath.Join("/sys/fs/cgroup/memory", r.cgroupParent(), jid), filepath.Join("/sys/fs/cgroup/cpu", r.cgroupParent(), jid), filepath.Join("/sys/fs/cgroup", r.cgroupParent(), jid)} {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("cgroup left: %s", d)
		}
	}
	for _, f := range ownedFiles {
		if _, err := os.Stat(filepath.Join(stateDir, f)); err == nil {
			t.Errorf("left in the state dir: %s", f)
		}
	}
	if _, err := r.Status(context.Background(), jid); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("status after delete: %v", err)
	}
}

// TestStandinWaitSeesKill: kill -9 of firecracker reaches Wait (pidfd)
// within a second.
func TestStandinWaitSeesKill(t *testing.T) {
	e := newStandin(t)
	ctx := context.Background()
	spec := e.spec(t, "sb-kill")
	h, err := e.r.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = e.r.Delete(ctx, h.ID) }()
	if err := e.r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	st, _ := e.r.Status(ctx, h.ID)
	t0 := time.Now()
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	ex, err := e.r.Wait(wctx, h.ID)
	if err != nil || ex.Reason != "firecracker exited" || ex.ExitCode != -1 {
		t.Fatalf("wait: %+v %v", ex, err)
	}
	t.Logf("kill -9 to Wait: %s", time.Since(t0))
	if s, _ := e.r.Status(ctx, h.ID); s.State != runtime.StateStopped {
		t.Fatalf("status %+v", s)
	}
	if err := e.r.Delete(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, e.r, "sb-kill", spec.StateDir)
}

// TestStandinStartFailure: a boot the VMM refuses (its kernel gone from
// the jail) fails Start naming Firecracker's fault, kills the VMM, and
// Delete still leaves nothing.
func TestStandinStartFailure(t *testing.T) {
	e := newStandin(t)
	ctx := context.Background()
	spec := e.spec(t, "sb-fail")
	h, err := e.r.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(e.cfg.Root("sb-fail"), "vmlinux")); err != nil {
		t.Fatal(err)
	}
	err = e.r.Start(ctx, h.ID)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "kernel file cannot be opened") {
		t.Fatalf("start: %v", err)
	}
	if st, _ := e.r.Status(ctx, h.ID); st.State != runtime.StateStopped {
		t.Fatalf("after a failed start: %+v", st)
	}
	if pids := e.r.findVMM("sb-fail"); len(pids) != 0 {
		t.Fatalf("firecracker still runs: %v", pids)
	}
	if err := e.r.Delete(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, e.r, "sb-fail", spec.StateDir)
}

// TestStandinBadInputLeavesNothing: refused specs make no jail, disk or uid.
func TestStandinBadInputLeavesNothing(t *testing.T) {
	e := newStandin(t)
	ctx := context.Background()
	for _, c := range []struct {
		name string
		edit func(*runtime.Spec)
		want string
	}{
		{"zero memory", func(s *runtime.Spec) { s.Resources.MemoryMB = 0 }, "memory_mb"},
		{"more vcpus than the host", func(s *runtime.Spec) { s.Resources.CPU = 512 }, "resources.cpu"},
		{"missing layer", func(s *runtime.Spec) { s.Rootfs.Layers[0].Path = "/nonexistent/l.erofs" }, "l.erofs"},
		{"dir layer", func(s *runtime.Spec) { s.Rootfs.Layers[0].Format = runtime.LayerDir }, "rootfs.layers[0]"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := e.spec(t, "sb-bad")
			c.edit(&s)
			_, err := e.r.Create(ctx, s)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want %q", err, c.want)
			}
			if ents, _ := os.ReadDir(filepath.Join(e.base, "firecracker")); len(ents) != 0 {
				t.Fatalf("jail left: %v", ents)
			}
			for _, f := range ownedFiles {
				if _, err := os.Stat(filepath.Join(s.StateDir, f)); err == nil {
					t.Fatalf("left in the state dir: %s", f)
				}
			}
		})
	}
	if n := len(e.r.uids.used); n != 0 {
		t.Fatalf("%d uids still taken", n)
	}
	// A jail left by a sandbox of the same ID is refused and kept.
	left := filepath.Dir(e.cfg.Root("sb-bad"))
	if err := os.MkdirAll(left, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := e.r.Create(ctx, e.spec(t, "sb-bad")); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("create over a left jail: %v", err)
	}
	if _, err := os.Stat(left); err != nil {
		t.Fatalf("the left jail was removed: %v", err)
	}
	_ = os.RemoveAll(left)
}

// TestStandinRecover: a new backend instance (the node after kill -9)
// finds the running VMM from the run file, reaches its agent, sees its
// end through a pidfd, and deletes all of it.
func TestStandinRecover(t *testing.T) {
	e := newStandin(t)
	ctx := context.Background()
	spec := e.spec(t, "sb-rec")
	h, err := e.r.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	st, _ := e.r.Status(ctx, h.ID)
	r2 := e.instance()
	defer func() { _ = r2.Delete(ctx, h.ID) }()
	if err := r2.Recover(ctx, h); err != nil { // the Handle Create returned: no pid in it
		t.Fatal(err)
	}
	st2, err := r2.Status(ctx, h.ID)
	if err != nil || st2.State != runtime.StateRunning || st2.Pid != st.Pid {
		t.Fatalf("recovered status %+v %v, want running pid %d", st2, err, st.Pid)
	}
	if w := whoami(t, r2, h.ID); w.UID != e.r.sbs.Lookup(h.ID).st.UID {
		t.Fatalf("recovered agent says %+v", w)
	}
	if err := r2.Pause(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	if s, _ := r2.Status(ctx, h.ID); s.State != runtime.StatePaused {
		t.Fatalf("paused after recover: %+v", s)
	}
	// The uid stays taken in the new instance.
	if _, err := r2.uids.get(); err != nil {
		t.Fatal(err)
	}
	if r2.uids.used[e.r.sbs.Lookup(h.ID).st.UID] != true {
		t.Fatal("the recovered sandbox's uid is free in the new instance")
	}
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if ex, err := r2.Wait(wctx, h.ID); err != nil || ex.ExitCode != -1 {
		t.Fatalf("wait after recover: %+v %v", ex, err)
	}
	// A third instance finds it gone: Wait returns at once.
	r3 := e.instance()
	if err := r3.Recover(ctx, h); err != nil {
		t.Fatal(err)
	}
	wctx2, cancel2 := context.WithTimeout(ctx, time.Second)
	defer cancel2()
	if ex, err := r3.Wait(wctx2, h.ID); err != nil || !strings.Contains(ex.Reason, "gone") {
		t.Fatalf("wait of a gone vm: %+v %v", ex, err)
	}
	if err := r2.Delete(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, r2, "sb-rec", spec.StateDir)
}

// TestStandinDeleteUnknown: Delete by an instance that never recovered
// the sandbox (a node restart) still kills its firecracker and removes
// its jail and cgroup.
func TestStandinDeleteUnknown(t *testing.T) {
	e := newStandin(t)
	ctx := context.Background()
	spec := e.spec(t, "sb-unk")
	h, err := e.r.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	r2 := e.instance()
	if err := r2.Delete(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := e.r.Wait(wctx, h.ID); err != nil { // the first instance sees the end
		t.Fatal(err)
	}
	if pids := e.r.findVMM("sb-unk"); len(pids) != 0 {
		t.Fatalf("firecracker still runs: %v", pids)
	}
	if _, err := os.Stat(filepath.Dir(e.cfg.Root("sb-unk"))); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("jail left: %v", err)
	}
	if err := e.r.Delete(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
}

// TestStandinForkAndSnapshot: Fork pauses the source only while its
// state, memory and disks are written; each fork is a fresh jailed VMM
// (its own uid) that loads the snapshot with a File memory backend (the
// same inode in every fork's jail: shared pages), its own tap, and gets
// its own hostname; the source runs on. A snapshot is refused by a node
// of another accelerator kind and when truncated, before anything is made.
func TestStandinForkAndSnapshot(t *testing.T) {
	e := newStandin(t)
	ctx := context.Background()
	src := e.spec(t, "sb-src")
	h, err := e.r.Create(ctx, src)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = e.r.Delete(ctx, h.ID) }()
	if err := e.r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	specs := []runtime.Spec{e.spec(t, "sb-fork1"), e.spec(t, "sb-fork2")}
	for i := range specs {
		specs[i].Rootfs = src.Rootfs
	}
	res, err := e.r.Fork(ctx, h.ID, specs)
	if err != nil {
		t.Fatal(err)
	}
	uids := map[int]bool{e.r.sbs.Lookup(h.ID).st.UID: true}
	for _, f := range res {
		defer func() { _ = e.r.Delete(ctx, f.Handle.ID) }()
		if !f.MemoryPreserved || f.SourceFrozen <= 0 {
			t.Fatalf("fork result %+v", f)
		}
		if err := e.r.Start(ctx, f.Handle.ID); err != nil {
			t.Fatal(err)
		}
		w := whoami(t, e.r, f.Handle.ID)
		if w.Hostname != f.Handle.ID || uids[w.UID] || w.MemMiB != 128 {
			t.Fatalf("fork %s says %+v", f.Handle.ID, w)
		}
		uids[w.UID] = true
	}
	// Each fork's VMM maps the memory file private, reads all of it and
	// writes 256 pages: the pages it read are the page cache's, shared
	// by both forks; only the written ones are its own.
	for _, f := range res {
		st, _ := e.r.Status(ctx, f.Handle.ID)
		m := memMapping(t, st.Pid, filepath.Join(e.cfg.Root(f.Handle.ID), "snapshot", SnapshotMemFile)) // as the reader sees it
		t.Logf("fork %s guest memory: rss %d KiB, shared %d KiB, private %d KiB", f.Handle.ID, m["Rss"], m["Shared_Clean"]+m["Shared_Dirty"], m["Private_Clean"]+m["Private_Dirty"])
		if m["Private_Dirty"] != 256*4 || m["Shared_Clean"] < (128<<10)-256*4-64 {
			t.Fatalf("fork %s memory mapping %v: want 1024 KiB private dirty and the rest shared", f.Handle.ID, m)
		}
	}
	m1, _ := os.Stat(filepath.Join(e.cfg.Root("sb-fork1"), "snapshot", SnapshotMemFile))
	m2, _ := os.Stat(filepath.Join(e.cfg.Root("sb-fork2"), "snapshot", SnapshotMemFile))
	if m1 == nil || m2 == nil || !os.SameFile(m1, m2) {
		t.Fatal("the forks' memory files are not one inode")
	}
	if st, _ := e.r.Status(ctx, h.ID); st.State != runtime.StateRunning {
		t.Fatalf("source after fork: %+v", st)
	}
	t.Logf("source frozen %s", res[0].SourceFrozen)

	dir := t.TempDir()
	if _, err := e.r.Snapshot(ctx, h.ID, dir); err != nil {
		t.Fatal(err)
	}
	other := e.instance()
	other.accel = kvmprobe.Result{Accel: kvmprobe.AccelKVM, Kind: kvmprobe.KindPVM}
	s3 := e.spec(t, "sb-other")
	s3.Rootfs = src.Rootfs
	if _, err := other.Restore(ctx, s3, dir); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "accelerator") {
		t.Fatalf("restore under another accelerator kind: %v", err)
	}
	if err := os.Truncate(filepath.Join(dir, SnapshotMemFile), 4096); err == nil {
		if _, err := e.r.Restore(ctx, s3, dir); err == nil || !strings.Contains(err.Error(), "truncated") {
			t.Fatalf("restore of a truncated snapshot: %v", err)
		}
	} else {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Dir(e.cfg.Root("sb-other"))); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("a refused restore made a jail")
	}
	for _, f := range res {
		if err := e.r.Delete(ctx, f.Handle.ID); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.r.Delete(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, e.r, "sb-fork1", specs[0].StateDir)
	assertGone(t, e.r, "sb-src", src.StateDir)
}

// memMapping sums the /proc/<pid>/smaps fields (KiB) of the mappings of
// the file at path name (from this process's root).
func memMapping(t *testing.T, pid int, name string) map[string]int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			in = len(f) >= 6 && f[5] == name
			continue
		}
		if in && len(f) >= 2 && strings.HasSuffix(f[0], ":") {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			out[strings.TrimSuffix(f[0], ":")] += n
		}
	}
	if len(out) == 0 {
		t.Fatalf("pid %d has no mapping of %s", pid, name)
	}
	return out
}

// TestStandinSnapshotRefusesSymlink: a VMM that swaps its memory file
// for a symlink to a host file gets the snapshot refused, and the host
// file keeps its owner and mode (the node follows no link the VM made).
func TestStandinSnapshotRefusesSymlink(t *testing.T) {
	e := newStandin(t)
	ctx := context.Background()
	h, err := e.r.Create(ctx, e.spec(t, "sb-hostile"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = e.r.Delete(ctx, h.ID) }()
	if err := e.r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(t.TempDir(), "shadow")
	if err := os.WriteFile(secret, []byte("root secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.cfg.Root(h.ID), "hostile-snapshot"), []byte(secret), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if _, err := e.r.Snapshot(ctx, h.ID, dir); err == nil || !strings.Contains(err.Error(), "memory") {
		t.Fatalf("snapshot of a VMM that made its memory file a symlink: %v", err)
	}
	if fi, err := os.Stat(secret); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the host file the symlink named: %v %v", fi.Mode(), err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("left in the snapshot dir: %v", ents)
	}
	if st, _ := e.r.Status(ctx, h.ID); st.State != runtime.StateRunning {
		t.Fatalf("source after the refused snapshot: %+v", st)
	}
}
