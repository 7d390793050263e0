package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// TestRequestsMatchSchema marshals every typed request and checks it
// against the v1.16.1 schema; the negative rows prove the checker catches
// what Firecracker refuses.
func TestRequestsMatchSchema(t *testing.T) {
	good := []struct {
		s *schema
		v any
	}{
		{schemaMachineConfig, MachineConfig{VcpuCount: 2, MemSizeMib: 512}},
		{schemaMachineConfig, MachineConfig{VcpuCount: 1, MemSizeMib: 128, TrackDirtyPages: true, HugePages: "2M"}},
		{schemaBootSource, BootSource{KernelImagePath: "/vmlinux", InitrdPath: "/initrd.cpio", BootArgs: "console=ttyS0"}},
		{schemaBootSource, BootSource{KernelImagePath: "/vmlinux"}},
		{schemaDrive, Drive{DriveID: "layer0", PathOnHost: "/l.erofs", IsReadOnly: true}},
		{schemaDrive, Drive{DriveID: "rw", PathOnHost: "/rw.img", CacheType: "Unsafe", IOEngine: "Async"}},
		{schemaNetworkInterface, NetworkInterface{IfaceID: "eth0", HostDevName: "tap0", GuestMAC: "02:00:00:00:00:01"}},
		{schemaVsock, Vsock{GuestCID: GuestCID, UDSPath: "/run/vsock.sock"}},
		{schemaBalloon, Balloon{AmountMib: 0, DeflateOnOOM: true, StatsPollingIntervalS: 1}},
		{schemaLogger, Logger{LogPath: "/log", Level: "Warning", ShowLevel: true}},
		{schemaLogger, Logger{}},
		{schemaMetrics, Metrics{MetricsPath: "/metrics"}},
		{schemaAction, InstanceAction{ActionType: ActionInstanceStart}},
		{schemaAction, InstanceAction{ActionType: ActionSendCtrlAltDel}},
		{schemaVM, VM{State: VMPaused}},
		{schemaVM, VM{State: VMResumed}},
		{schemaSnapshotCreate, SnapshotCreate{SnapshotType: SnapshotFull, SnapshotPath: "/s", MemFilePath: "/m"}},
		{schemaSnapshotCreate, SnapshotCreate{SnapshotType: SnapshotDiff, SnapshotPath: "/s", MemFilePath: "/m"}},
		{schemaSnapshotLoad, SnapshotLoad{SnapshotPath: "/s", MemBackend: &MemoryBackend{BackendType: "File", BackendPath: "/m"}, ResumeVM: true,
			NetworkOverrides: []NetworkOverride{{IfaceID: "eth0", HostDevName: "tap1"}}}},
	}
	for _, g := range good {
		b, err := json.Marshal(g.v)
		if err != nil {
			t.Fatal(err)
		}
		if err := g.s.Check(b); err != nil {
			t.Errorf("%T %s: %v", g.v, b, err)
		}
	}
	bad := []struct {
		s    *schema
		body string
		want string
	}{
		{schemaMachineConfig, `{"mem_size_mib":128}`, "missing field `vcpu_count`"},
		{schemaMachineConfig, `{"vcpu_count":33,"mem_size_mib":128}`, "out of range"},
		{schemaMachineConfig, `{"vcpu_count":"2","mem_size_mib":128}`, "want an integer"},
		{schemaMachineConfig, `{"vcpu_count":1,"mem_size_mib":128,"huge_pages":"1G"}`, "not one of"},
		{schemaDrive, `{"drive_id":"x"}`, "missing field `is_root_device`"},
		{schemaVsock, `{"guest_cid":2,"uds_path":"/v"}`, "out of range"},
		{schemaAction, `{"action_type":"Reboot"}`, "not one of"},
		{schemaVM, `{"state":"Stopped"}`, "not one of"},
		{schemaSnapshotCreate, `{"snapshot_path":"/s","mem_file_path":"/m","snapshot_type":"Partial"}`, "not one of"},
		{schemaSnapshotLoad, `{"snapshot_path":"/s"}`, "exactly one"},
		{schemaSnapshotLoad, `{"snapshot_path":"/s","mem_backend":{"backend_type":"Shm","backend_path":"/m"}}`, "not one of"},
		{schemaSnapshotLoad, `{"snapshot_path":"/s","mem_file_path":"/m","network_overrides":[{"iface_id":"eth0"}]}`, "missing field `host_dev_name`"},
		{schemaMetrics, `{"metrics_path":"/m","flush":true}`, "unknown field"},
	}
	for _, b := range bad {
		err := b.s.Check([]byte(b.body))
		if err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("%s %s: got %v, want %q", b.s.Def, b.body, err, b.want)
		}
	}
}

