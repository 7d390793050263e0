// Package container is the container backend: each sandbox is an OCI
// container run by an OCI runtime binary (crun or runc) with namespaces (pid, mount, uts, ipc,
// network, cgroup), cgroup limits (v1 and v2), Docker's default seccomp
// profile and capability set, no_new_privs and masked /proc paths, on an
// overlayfs root. opendsec-init is the container's PID 1 and starts the
// opendsec-agent on demand (both bind-mounted read-only); the node reaches
// the agent over a unix socket init holds.
//
// Create only prepares the bundle; Start runs it with one `runc run
// --detach`. The seccomp profile is compiled to BPF once per node start
// and installed by opendsec-init before anything else runs (seccomp_linux.go),
// so runc does not recompile it with libseccomp on every create.
//
// The runtime binary (not libcontainer as a library) is used so containers
// are detached from the node process: they keep running when the node
// crashes or restarts, and Recover finds them again in the runtime's state
// directory.
//
// Which binary (container.oci_runtime, ociruntime_linux.go): auto, the
// default, is crun where it is installed (version 1.8 or later) and a probe
// container runs at open, else runc; runc or crun name one. crun is a C
// program: a `crun run --detach` of a busybox bundle costs 9-10 ms of CPU
// where `runc run --detach` (Go, parent plus runc init) costs 26-30 ms, and
// in a cold batch create runc was about 28 of the 51 ms of CPU per sandbox.
// Both take the same command line and keep the same state layout
// (<state_root>/<id>, OCI `state` JSON); the few differences (the exec
// fifo's direction, the not-found message) are in ociRuntime. crun refuses
// a hybrid cgroup host ("cgroups in hybrid mode not supported") because
// /sys/fs/cgroup/unified is a cgroup2 mount, even an empty one: every crun
// command runs in the runc mount namespace (runcns_linux.go), where that
// mount is unmounted, so crun sees plain cgroup v1 and applies every limit.
// crun's built-in device rules allow /dev/console whatever config.json
// says: on v1 the node denies it right after crun made the container, on
// v2 an eBPF device program on the cgroup parent refuses it
// (bpfdevice_linux.go).
package container

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// Name is the backend's name in the registry and in specs.
const Name = "container"

func init() { runtime.Register(Name, open) }

// open builds the backend from its config section (node.backends.container).
func open(ctx context.Context, env runtime.Env, raw json.RawMessage) (runtime.Runtime, error) {
	cfg, err := configFrom(env, raw)
	if err != nil {
		return nil, err
	}
	return newBackend(ctx, cfg)
}

// configFrom is the backend's config: its section and what the node
// passes every backend.
func configFrom(env runtime.Env, raw json.RawMessage) (Config, error) {
	var cfg Config
	if err := runtime.DecodeConfig(Name, raw, &cfg); err != nil {
		return Config{}, err
	}
	cfg.NodeID = env.NodeID
	cfg.MaxUploadBytes = env.MaxUploadBytes
	cfg.NodeStateDir = env.StateDir
	cfg.MaxPidsLimit = env.Limits.MaxPidsLimit
	cfg.TotalPidsLimit = env.Limits.TotalPidsLimit
	cfg.NofileLimit = env.Limits.NofileLimit
	return cfg, nil
}

