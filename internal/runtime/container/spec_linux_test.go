package container

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/interpreter"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

func testSpec() runtime.Spec {
	return runtime.Spec{
		ID:        "sb1",
		Rootfs:    runtime.Rootfs{Image: "test/img", Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: "/layers/a"}}},
		Guest:     runtime.Guest{Env: []string{"LANG=C.UTF-8", "FOO=bar"}, User: "user", Workdir: "/home/user"},
		StateDir:  "/var/lib/opendsec/sb1",
		Resources: runtime.Resources{CPU: 1.5, MemoryMB: 256, PidsLimit: 100},
		Labels:    map[string]string{"task": "t1"},
	}
}

// testConfig is a backend config as New leaves it (defaults set), with
// the agent at /opt/opendsec-agent and no init_path.
func testConfig() *Config {
	idle := int64(30000)
	c := &Config{AgentPath: "/opt/opendsec-agent", AgentIdleExitMS: &idle}
	c.setDefaults()
	return c
}

func TestOCISpecHardening(t *testing.T) {
	sp, err := ociSpec(testConfig(), testSpec(), "/opendsec/sb1")
	if err != nil {
		t.Fatal(err)
	}
	p := sp.Process
	if !p.NoNewPrivileges {
		t.Error("noNewPrivileges is off")
	}
	for _, set := range [][]string{p.Capabilities.Bounding, p.Capabilities.Effective, p.Capabilities.Permitted} {
		if !slices.Equal(set, defaultCaps) {
			t.Errorf("capability set %v, want Docker's default %v", set, defaultCaps)
		}
		for _, c := range []string{"CAP_SYS_ADMIN", "CAP_SYS_MODULE", "CAP_SYS_PTRACE", "CAP_NET_ADMIN", "CAP_SYS_RESOURCE", "CAP_DAC_READ_SEARCH"} {
			if slices.Contains(set, c) {
				t.Errorf("%s granted", c)
			}
		}
	}
	if len(p.Capabilities.Inheritable) != 0 || len(p.Capabilities.Ambient) != 0 {
		t.Errorf("inheritable/ambient caps granted: %v %v", p.Capabilities.Inheritable, p.Capabilities.Ambient)
	}
	var ns []specs.LinuxNamespaceType
	for _, n := range sp.Linux.Namespaces {
		if n.Path != "" {
			t.Errorf("namespace %s joins %s instead of a fresh one", n.Type, n.Path)
		}
		ns = append(ns, n.Type)
	}
	for _, want := range []specs.LinuxNamespaceType{specs.PIDNamespace, specs.MountNamespace, specs.UTSNamespace, specs.IPCNamespace, specs.NetworkNamespace} {
		if !slices.Contains(ns, want) {
			t.Errorf("namespace %s missing", want)
		}
	}
	for _, m := range []string{"/proc/kcore", "/proc/kpagecgroup", "/proc/keys", "/sys/firmware"} {
		if !slices.Contains(sp.Linux.MaskedPaths, m) {
			t.Errorf("%s not masked", m)
		}
	}
	if !slices.Contains(sp.Linux.ReadonlyPaths, "/proc/sysrq-trigger") || !slices.Contains(sp.Linux.ReadonlyPaths, "/proc/sys") {
		t.Errorf("readonly paths %v", sp.Linux.ReadonlyPaths)
	}
	r := sp.Linux.Resources
	if *r.Memory.Limit != 256<<20 || *r.Memory.Swap != *r.Memory.Limit {
		t.Errorf("memory %d swap %d, want both %d", *r.Memory.Limit, *r.Memory.Swap, 256<<20)
	}
	// No period: the kernel's default, 100000 µs (TestCPULimitInCgroup).
	if *r.CPU.Quota != 150000 || r.CPU.Period != nil {
		t.Errorf("cpu quota %d period %v, want 150000 and none", *r.CPU.Quota, r.CPU.Period)
	}
	if r.Pids.Limit != 100 {
		t.Errorf("pids %d", r.Pids.Limit)
	}
	if sp.Annotations["org.opendsec.label.task"] != "t1" || sp.Annotations["org.opendsec.sandbox.id"] != "sb1" {
		t.Errorf("annotations %v", sp.Annotations)
	}
	if sp.Linux.CgroupsPath != "/opendsec/sb1" || sp.Hostname != "sb1" {
		t.Errorf("cgroupsPath %q hostname %q", sp.Linux.CgroupsPath, sp.Hostname)
	}

	var agent, init, sys *specs.Mount
	for i, m := range sp.Mounts {
		switch m.Destination {
		case agentInSandbox:
			agent = &sp.Mounts[i]
		case initInSandbox:
			init = &sp.Mounts[i]
		case "/sys":
			sys = &sp.Mounts[i]
		}
	}
	if agent == nil || agent.Source != "/opt/opendsec-agent" || !slices.Contains(agent.Options, "ro") || !slices.Contains(agent.Options, "nosuid") {
		t.Errorf("agent mount %+v, want read-only nosuid bind of the agent", agent)
	}
	// No InitPath: opendsec-init next to the agent.
	if init == nil || init.Source != "/opt/opendsec-init" || !slices.Contains(init.Options, "ro") || !slices.Contains(init.Options, "nosuid") {
		t.Errorf("init mount %+v, want read-only nosuid bind of /opt/opendsec-init", init)
	}
	if sys == nil || !slices.Contains(sys.Options, "ro") {
		t.Errorf("sysfs mount %+v, want read-only", sys)
	}
	wantArgs := []string{initInSandbox, "--seccomp-filter", seccompInSandbox, "--listen-fd", "3", "--env-file", "/run/opendsec/agent.env",
		"--", agentInSandbox, "--default-user", "user", "--default-workdir", "/home/user", "--idle-exit", "30s"}
	if !slices.Equal(p.Args, wantArgs) {
		t.Errorf("args %v, want %v", p.Args, wantArgs)
	}
	if len(p.Env) < 2 || !slices.Contains(p.Env, "FOO=bar") || !slices.Contains(p.Env, "LANG=C.UTF-8") || !strings.HasPrefix(p.Env[0], "PATH=") {
		t.Errorf("env %v: want the PATH default, then the guest env", p.Env)
	}
}