func testPlan(t *testing.T) Plan {
	t.Helper()
	dir := t.TempDir()
	write := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	return Plan{VCPUs: 1, MemoryMB: 1, Kernel: write("vmlinux"), Initrd: write("initrd.cpio"), BootArgs: "console=ttyS0 quiet",
		Layers: []string{write("l0.erofs"), write("l1.erofs")}, Writable: write("rw.img"),
		Tap: "tap0", MAC: "02:fc:00:00:00:01", VsockPath: filepath.Join(dir, "v.sock"), LogPath: write("log"), Metrics: write("metrics"), BalloonMB: 1}
}

func TestBootSequence(t *testing.T) {
	ctx := context.Background()
	f := newFakeFC(t)
	c := f.client()
	if err := Boot(ctx, c, testPlan(t)); err != nil {
		t.Fatal(err)
	}
	want := []string{"PUT /logger", "PUT /metrics", "PUT /machine-config", "PUT /boot-source", "PUT /drives/layer0", "PUT /drives/layer1",
		"PUT /drives/rw", "PUT /network-interfaces/eth0", "PUT /vsock", "PUT /balloon", "PUT /actions"}
	if got := f.Calls(); !slices.Equal(got, want) {
		t.Fatalf("calls\n got %v\nwant %v", got, want)
	}
	info, err := c.InstanceInfo(ctx)
	if err != nil || info.State != "Running" {
		t.Fatalf("instance info %+v, %v; want Running", info, err)
	}
	mc, err := c.GetMachineConfig(ctx)
	if err != nil || mc.VcpuCount != 1 || mc.MemSizeMib != 1 {
		t.Fatalf("machine config %+v, %v", mc, err)
	}
	var d Drive
	_ = json.Unmarshal(f.body("PUT /drives/layer0"), &d)
	if !d.IsReadOnly || d.IsRootDevice {
		t.Fatalf("layer drive %+v: want read-only, not root", d)
	}
	// Pause and resume through PATCH /vm.
	for _, st := range []struct{ patch, want string }{{VMPaused, "Paused"}, {VMResumed, "Running"}} {
		if err := c.PatchVM(ctx, st.patch); err != nil {
			t.Fatal(err)
		}
		if info, _ := c.InstanceInfo(ctx); info.State != st.want {
			t.Fatalf("after %s: %s", st.patch, info.State)
		}
	}
	if err := c.Action(ctx, ActionSendCtrlAltDel); err != nil {
		t.Fatal(err)
	}
	// A pre-boot resource after boot is Firecracker's 400, a failed precondition.
	err = c.PutMachineConfig(ctx, MachineConfig{VcpuCount: 1, MemSizeMib: 256})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "not supported after starting") {
		t.Fatalf("machine config after boot: %v", err)
	}
}