// Config configures the backend.
type Config struct {
	// NodeID is the node's ID (runtime.Env, not a field of the section).
	// It is in the default StateRoot and CgroupParent, so nodes sharing a
	// machine never share runc state or a cgroup parent. Empty (tests)
	// keeps the defaults of before node IDs were in them.
	NodeID string `json:"-"`
	// OCIRuntime is the OCI runtime binary that runs the containers:
	// "auto" (empty: crun where it is installed and a probe container
	// runs, else runc), "runc" or "crun" (an error at start if it cannot
	// run containers here).
	OCIRuntime string `json:"oci_runtime,omitempty"`
	// RuncPath is the runc binary; empty means "runc" looked up in PATH.
	RuncPath string `json:"runc_path,omitempty"`
	// CrunPath is the crun binary; empty means "crun" looked up in PATH.
	CrunPath string `json:"crun_path,omitempty"`
	// StateRoot is runc's state directory (runc --root); empty means
	// /run/opendsec/<node id>/runc. It must be on a filesystem that survives a node
	// restart (tmpfs /run is fine: containers do not survive a reboot either).
	StateRoot string `json:"state_root,omitempty"`
	// CgroupParent is the cgroup under which every sandbox gets
	// <CgroupParent>/<id>; empty means /opendsec-<node id>.
	CgroupParent string `json:"cgroup_parent,omitempty"`
	// AgentPath is the host path of the static opendsec-agent binary,
	// bind-mounted read-only into every sandbox and run there, on demand,
	// under InitPath. Required.
	AgentPath string `json:"agent_path"`
	// InitPath is the host path of the static opendsec-init binary, every
	// sandbox's PID 1: it holds the agent's listening socket and starts
	// the agent server when a connection arrives. Empty means
	// opendsec-init in AgentPath's directory.
	InitPath string `json:"init_path,omitempty"`
	// AgentIdleExitMS is how long the agent server stays without requests,
	// processes or watchers before it exits (init starts it again on the
	// next connection); 0 means never, absent means
	// DefaultAgentIdleExit.
	AgentIdleExitMS *int64 `json:"agent_idle_exit_ms,omitempty"`
	// MaxUploadBytes is the agent's upload limit (node.max_upload_mb, from
	// runtime.Env; not part of the section); 0 is the agent's default.
	MaxUploadBytes int64 `json:"-"`
	// DiskQuota is how a sandbox's writable layer gets its quota
	// (Resources.DiskMB): "project" (an XFS or ext4 project quota; the
	// filesystem of the sandboxes' state dirs must be mounted with
	// prjquota), "image" (a sparse ext4 image per sandbox, loop-mounted)
	// or "auto" (empty: project where the filesystem enforces project
	// quotas, else image).
	DiskQuota string `json:"disk_quota,omitempty"`
	// NodeStateDir is the node's own state directory (runtime.Env; on the
	// node's disk): the formatted layer images new layers are copied from
	// live under it, not in StateRoot (tmpfs /run in production: RAM).
	NodeStateDir string `json:"-"`

	// legacyDefaults: StateRoot and CgroupParent are the node's defaults,
	// so a create interrupted before the upgrade that put node IDs in them
	// may have left its state under the old ones.
	legacyDefaults bool
	// tmpfsStateRoot: StateRoot is the default, which New puts on a
	// tmpfs when it is on disk (statetmpfs_linux.go).
	tmpfsStateRoot bool
	// runcInNodeNS runs runc in the node's mount namespace, as before
	// runcns_linux.go (tests compare the two).
	runcInNodeNS bool

	// The node's limits (node.max_pids_limit, node.total_pids_limit,
	// node.nofile_limit), from runtime.Env: not settable in the backend's
	// section.
	//
	// MaxPidsLimit is the largest Resources.PidsLimit Create accepts; 0
	// means sandboxspec.DefaultMaxPidsLimit.
	MaxPidsLimit int64 `json:"-"`
	// TotalPidsLimit is written to CgroupParent's pids.max at every New,
	// so all sandboxes together never have more processes and threads;
	// 0 means sandboxspec.TotalPidsCeiling of the host's pid limit.
	TotalPidsLimit int64 `json:"-"`
	// NofileLimit is RLIMIT_NOFILE (soft and hard) of every sandbox
	// process; 0 means sandboxspec.DefaultNofileLimit.
	NofileLimit int64 `json:"-"`
}

// OCI runtimes (Config.OCIRuntime).
const (
	OCIRuntimeAuto = "auto"
	OCIRuntimeRunc = "runc"
	OCIRuntimeCrun = "crun"
)

// Disk quota mechanisms (Config.DiskQuota).
const (
	DiskQuotaAuto    = "auto"
	DiskQuotaProject = "project"
	DiskQuotaImage   = "image"
)

// DefaultAgentIdleExit is the agent's idle exit when the config names none.
const DefaultAgentIdleExit = 30 * time.Second

// agentIdleExit is the configured idle exit (0: never).
func (c *Config) agentIdleExit() time.Duration {
	if c.AgentIdleExitMS == nil {
		return DefaultAgentIdleExit
	}
	return time.Duration(*c.AgentIdleExitMS) * time.Millisecond
}

// Defaults for Config. DefaultStateRoot and DefaultCgroupParent are those
// without a node ID; a node's are DefaultStateRootOf and
// DefaultCgroupParentOf its ID.
const (
	DefaultRuncPath     = "runc"
	DefaultCrunPath     = "crun"
	DefaultStateRoot    = "/run/opendsec/runc"
	DefaultCgroupParent = "/opendsec"
)

// DefaultStateRootOf is state_root's default on node.
func DefaultStateRootOf(node string) string {
	if node == "" {
		return DefaultStateRoot
	}
	return filepath.Join("/run/opendsec", node, "runc")
}

// DefaultCgroupParentOf is cgroup_parent's default on node.
func DefaultCgroupParentOf(node string) string {
	if node == "" {
		return DefaultCgroupParent
	}
	return DefaultCgroupParent + "-" + node
}