// TestOCISpecAgentIdleExit: the config's agent_idle_exit_ms reaches init's
// --idle-exit: absent is the 30 s default, 0 is no flag (never exit).
func TestOCISpecAgentIdleExit(t *testing.T) {
	for _, c := range []struct {
		name string
		ms   *int64
		want string // "" means no --idle-exit
	}{
		{"default", nil, DefaultAgentIdleExit.String()},
		{"never", new(int64), ""},
		{"1500ms", func() *int64 { v := int64(1500); return &v }(), "1.5s"},
	} {
		cfg := testConfig()
		cfg.AgentIdleExitMS = c.ms
		sp, err := ociSpec(cfg, testSpec(), "/opendsec/sb1")
		if err != nil {
			t.Fatal(err)
		}
		got := ""
		if i := slices.Index(sp.Process.Args, "--idle-exit"); i >= 0 && i+1 < len(sp.Process.Args) {
			got = sp.Process.Args[i+1]
		}
		if got != c.want {
			t.Errorf("%s: --idle-exit %q, want %q (args %v)", c.name, got, c.want, sp.Process.Args)
		}
	}
}

// TestOCISpecSeccomp: runc gets no profile; init gets the compiled one,
// read-only, as its first flag.
func TestOCISpecSeccomp(t *testing.T) {
	sp, err := ociSpec(testConfig(), testSpec(), "/opendsec/sb1")
	if err != nil {
		t.Fatal(err)
	}
	if sp.Linux.Seccomp != nil {
		t.Errorf("config.json has a seccomp profile: runc would compile it on every create")
	}
	if len(sp.Process.Args) < 3 || sp.Process.Args[1] != "--seccomp-filter" || sp.Process.Args[2] != seccompInSandbox {
		t.Errorf("init args %v do not start with --seccomp-filter %s", sp.Process.Args, seccompInSandbox)
	}
	var m *specs.Mount
	for i := range sp.Mounts {
		if sp.Mounts[i].Destination == seccompInSandbox {
			m = &sp.Mounts[i]
		}
	}
	if m == nil || m.Source != filepath.Join(testSpec().StateDir, seccompFile) || !slices.Contains(m.Options, "ro") {
		t.Errorf("seccomp filter mount %+v, want a read-only bind of the state dir's %s", m, seccompFile)
	}
}