func TestBootErrorsMapped(t *testing.T) {
	ctx := context.Background()
	t.Run("missing kernel", func(t *testing.T) {
		f := newFakeFC(t)
		p := testPlan(t)
		p.Kernel = "/nonexistent/vmlinux"
		err := Boot(ctx, f.client(), p)
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "kernel file cannot be opened") {
			t.Fatalf("got %v", err)
		}
		if slices.Contains(f.Calls(), "PUT /actions") {
			t.Fatal("started after a failed step")
		}
	})
	t.Run("zero memory reaches firecracker", func(t *testing.T) {
		f := newFakeFC(t)
		err := f.client().PutMachineConfig(ctx, MachineConfig{VcpuCount: 1, MemSizeMib: 0})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "memory size") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("start without kernel", func(t *testing.T) {
		f := newFakeFC(t)
		err := f.client().Action(ctx, ActionInstanceStart)
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "without kernel configuration") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("socket gone", func(t *testing.T) {
		err := NewClient(filepath.Join(t.TempDir(), "none.sock")).PatchVM(ctx, VMPaused)
		if !errors.Is(err, errdefs.ErrUnavailable) {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("pause before start", func(t *testing.T) {
		f := newFakeFC(t)
		err := f.client().PatchVM(ctx, VMPaused)
		if !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Fatalf("got %v", err)
		}
	})
}

func TestFaultCategory(t *testing.T) {
	for _, c := range []struct {
		status int
		msg    string
		want   error
	}{
		{400, "The requested operation is not supported after starting the microVM.", errdefs.ErrFailedPrecondition},
		{400, "Loading a microVM snapshot not allowed after configuring boot-specific resources.", errdefs.ErrFailedPrecondition},
		{400, "The kernel file cannot be opened: No such file or directory (os error 2)", errdefs.ErrInvalidArgument},
		{400, "An error occurred when deserializing the json body of a request: missing field `vcpu_count`.", errdefs.ErrInvalidArgument},
		{404, "", errdefs.ErrNotFound},
		{500, "Internal server error", errdefs.ErrInternal},
	} {
		raw, _ := json.Marshal(apiError{FaultMessage: c.msg})
		err := faultError("PUT", "/x", c.status, raw)
		if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%d %q: got %v, want %v", c.status, c.msg, err, c.want)
		}
	}
}

// TestSnapshotAndFork: create pauses, writes, resumes, and records the
// accelerator; four fresh VMMs each load it with a File memory backend,
// their own tap, and resume.
func TestSnapshotAndFork(t *testing.T) {
	ctx := context.Background()
	src := newFakeFC(t)
	p := testPlan(t)
	if err := Boot(ctx, src.client(), p); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	meta := SnapshotMeta{Accel: "hardware", MemoryMB: p.MemoryMB, VCPUs: p.VCPUs}
	if err := CreateSnapshot(ctx, src.client(), dir, "", meta, false); err != nil {
		t.Fatal(err)
	}
	calls := src.Calls()
	if got := calls[len(calls)-3:]; !slices.Equal(got, []string{"PATCH /vm", "PUT /snapshot/create", "PATCH /vm"}) {
		t.Fatalf("snapshot calls %v", got)
	}
	if info, _ := src.client().InstanceInfo(ctx); info.State != "Running" {
		t.Fatalf("source after snapshot: %s", info.State)
	}
	if _, err := CheckSnapshot(dir, "hardware"); err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		clone := newFakeFC(t)
		tap := "tap" + string(rune('1'+i))
		if err := Load(ctx, clone.client(), dir, tap); err != nil {
			t.Fatal(err)
		}
		var req SnapshotLoad
		if err := json.Unmarshal(clone.body("PUT /snapshot/load"), &req); err != nil {
			t.Fatal(err)
		}
		if req.MemBackend == nil || req.MemBackend.BackendType != "File" || !req.ResumeVM ||
			len(req.NetworkOverrides) != 1 || req.NetworkOverrides[0].HostDevName != tap {
			t.Fatalf("load request %+v", req)
		}
		if info, _ := clone.client().InstanceInfo(ctx); info.State != "Running" {
			t.Fatalf("clone %d: %s", i, info.State)
		}
	}
	// A configured VMM cannot load: Firecracker's message, a failed precondition.
	err := Load(ctx, src.client(), dir, "")
	if !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("load into a booted vm: %v", err)
	}
	// A failed create resumes the source.
	src.FailNext("PUT /snapshot/create", "Create snapshot error: Cannot write memory file: No space left on device (os error 28)")
	if err := CreateSnapshot(ctx, src.client(), t.TempDir(), "", meta, false); err == nil || !strings.Contains(err.Error(), "No space left") {
		t.Fatalf("failed create: %v", err)
	}
	if info, _ := src.client().InstanceInfo(ctx); info.State != "Running" {
		t.Fatalf("source after failed snapshot: %s", info.State)
	}
}