func (c *Config) setDefaults() {
	if c.RuncPath == "" {
		c.RuncPath = DefaultRuncPath
	}
	if c.CrunPath == "" {
		c.CrunPath = DefaultCrunPath
	}
	if c.OCIRuntime == "" {
		c.OCIRuntime = OCIRuntimeAuto
	}
	c.legacyDefaults = c.NodeID != "" && c.StateRoot == "" && c.CgroupParent == ""
	if c.StateRoot == "" {
		c.StateRoot = DefaultStateRootOf(c.NodeID)
		c.tmpfsStateRoot = true
	}
	if c.CgroupParent == "" {
		c.CgroupParent = DefaultCgroupParentOf(c.NodeID)
	}
	if c.DiskQuota == "" {
		c.DiskQuota = DiskQuotaAuto
	}
	if c.InitPath == "" && c.AgentPath != "" {
		c.InitPath = filepath.Join(filepath.Dir(c.AgentPath), InitBinaryName)
	}
	if c.MaxPidsLimit == 0 {
		c.MaxPidsLimit = sandboxspec.DefaultMaxPidsLimit
	}
	if c.NofileLimit == 0 {
		c.NofileLimit = sandboxspec.DefaultNofileLimit
	}
}

// SharedCpusetName is the cpuset cgroup under the sandboxes' parent
// (cgroup_parent) that every sandbox shares on cgroup v1 with crun, where
// crun does not see the cpuset hierarchy (cgview_linux.go): a name no
// sandbox ID can have ('.' is not an ID character). Whoever removes the
// parent removes it first.
const SharedCpusetName = "sandboxes.shared"

// InitBinaryName is the file name of opendsec-init, looked for next to the
// agent binary when the config names no init_path.
const InitBinaryName = "opendsec-init"

func (c *Config) validate() error {
	if c.StateRoot[0] != '/' {
		return errdefs.Invalid("container.state_root", "must be an absolute path, got %q", c.StateRoot)
	}
	if c.CgroupParent[0] != '/' {
		return errdefs.Invalid("container.cgroup_parent", "must start with '/', e.g. /opendsec, got %q", c.CgroupParent)
	}
	if c.MaxPidsLimit < sandboxspec.MinPidsLimit || c.MaxPidsLimit > sandboxspec.MaxPidsLimit {
		return errdefs.Invalid("node.max_pids_limit", "is %d; give %d to %d processes per sandbox", c.MaxPidsLimit, sandboxspec.MinPidsLimit, sandboxspec.MaxPidsLimit)
	}
	if c.TotalPidsLimit < 0 || c.TotalPidsLimit > 0 && c.TotalPidsLimit < c.MaxPidsLimit {
		return errdefs.Invalid("node.total_pids_limit", "is %d; give at least node.max_pids_limit (%d), or 0 to derive it from kernel.pid_max", c.TotalPidsLimit, c.MaxPidsLimit)
	}
	if c.NofileLimit < sandboxspec.MinNofileLimit || c.NofileLimit > sandboxspec.MaxNofileLimit {
		return errdefs.Invalid("node.nofile_limit", "is %d; give %d to %d open files per sandbox process", c.NofileLimit, sandboxspec.MinNofileLimit, sandboxspec.MaxNofileLimit)
	}
	if c.AgentIdleExitMS != nil && *c.AgentIdleExitMS < 0 {
		return errdefs.Invalid("container.agent_idle_exit_ms", "is %d; give 0 (never exit) or milliseconds, e.g. 30000", *c.AgentIdleExitMS)
	}
	switch c.OCIRuntime {
	case OCIRuntimeAuto, OCIRuntimeRunc, OCIRuntimeCrun:
	default:
		return errdefs.Invalid("container.oci_runtime", "%q is not an OCI runtime; give auto (the default: crun where it works, else runc), runc or crun", c.OCIRuntime)
	}
	switch c.DiskQuota {
	case DiskQuotaAuto, DiskQuotaProject, DiskQuotaImage:
	default:
		return errdefs.Invalid("container.disk_quota", "%q is not a disk quota mechanism; give auto (the default), project or image", c.DiskQuota)
	}
	for _, b := range []struct{ field, path, fix string }{
		{"container.agent_path", c.AgentPath, "build it with `make agent` or run deploy/quickstart.sh"},
		{"container.init_path", c.InitPath, "build it with `make agent` (it goes next to opendsec-agent) or run deploy/quickstart.sh"},
	} {
		if b.path == "" || !filepath.IsAbs(b.path) {
			return errdefs.Invalid(b.field, "%q must be the absolute path of the binary; %s", b.path, b.fix)
		}
		fi, err := os.Stat(b.path)
		switch {
		case err != nil || !fi.Mode().IsRegular():
			return errdefs.Invalid(b.field, "%q is not a regular file; %s", b.path, b.fix)
		case fi.Mode().Perm()&0o111 == 0:
			return errdefs.Invalid(b.field, "%q is not executable (mode %v): chmod +x it", b.path, fi.Mode().Perm())
		}
	}
	return nil
}

// layerTemplateDir is where the formatted layer images are kept.
func (c Config) layerTemplateDir() string {
	if c.NodeStateDir != "" {
		return filepath.Join(c.NodeStateDir, "container", "layer-templates")
	}
	return c.StateRoot + ".layers"
}