// seccompRun runs the compiled filter in x/net/bpf's VM on one syscall.
// The VM loads words big-endian where the kernel loads them native-endian,
// so seccomp_data is laid out word by word in big-endian here.
func seccompRun(t *testing.T, vm *bpf.VM, auditArch uint32, nr int, args ...uint64) uint32 {
	t.Helper()
	data := make([]byte, 64)
	binary.BigEndian.PutUint32(data[0:], uint32(nr))
	binary.BigEndian.PutUint32(data[4:], auditArch)
	for i, a := range args {
		binary.BigEndian.PutUint32(data[16+8*i:], uint32(a))     // low word first (little endian)
		binary.BigEndian.PutUint32(data[20+8*i:], uint32(a>>32)) // then the high word
	}
	ret, err := vm.Run(data)
	if err != nil {
		t.Fatalf("run filter: %v", err)
	}
	return uint32(ret)
}

// TestCompileSeccomp executes the filter the agent installs: Docker's
// default profile, default deny (EPERM), with its argument rules.
func TestCompileSeccomp(t *testing.T) {
	if goruntime.GOARCH != "amd64" {
		t.Skip("syscall numbers below are x86_64's")
	}
	prof, err := defaultSeccompProfile()
	if err != nil {
		t.Fatal(err)
	}
	b, err := compileSeccomp(prof)
	if err != nil {
		t.Fatal(err)
	}
	raw := make([]bpf.RawInstruction, len(b)/8)
	for i := range raw {
		raw[i] = bpf.RawInstruction{Op: binary.LittleEndian.Uint16(b[8*i:]), Jt: b[8*i+2], Jf: b[8*i+3], K: binary.LittleEndian.Uint32(b[8*i+4:])}
	}
	insts, ok := bpf.Disassemble(raw)
	if !ok {
		t.Fatalf("filter does not disassemble")
	}
	vm, err := bpf.NewVM(insts)
	if err != nil {
		t.Fatal(err)
	}
	const (
		allow   = unix.SECCOMP_RET_ALLOW
		eperm   = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
		enosys  = unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)
		x86_64  = unix.AUDIT_ARCH_X86_64
		i386    = unix.AUDIT_ARCH_I386
		x32Bit  = 0x40000000
		afVsock = 40
	)
	cases := []struct {
		name string
		arch uint32
		nr   int
		args []uint64
		want uint32
	}{
		{"read", x86_64, unix.SYS_READ, nil, allow},
		{"write", x86_64, unix.SYS_WRITE, nil, allow},
		{"execve", x86_64, unix.SYS_EXECVE, nil, allow},
		{"openat", x86_64, unix.SYS_OPENAT, nil, allow},
		{"wait4", x86_64, unix.SYS_WAIT4, nil, allow},
		{"clone thread", x86_64, unix.SYS_CLONE, []uint64{unix.CLONE_VM | unix.CLONE_THREAD | unix.CLONE_SIGHAND}, allow},
		{"clone newuser", x86_64, unix.SYS_CLONE, []uint64{unix.CLONE_NEWUSER | uint64(unix.SIGCHLD)}, eperm},
		{"clone newns", x86_64, unix.SYS_CLONE, []uint64{unix.CLONE_NEWNS}, eperm},
		{"clone3", x86_64, unix.SYS_CLONE3, nil, enosys},
		{"socket inet", x86_64, unix.SYS_SOCKET, []uint64{unix.AF_INET}, allow},
		{"socket vsock", x86_64, unix.SYS_SOCKET, []uint64{afVsock}, eperm},
		{"socket vsock high bits", x86_64, unix.SYS_SOCKET, []uint64{1<<32 | afVsock}, allow},
		{"personality 0", x86_64, unix.SYS_PERSONALITY, []uint64{0}, allow},
		{"personality other", x86_64, unix.SYS_PERSONALITY, []uint64{0x0400000}, eperm},
		{"mount", x86_64, unix.SYS_MOUNT, nil, eperm},
		{"umount2", x86_64, unix.SYS_UMOUNT2, nil, eperm},
		{"unshare", x86_64, unix.SYS_UNSHARE, nil, eperm},
		{"setns", x86_64, unix.SYS_SETNS, nil, eperm},
		{"keyctl", x86_64, unix.SYS_KEYCTL, nil, eperm},
		{"add_key", x86_64, unix.SYS_ADD_KEY, nil, eperm},
		{"init_module", x86_64, unix.SYS_INIT_MODULE, nil, eperm},
		{"finit_module", x86_64, unix.SYS_FINIT_MODULE, nil, eperm},
		{"kexec_load", x86_64, unix.SYS_KEXEC_LOAD, nil, eperm},
		{"bpf", x86_64, unix.SYS_BPF, nil, eperm},
		{"perf_event_open", x86_64, unix.SYS_PERF_EVENT_OPEN, nil, eperm},
		{"pivot_root", x86_64, unix.SYS_PIVOT_ROOT, nil, eperm},
		{"open_by_handle_at", x86_64, unix.SYS_OPEN_BY_HANDLE_AT, nil, eperm},
		{"reboot", x86_64, unix.SYS_REBOOT, nil, eperm},
		{"unknown number", x86_64, 999, nil, eperm},
		{"x32 read", x86_64, x32Bit | unix.SYS_READ, nil, enosys},
		{"i386 getpid", i386, 20, nil, eperm},
	}
	for _, c := range cases {
		if got := seccompRun(t, vm, c.arch, c.nr, c.args...); got != c.want {
			t.Errorf("%s: filter returns %#x, want %#x", c.name, got, c.want)
		}
	}
}