func TestCheckSnapshotRefuses(t *testing.T) {
	ctx := context.Background()
	make1 := func(t *testing.T) string {
		f := newFakeFC(t)
		if err := Boot(ctx, f.client(), testPlan(t)); err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		if err := CreateSnapshot(ctx, f.client(), dir, "", SnapshotMeta{Accel: "hardware", MemoryMB: 1, VCPUs: 1}, false); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	for _, c := range []struct {
		name  string
		spoil func(dir string) error
		accel string
		want  string
	}{
		{"truncated memory", func(d string) error { return os.Truncate(filepath.Join(d, SnapshotMemFile), 4096) }, "hardware", "truncated"},
		{"truncated state", func(d string) error { return os.Truncate(filepath.Join(d, SnapshotStateFile), 3) }, "hardware", "truncated"},
		{"corrupted state", func(d string) error {
			return os.WriteFile(filepath.Join(d, SnapshotStateFile), []byte("vmstate of a 9 vcpu vm"), 0o600)
		}, "hardware", "corrupted"},
		{"other accelerator", func(string) error { return nil }, "pvm", `made under accelerator "hardware" and this host is "pvm"`},
		{"no metadata", func(d string) error { return os.Remove(filepath.Join(d, SnapshotMetaFile)) }, "hardware", "incomplete"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := make1(t)
			if err := c.spoil(dir); err != nil {
				t.Fatal(err)
			}
			_, err := CheckSnapshot(dir, c.accel)
			if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want %q", err, c.want)
			}
		})
	}
}

func TestPlanBadInputLeavesNothing(t *testing.T) {
	base := t.TempDir()
	cfg := Config{ChrootBase: base}
	cfg.defaults()
	j := Jail{ID: "sb-1", UID: 900000, GID: 900000, CgroupVersion: 1}
	for _, c := range []struct {
		name  string
		edit  func(*Plan)
		field string
	}{
		{"zero memory", func(p *Plan) { p.MemoryMB = 0 }, "resources.memory_mb"},
		{"more vcpus than the host", func(p *Plan) { p.VCPUs = 3 }, "more than this host's 2"},
		{"more vcpus than firecracker", func(p *Plan) { p.VCPUs = 33 }, "Firecracker's 32"},
		{"missing kernel", func(p *Plan) { p.Kernel = "/nonexistent/vmlinux" }, "guest kernel"},
		{"missing initrd", func(p *Plan) { p.Initrd = "/nonexistent/initrd" }, "guest initrd"},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := testPlan(t)
			c.edit(&p)
			_, err := cfg.PrepareJail(context.Background(), j, p, 2)
			if err == nil || !strings.Contains(err.Error(), c.field) {
				t.Fatalf("got %v, want %q", err, c.field)
			}
			if ents, _ := os.ReadDir(base); len(ents) != 0 {
				t.Fatalf("left in the chroot base: %v", ents)
			}
		})
	}
	// A good plan makes the jail with its files; RemoveJail takes it all.
	in, err := cfg.PrepareJail(context.Background(), j, testPlan(t), 2)
	if err != nil {
		t.Fatal(err)
	}
	root := cfg.Root("sb-1")
	for _, f := range []string{in.Kernel, in.Initrd, in.Layers[0], in.Layers[1], in.Writable} {
		if _, err := os.Stat(filepath.Join(root, f)); err != nil {
			t.Fatal(err)
		}
	}
	if err := cfg.RemoveJail("sb-1"); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(filepath.Join(base, "firecracker")); len(ents) != 0 {
		t.Fatalf("left after RemoveJail: %v", ents)
	}
}

func TestJailerArgs(t *testing.T) {
	cfg := Config{}
	cfg.defaults()
	args, err := cfg.JailerArgs(Jail{ID: "sb-1", UID: 900001, GID: 900001, NetNS: "/run/netns/sb-1", CgroupVersion: 1, CPU: 0.5, MemoryMB: 640})
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Join(args, " ")
	want := "--id sb-1 --exec-file /usr/local/bin/firecracker --uid 900001 --gid 900001 --chroot-base-dir /srv/jailer --cgroup-version 1 " +
		"--netns /run/netns/sb-1 --cgroup cpu.cfs_period_us=100000 --cgroup cpu.cfs_quota_us=50000 --cgroup memory.limit_in_bytes=671088640 " +
		"-- --api-sock /run/firecracker.socket"
	if got != want {
		t.Fatalf("args\n got %s\nwant %s", got, want)
	}
	args, _ = cfg.JailerArgs(Jail{ID: "sb-2", UID: 1, GID: 1, CgroupVersion: 2, CPU: 2, MemoryMB: 1})
	if got := strings.Join(args, " "); !strings.Contains(got, "--cgroup cpu.max=200000 100000 --cgroup memory.max=1048576") || strings.Contains(got, "--netns") {
		t.Fatalf("v2 args %s", got)
	}
	if _, err := cfg.JailerArgs(Jail{ID: "../x", CgroupVersion: 1}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bad id: %v", err)
	}
	if cfg.Root("sb-1") != "/srv/jailer/firecracker/sb-1/root" {
		t.Fatal(cfg.Root("sb-1"))
	}
}

