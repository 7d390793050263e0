package container

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

func testSpec() runtime.Spec {
	return runtime.Spec{
		ID:        "sb1",
		Image:     runtime.Image{Layers: []string{"/layers/a"}, Env: []string{"LANG=C.UTF-8"}, User: "user", Workdir: "/home/user"},
		Env:       []string{"FOO=bar"},
		AgentPath: "/opt/opendsec-agent",
		StateDir:  "/var/lib/opendsec/sb1",
		Resources: runtime.Resources{CPU: 1.5, MemoryMB: 256, PidsLimit: 100},
		Labels:    map[string]string{"task": "t1"},
	}
}

func TestOCISpecHardening(t *testing.T) {
	sp, err := ociSpec(testSpec(), "/opendsec/sb1")
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
	if *r.CPU.Quota != 150000 || *r.CPU.Period != 100000 {
		t.Errorf("cpu quota %d period %d", *r.CPU.Quota, *r.CPU.Period)
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

	var agent, sys *specs.Mount
	for i, m := range sp.Mounts {
		switch m.Destination {
		case agentInSandbox:
			agent = &sp.Mounts[i]
		case "/sys":
			sys = &sp.Mounts[i]
		}
	}
	if agent == nil || agent.Source != "/opt/opendsec-agent" || !slices.Contains(agent.Options, "ro") || !slices.Contains(agent.Options, "nosuid") {
		t.Errorf("agent mount %+v, want read-only nosuid bind of the agent", agent)
	}
	if sys == nil || !slices.Contains(sys.Options, "ro") {
		t.Errorf("sysfs mount %+v, want read-only", sys)
	}
	wantArgs := []string{agentInSandbox, "--listen", "/run/opendsec/agent.sock", "--default-user", "user", "--default-workdir", "/home/user"}
	if !slices.Equal(p.Args, wantArgs) {
		t.Errorf("args %v, want %v", p.Args, wantArgs)
	}
	if !slices.Contains(p.Env, "FOO=bar") || !slices.Contains(p.Env, "LANG=C.UTF-8") || !strings.HasPrefix(p.Env[0], "PATH=") {
		t.Errorf("env %v: want PATH default, image env and spec env", p.Env)
	}
}

func TestOCISpecSeccomp(t *testing.T) {
	sp, err := ociSpec(testSpec(), "/opendsec/sb1")
	if err != nil {
		t.Fatal(err)
	}
	sc := sp.Linux.Seccomp
	if sc == nil || sc.DefaultAction != specs.ActErrno {
		t.Fatalf("seccomp %+v: want a default-deny profile", sc)
	}
	allowed := map[string]bool{}
	for _, r := range sc.Syscalls {
		if r.Action != specs.ActAllow {
			continue
		}
		for _, n := range r.Names {
			if len(r.Args) == 0 {
				allowed[n] = true
			}
		}
	}
	for _, n := range []string{"mount", "umount2", "init_module", "finit_module", "delete_module", "kexec_load",
		"bpf", "keyctl", "add_key", "request_key", "unshare", "setns", "reboot", "swapon", "swapoff",
		"pivot_root", "open_by_handle_at", "perf_event_open", "clone3"} {
		if allowed[n] {
			t.Errorf("seccomp allows %s", n)
		}
	}
	for _, n := range []string{"read", "write", "execve", "openat", "connect", "wait4"} {
		if !allowed[n] {
			t.Errorf("seccomp denies %s", n)
		}
	}
}

func TestValidateSpec(t *testing.T) {
	dir := t.TempDir()
	layer := filepath.Join(dir, "layer")
	agent := filepath.Join(dir, "agent")
	if err := os.Mkdir(layer, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(agent, []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	good := testSpec()
	good.Image.Layers, good.AgentPath = []string{layer}, agent
	if err := validateSpec(good); err != nil {
		t.Fatalf("good spec: %v", err)
	}
	cases := []struct {
		field  string
		mutate func(*runtime.Spec)
	}{
		{"id", func(s *runtime.Spec) { s.ID = "" }},
		{"id", func(s *runtime.Spec) { s.ID = "../etc" }},
		{"image.layers", func(s *runtime.Spec) { s.Image.Layers = nil }},
		{"image.layers[0]", func(s *runtime.Spec) { s.Image.Layers = []string{dir + "/x:y"} }},
		{"image.layers[1]", func(s *runtime.Spec) { s.Image.Layers = []string{layer, agent} }},
		{"agent_path", func(s *runtime.Spec) { s.AgentPath = layer }},
		{"state_dir", func(s *runtime.Spec) { s.StateDir = "rel" }},
		{"resources.memory_mb", func(s *runtime.Spec) { s.Resources.MemoryMB = 0 }},
		{"resources.cpu", func(s *runtime.Spec) { s.Resources.CPU = 0 }},
		{"resources.cpu", func(s *runtime.Spec) { s.Resources.CPU = 0.001 }},
		{"resources.memory_mb", func(s *runtime.Spec) { s.Resources.MemoryMB = 4 }},
		{"resources.pids_limit", func(s *runtime.Spec) { s.Resources.PidsLimit = 3 }},
		{"resources.pids_limit", func(s *runtime.Spec) { s.Resources.PidsLimit = -1 }},
		{"env", func(s *runtime.Spec) { s.Env = []string{"=x"} }},
		{"hostname", func(s *runtime.Spec) { s.Hostname = strings.Repeat("h", 65) }},
	}
	for _, c := range cases {
		s := good
		c.mutate(&s)
		err := validateSpec(s)
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != c.field {
			t.Errorf("%s: err = %v, want a field error naming %s", c.field, err, c.field)
		}
	}
}