func TestValidateSpec(t *testing.T) {
	dir := t.TempDir()
	layer := filepath.Join(dir, "layer")
	file := filepath.Join(dir, "file")
	if err := os.Mkdir(layer, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	good := testSpec()
	good.Rootfs.Layers = []runtime.Layer{{Format: runtime.LayerDir, Path: layer}}
	if err := validateSpec(good, 4096); err != nil {
		t.Fatalf("good spec: %v", err)
	}
	veth := good
	veth.Network = runtime.NetworkAttachment{Mode: runtime.NetworkVeth, NetNS: "/run/netns/x", Device: "eth0"}
	veth.Guest.Nameservers = []string{"100.96.0.1", "fd00::1"}
	if err := validateSpec(veth, 4096); err != nil {
		t.Fatalf("good spec with a veth: %v", err)
	}
	dirLayer := func(p string) runtime.Layer { return runtime.Layer{Format: runtime.LayerDir, Path: p} }
	cases := []struct {
		field  string
		mutate func(*runtime.Spec)
	}{
		{"id", func(s *runtime.Spec) { s.ID = "" }},
		{"id", func(s *runtime.Spec) { s.ID = "../etc" }},
		{"rootfs.layers", func(s *runtime.Spec) { s.Rootfs.Layers = nil }},
		{"rootfs.layers[0]", func(s *runtime.Spec) { s.Rootfs.Layers = []runtime.Layer{dirLayer(dir + "/x:y")} }},
		{"rootfs.layers[0]", func(s *runtime.Spec) { s.Rootfs.Layers = []runtime.Layer{dirLayer("relative/layer")} }},
		{"rootfs.layers[1]", func(s *runtime.Spec) { s.Rootfs.Layers = []runtime.Layer{dirLayer(layer), dirLayer(file)} }},
		{"rootfs.layers[0]", func(s *runtime.Spec) { s.Rootfs.Layers = []runtime.Layer{{Format: runtime.LayerEROFS, Path: layer}} }},
		{"rootfs.layers[0]", func(s *runtime.Spec) { s.Rootfs.Layers = []runtime.Layer{{Format: "squashfs", Path: layer}} }},
		{"rootfs.mounter", func(s *runtime.Spec) { s.Rootfs.Layers = []runtime.Layer{{Format: runtime.LayerEROFS, Path: file}} }},
		{"state_dir", func(s *runtime.Spec) { s.StateDir = "rel" }},
		{"state_dir", func(s *runtime.Spec) { s.StateDir = "" }},
		{"resources.memory_mb", func(s *runtime.Spec) { s.Resources.MemoryMB = 0 }},
		{"resources.cpu", func(s *runtime.Spec) { s.Resources.CPU = 0 }},
		{"resources.cpu", func(s *runtime.Spec) { s.Resources.CPU = 0.001 }},
		{"resources.memory_mb", func(s *runtime.Spec) { s.Resources.MemoryMB = 4 }},
		{"resources.pids_limit", func(s *runtime.Spec) { s.Resources.PidsLimit = 3 }},
		{"resources.pids_limit", func(s *runtime.Spec) { s.Resources.PidsLimit = -1 }},
		{"resources.pids_limit", func(s *runtime.Spec) { s.Resources.PidsLimit = 4097 }},
		{"resources.pids_limit", func(s *runtime.Spec) { s.Resources.PidsLimit = 10_000_000 }},
		{"guest.env", func(s *runtime.Spec) { s.Guest.Env = []string{"=x"} }},
		{"guest.env", func(s *runtime.Spec) { s.Guest.Env = []string{"NOEQUALS"} }},
		{"guest.hostname", func(s *runtime.Spec) { s.Guest.Hostname = strings.Repeat("h", 65) }},
		{"guest.nameservers[1]", func(s *runtime.Spec) { s.Guest.Nameservers = []string{"1.1.1.1", "dns.example"} }},
		{"network.mode", func(s *runtime.Spec) { s.Network = runtime.NetworkAttachment{NetNS: "/run/netns/x"} }},
		{"network.mode", func(s *runtime.Spec) {
			s.Network = runtime.NetworkAttachment{Mode: runtime.NetworkTap, NetNS: "/run/netns/x"}
		}},
		{"network.netns", func(s *runtime.Spec) {
			s.Network = runtime.NetworkAttachment{Mode: runtime.NetworkVeth, NetNS: "rel/ns"}
		}},
		{"network.netns", func(s *runtime.Spec) { s.Network = runtime.NetworkAttachment{Mode: runtime.NetworkVeth} }},
	}
	for _, c := range cases {
		s := good
		c.mutate(&s)
		err := validateSpec(s, 4096)
		var fe *errdefs.FieldError
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !errors.As(err, &fe) || fe.Field != c.field {
			t.Errorf("%s: err = %v, want an invalid argument naming %s", c.field, err, c.field)
		}
	}
}

// TestNewValidatesConfig: the agent and init binaries, the idle exit and
// the paths of the config are checked by New, which names the config field
// (before it looks for runc or root, so this runs unprivileged).
func TestNewValidatesConfig(t *testing.T) {
	dir := t.TempDir()
	agent := filepath.Join(dir, "opendsec-agent")
	for _, p := range []string{agent, filepath.Join(dir, InitBinaryName)} {
		if err := os.WriteFile(p, []byte("x"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	noExec := filepath.Join(dir, "noexec")
	if err := os.WriteFile(noExec, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	// An agent with no opendsec-init beside it.
	loneDir := filepath.Join(dir, "lone")
	if err := os.Mkdir(loneDir, 0o755); err != nil {
		t.Fatal(err)
	}
	lone := filepath.Join(loneDir, "opendsec-agent")
	if err := os.WriteFile(lone, []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "runc")

	good := Config{StateRoot: root, AgentPath: agent}
	good.setDefaults()
	if err := good.validate(); err != nil {
		t.Fatalf("good config: %v", err)
	}
	if good.InitPath != filepath.Join(dir, InitBinaryName) {
		t.Fatalf("default init_path = %q, want opendsec-init next to the agent", good.InitPath)
	}
	neg := int64(-1)
	cases := []struct {
		field string
		cfg   Config
	}{
		{"container.agent_path", Config{StateRoot: root}},
		{"container.agent_path", Config{StateRoot: root, AgentPath: "rel/opendsec-agent"}},
		{"container.agent_path", Config{StateRoot: root, AgentPath: dir}},
		{"container.agent_path", Config{StateRoot: root, AgentPath: filepath.Join(dir, "missing")}},
		{"container.agent_path", Config{StateRoot: root, AgentPath: noExec, InitPath: agent}},
		{"container.init_path", Config{StateRoot: root, AgentPath: agent, InitPath: "rel/opendsec-init"}},
		{"container.init_path", Config{StateRoot: root, AgentPath: agent, InitPath: dir}},
		{"container.init_path", Config{StateRoot: root, AgentPath: agent, InitPath: noExec}},
		{"container.init_path", Config{StateRoot: root, AgentPath: lone}},
		{"container.agent_idle_exit_ms", Config{StateRoot: root, AgentPath: agent, AgentIdleExitMS: &neg}},
		{"container.oci_runtime", Config{StateRoot: root, AgentPath: agent, OCIRuntime: "youki"}},
		{"container.oci_runtime", Config{StateRoot: root, AgentPath: agent, OCIRuntime: "CRUN"}},
		{"container.state_root", Config{StateRoot: "rel/runc", AgentPath: agent}},
		{"container.cgroup_parent", Config{StateRoot: root, AgentPath: agent, CgroupParent: "opendsec"}},
		{"node.max_pids_limit", Config{StateRoot: root, AgentPath: agent, MaxPidsLimit: 10_000_000}},
		{"node.max_pids_limit", Config{StateRoot: root, AgentPath: agent, MaxPidsLimit: 8}},
		{"node.total_pids_limit", Config{StateRoot: root, AgentPath: agent, MaxPidsLimit: 4096, TotalPidsLimit: 100}},
		{"node.total_pids_limit", Config{StateRoot: root, AgentPath: agent, TotalPidsLimit: -1}},
		{"node.nofile_limit", Config{StateRoot: root, AgentPath: agent, NofileLimit: 10}},
		{"node.nofile_limit", Config{StateRoot: root, AgentPath: agent, NofileLimit: 1 << 30}},
	}
	for _, c := range cases {
		rt, err := New(c.cfg)
		var fe *errdefs.FieldError
		if rt != nil || !errors.Is(err, errdefs.ErrInvalidArgument) || !errors.As(err, &fe) || fe.Field != c.field {
			t.Errorf("%+v: New = %v, %v; want an invalid argument naming %s", c.cfg, rt, err, c.field)
		}
	}
	if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused config made the state root: %v", err)
	}
}

// TestSecurityPidsLimitNofileInSpec: every sandbox process gets the
// node's nofile_limit as soft and hard RLIMIT_NOFILE, whatever the node's
// own limit (New refuses one runc could not give).
func TestSecurityPidsLimitNofileInSpec(t *testing.T) {
	for _, n := range []int64{0, 2000} {
		cfg := testConfig()
		cfg.NofileLimit = n
		cfg.setDefaults()
		sp, err := ociSpec(cfg, testSpec(), "/opendsec/sb1")
		if err != nil {
			t.Fatal(err)
		}
		want := uint64(sandboxspec.DefaultNofileLimit)
		if n != 0 {
			want = uint64(n)
		}
		rl := sp.Process.Rlimits
		if len(rl) != 1 || rl[0].Type != "RLIMIT_NOFILE" || rl[0].Soft != want || rl[0].Hard != want {
			t.Errorf("nofile_limit %d: rlimits %+v, want RLIMIT_NOFILE %d soft and hard", n, rl, want)
		}
	}
}

func TestOCISpecNetwork(t *testing.T) {
	sp, err := ociSpec(testConfig(), testSpec(), "/opendsec/sb1")
	if err != nil {
		t.Fatal(err)
	}
	for _, ns := range sp.Linux.Namespaces {
		if ns.Type == specs.NetworkNamespace && ns.Path != "" {
			t.Errorf("no NetNS: network namespace joins %q, want a new one", ns.Path)
		}
	}
	for _, m := range sp.Mounts {
		if m.Destination == "/etc/resolv.conf" {
			t.Error("no nameservers: /etc/resolv.conf is mounted")
		}
	}

	s := testSpec()
	s.Network = runtime.NetworkAttachment{Mode: runtime.NetworkVeth, NetNS: "/run/opendsec/netns/sb1", Device: "eth0"}
	s.Guest.Nameservers = []string{"100.96.0.1"}
	sp, err = ociSpec(testConfig(), s, "/opendsec/sb1")
	if err != nil {
		t.Fatal(err)
	}
	var joined bool
	for _, ns := range sp.Linux.Namespaces {
		if ns.Type == specs.NetworkNamespace {
			joined = ns.Path == s.Network.NetNS
		}
	}
	if !joined {
		t.Errorf("network namespace does not join %s: %+v", s.Network.NetNS, sp.Linux.Namespaces)
	}
	i := slices.IndexFunc(sp.Mounts, func(m specs.Mount) bool { return m.Destination == "/etc/resolv.conf" })
	if i < 0 {
		t.Fatal("/etc/resolv.conf is not mounted")
	}
	if m := sp.Mounts[i]; m.Source != filepath.Join(s.StateDir, resolvFile) || !slices.Contains(m.Options, "ro") {
		t.Errorf("resolv.conf mount = %+v, want a read-only bind of the state dir's %s", m, resolvFile)
	}

}

func TestOCISpecMountsInterpreterReadOnly(t *testing.T) {
	sp, err := ociSpec(testConfig(), testSpec(), "/opendsec/x")
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(sp.Mounts, func(m specs.Mount) bool { return m.Destination == interpreter.PathInSandbox })
	if i < 0 {
		t.Fatalf("no mount at %s", interpreter.PathInSandbox)
	}
	if m := sp.Mounts[i]; m.Source != filepath.Join(testSpec().StateDir, interpreterFile) || !slices.Contains(m.Options, "ro") {
		t.Errorf("interpreter mount %+v, want a read-only bind of the state dir's %s", m, interpreterFile)
	}
}

// TestAgentEnvOneEntryPerKey: the sandbox's env overrides the image's for
// the same key (one entry each, in first-seen order), and PATH defaults
// only when neither sets it.
func TestAgentEnvOneEntryPerKey(t *testing.T) {
	got := agentEnv([]string{"A=image", "B=image"}, []string{"A=sandbox", "C=x"})
	want := []string{defaultPath, "A=sandbox", "B=image", "C=x"}
	if !slices.Equal(got, want) {
		t.Fatalf("agentEnv = %q, want %q", got, want)
	}
	got = agentEnv([]string{"PATH=/img"}, []string{"PATH=/sb"})
	if !slices.Equal(got, []string{"PATH=/sb"}) {
		t.Fatalf("agentEnv with PATH = %q", got)
	}
}

// TestSecurityBadInputAgentUploadLimit: the agent enforces the node's
// upload limit (node.max_upload_mb, through runtime.Env) on POST /files,
// the route E2B's SDKs write through, not its own 1 GiB default.
func TestSecurityBadInputAgentUploadLimit(t *testing.T) {
	cfg, err := configFrom(runtime.Env{MaxUploadBytes: 64 << 20}, json.RawMessage(`{"agent_path": "/usr/local/bin/opendsec-agent"}`))
	if err != nil {
		t.Fatal(err)
	}
	cfg.setDefaults()
	sp, err := ociSpec(&cfg, testSpec(), "/opendsec/sb1")
	if err != nil {
		t.Fatal(err)
	}
	i := slices.Index(sp.Process.Args, "--max-upload-bytes")
	if i < 0 || i+1 >= len(sp.Process.Args) || sp.Process.Args[i+1] != strconv.Itoa(64<<20) {
		t.Fatalf("agent args %v, want --max-upload-bytes %d", sp.Process.Args, 64<<20)
	}
}