func TestUIDs(t *testing.T) {
	u := newUIDs(900000, 2)
	a, _ := u.get()
	b, _ := u.get()
	if a == b {
		t.Fatal("same uid twice")
	}
	if _, err := u.get(); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("exhausted: %v", err)
	}
	u.put(a)
	if c, err := u.get(); err != nil || c != a {
		t.Fatalf("reuse: %d %v", c, err)
	}
}

func TestConfig(t *testing.T) {
	for _, c := range []struct{ raw, want string }{
		{`{"firecracker_path":"firecracker"}`, "node.backends.microvm.firecracker_path"},
		{`{"uid_start":10}`, "node.backends.microvm.uid_start"},
		{`{"firecracker":"/x"}`, "unknown field"},
	} {
		if _, err := parseConfig(json.RawMessage(c.raw)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want %q", c.raw, err, c.want)
		}
	}
	if _, err := parseConfig(json.RawMessage(`{}`)); err != nil {
		t.Fatal(err)
	}
}

// TestDialVsock runs the host side of Firecracker's vsock handshake
// against a unix listener that answers like Firecracker.
func TestDialVsock(t *testing.T) {
	dir, _ := os.MkdirTemp("", "vs")
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	sock := filepath.Join(dir, "v.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				line, _ := br.ReadString('\n')
				if line != "CONNECT 1024\n" {
					return // Firecracker closes on a port nobody listens on
				}
				_, _ = io.WriteString(c, "OK 1073741824\nhello")
				_, _ = io.Copy(c, br)
			}()
		}
	}()
	ctx := context.Background()
	c, err := DialVsock(ctx, sock, AgentVsockPort)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "hello" {
		t.Fatalf("first bytes %q %v", buf, err)
	}
	if _, err := io.WriteString(c, "ping"); err != nil {
		t.Fatal(err)
	}
	buf = make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo %q %v", buf, err)
	}
	_ = c.Close()
	if _, err := DialVsock(ctx, sock, 9); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("closed port: %v", err)
	}
	if _, err := DialVsock(ctx, filepath.Join(dir, "none"), 1); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("no socket: %v", err)
	}
}

func TestPlanFor(t *testing.T) {
	cfg := Config{GuestDir: "/g"}
	mac, _ := net.ParseMAC("02:fc:00:00:00:01")
	spec := runtime.Spec{Resources: runtime.Resources{CPU: 1.5, MemoryMB: 512},
		Rootfs:  runtime.Rootfs{Layers: []runtime.Layer{{Format: runtime.LayerEROFS, Path: "/l0"}}},
		Network: runtime.NetworkAttachment{Mode: runtime.NetworkTap, Device: "tap0", MAC: mac}}
	p, err := cfg.PlanFor(spec, "/rw")
	if err != nil {
		t.Fatal(err)
	}
	if p.VCPUs != 2 || p.MemoryMB != 512 || p.Kernel != "/g/vmlinux" || p.Initrd != "/g/initrd.cpio" ||
		!slices.Equal(p.Layers, []string{"/l0"}) || p.Tap != "tap0" || p.MAC != "02:fc:00:00:00:01" || p.Writable != "/rw" {
		t.Fatalf("plan %+v", p)
	}
	spec.Rootfs.Layers[0].Format = runtime.LayerDir
	if _, err := cfg.PlanFor(spec, ""); err == nil || !strings.Contains(err.Error(), "rootfs.layers[0]") {
		t.Fatalf("dir layer: %v", err)
	}
	spec.Rootfs.Layers = nil
	spec.Network.Mode = runtime.NetworkVeth
	if _, err := cfg.PlanFor(spec, ""); err == nil || !strings.Contains(err.Error(), "network.mode") {
		t.Fatalf("veth: %v", err)
	}
	spec.Network = runtime.NetworkAttachment{}
	spec.Resources.MemoryMB = 0
	p, err = cfg.PlanFor(spec, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Validate(2); err == nil || !strings.Contains(err.Error(), "resources.memory_mb") {
		t.Fatalf("0 MiB: %v", err)
	}
}
