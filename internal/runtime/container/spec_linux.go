package container

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kernflux/opendsec/internal/interpreter"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// Paths inside the sandbox.
const (
	agentInSandbox  = "/.opendsec/agent"
	initInSandbox   = "/.opendsec/init"
	runDirInSandbox = "/run/opendsec"
	agentSocketName = "agent.sock"
	// agentListenFD is the agent socket's fd in the container's init: runc
	// passes the first fd after stdio with --preserve-fds 1.
	agentListenFD = 3
	// agentEnvFile, in the run dir, holds a launched prestarted sandbox's
	// environment for its agent (NUL-separated K=V).
	agentEnvFile = "agent.env"
)

// defaultCaps is Docker's default capability set: nothing more (no
// SYS_ADMIN, SYS_MODULE, SYS_PTRACE, NET_ADMIN...).
var defaultCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

var maskedPaths = []string{
	"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
	"/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
	"/proc/sched_debug", "/proc/scsi", "/sys/firmware",
	"/sys/devices/virtual/powercap", "/proc/kpagecgroup", "/proc/kpagecount",
	"/proc/kpageflags",
}

var readonlyPaths = []string{
	"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
}

const (
	defaultPidsLimit = sandboxspec.DefaultPidsLimit
	cpuPeriod        = 100000 // µs
	defaultPath      = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

// defaultSeccompProfile is Docker's default profile for the sandbox's
// capability set (defaultCaps).
func defaultSeccompProfile() (*specs.LinuxSeccomp, error) {
	prof, err := seccomp.GetDefaultProfile(&specs.Spec{Process: &specs.Process{
		Capabilities: &specs.LinuxCapabilities{Bounding: defaultCaps, Effective: defaultCaps, Permitted: defaultCaps},
	}})
	if err != nil {
		return nil, fmt.Errorf("default seccomp profile: %w", err)
	}
	return prof, nil
}

// agentEnv is the agent's environment: the image's, then the sandbox's,
// one entry per key (the sandbox's value wins; a process given two entries
// of one key may read either), with a default PATH when neither sets one.
func agentEnv(image, sandbox []string) []string {
	all := append(append([]string{defaultPath}, image...), sandbox...)
	at := make(map[string]int, len(all))
	env := make([]string, 0, len(all))
	for _, e := range all {
		k, _, _ := strings.Cut(e, "=")
		if i, ok := at[k]; ok {
			env[i] = e
			continue
		}
		at[k] = len(env)
		env = append(env, e)
	}
	return env
}

// ociSpec builds the OCI runtime config for a sandbox. The rootfs is
// "rootfs" relative to the bundle (StateDir/tmp, a tmpfs). It has no seccomp section:
// opendsec-init installs the compiled profile from seccompInSandbox (see
// seccomp_linux.go) before anything else runs, with no_new_privs. A
// sandbox that allows privilege escalation (setuid programs such as sudo)
// cannot have no_new_privs, and without it only CAP_SYS_ADMIN may install
// a filter: runc installs the same profile then, before it drops its
// capabilities and starts init (about 16 ms more per create).
func ociSpec(cfg *Config, s runtime.Spec, cgroupsPath string) (*specs.Spec, error) {
	hostname := s.Guest.Hostname
	if hostname == "" {
		hostname = s.ID
	}
	// PID 1 is opendsec-init: it installs the filter, holds the agent's
	// socket (bound and listening before runc runs, inherited as fd 3, see
	// runcRun) and starts the agent (the args after "--") on demand.
	// A prestarted sandbox gets its caller's environment at launch, in the
	// env file (see Launch); init reads and removes it at boot.
	args := []string{initInSandbox, "--seccomp-filter", seccompInSandbox}
	var runcSeccomp *specs.LinuxSeccomp
	if s.AllowPrivilegeEscalation {
		prof, err := defaultSeccompProfile()
		if err != nil {
			return nil, err
		}
		args, runcSeccomp = []string{initInSandbox}, prof
	}
	args = append(args, "--listen-fd", strconv.Itoa(agentListenFD),
		"--env-file", filepath.Join(runDirInSandbox, agentEnvFile), "--", agentInSandbox)
	if s.Guest.User != "" {
		args = append(args, "--default-user", s.Guest.User)
	}
	if s.Guest.Workdir != "" {
		args = append(args, "--default-workdir", s.Guest.Workdir)
	}
	if d := cfg.agentIdleExit(); d > 0 {
		args = append(args, "--idle-exit", d.String())
	}
	if cfg.MaxUploadBytes > 0 {
		args = append(args, "--max-upload-bytes", strconv.FormatInt(cfg.MaxUploadBytes, 10))
	}
	// The agent's environment is init's.
	env := agentEnv(s.Guest.Env, nil)

	mem := s.Resources.MemoryMB << 20
	quota := int64(s.Resources.CPU * cpuPeriod)
	pids := s.Resources.PidsLimit
	if pids == 0 {
		pids = defaultPidsLimit
	}
	// New checked that runc can give it (checkNofile).
	nofile := uint64(cfg.NofileLimit)
	tmpSize := fmt.Sprintf("size=%dm", s.Resources.MemoryMB)

	sp := &specs.Spec{
		Version:  ociSpecVersion,
		Hostname: hostname,
		Root:     &specs.Root{Path: "rootfs"},
		Process: &specs.Process{
			User: specs.User{UID: 0, GID: 0},
			Args: args,
			Env:  env,
			Cwd:  "/",
			Capabilities: &specs.LinuxCapabilities{
				Bounding:  defaultCaps,
				Effective: defaultCaps,
				Permitted: defaultCaps,
			},
			Rlimits: []specs.POSIXRlimit{
				{Type: "RLIMIT_NOFILE", Hard: nofile, Soft: nofile},
			},
			NoNewPrivileges: !s.AllowPrivilegeEscalation,
		},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup", Options: []string{"nosuid", "noexec", "nodev", "relatime", "ro"}},
			{Destination: "/tmp", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev", "mode=1777", tmpSize}},
			{Destination: agentInSandbox, Type: "bind", Source: cfg.AgentPath, Options: []string{"bind", "ro", "nosuid", "nodev"}},
			{Destination: initInSandbox, Type: "bind", Source: cfg.InitPath, Options: []string{"bind", "ro", "nosuid", "nodev"}},
			{Destination: seccompInSandbox, Type: "bind", Source: filepath.Join(s.StateDir, seccompFile), Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}},
			{Destination: interpreter.PathInSandbox, Type: "bind", Source: filepath.Join(s.StateDir, interpreterFile), Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}},
			{Destination: runDirInSandbox, Type: "bind", Source: filepath.Join(s.StateDir, tmpDir, runDir), Options: []string{"bind", "rw", "nosuid", "nodev", "noexec"}},
		},
		Annotations: map[string]string{"org.opendsec.sandbox.id": s.ID},
		Linux: &specs.Linux{
			CgroupsPath: cgroupsPath,
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace},
				{Type: specs.MountNamespace},
				{Type: specs.UTSNamespace},
				{Type: specs.IPCNamespace},
				{Type: specs.NetworkNamespace},
				{Type: specs.CgroupNamespace},
			},
			Resources: &specs.LinuxResources{
				Devices: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}},
				Memory: &specs.LinuxMemory{
					Limit: &mem,
					Swap:  &mem, // memory+swap == memory: no swap escape
				},
				CPU:  cpuResources(s.CPUClass, quota),
				Pids: &specs.LinuxPids{Limit: pids},
			},
			MaskedPaths:   maskedPaths,
			ReadonlyPaths: readonlyPaths,
			Seccomp:       runcSeccomp,
		},
	}
	if s.Network.NetNS != "" {
		for i := range sp.Linux.Namespaces {
			if sp.Linux.Namespaces[i].Type == specs.NetworkNamespace {
				sp.Linux.Namespaces[i].Path = s.Network.NetNS
			}
		}
	}
	if len(s.Guest.Nameservers) > 0 {
		sp.Mounts = append(sp.Mounts, specs.Mount{Destination: "/etc/resolv.conf", Type: "bind", Source: filepath.Join(s.StateDir, resolvFile), Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
	}
	for k, v := range s.Labels {
		sp.Annotations["org.opendsec.label."+k] = v
	}
	return sp, nil
}

// cpuResources is the cgroup's CPU limit (quota per period) and, for a
// best-effort sandbox, the least CPU weight (cpu.shares 2; runc writes
// cpu.weight 1 on cgroup v2).
//
// The period is left out: it is cpuPeriod, which is what the kernel gives
// every new cgroup (cgroup v1's cpu.cfs_period_us; on v2 runc and crun
// write cpu.max with 100000 when config.json has none). On cgroup v1 each
// write of cpu.cfs_period_us or cpu.cfs_quota_us checks the bandwidth of
// every cgroup on the host (walk_tg_tree), so writing the unchanged
// period cost each create one more walk past every sandbox's cgroup.
func cpuResources(class runtime.CPUClass, quota int64) *specs.LinuxCPU {
	c := &specs.LinuxCPU{Quota: &quota}
	if class == runtime.CPUBestEffort {
		shares := uint64(minCPUShares)
		c.Shares = &shares
	}
	return c
}

// minCPUShares is cgroup v1's least cpu.shares.
const minCPUShares = 2
