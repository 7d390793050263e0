// Package config is OpenDsec's one configuration file
// (/etc/opendsec/opendsec.json by default). Each component reads its part.
// Load fills defaults and validates; errors name the JSON field and the fix.
package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// DefaultPath is where Load looks when no path is given.
const DefaultPath = "/etc/opendsec/opendsec.json"

// Config is the whole file.
type Config struct {
	Version int `json:"version"`
	// DataDir holds durable state of the components on this machine.
	DataDir   string    `json:"data_dir"`
	Log       Log       `json:"log"`
	APIServer APIServer `json:"apiserver"`
	Watcher   Watcher   `json:"watcher"`
	Node      Node      `json:"node"`
	// Nodes the watcher polls and apiservers route to, by node ID.
	Nodes []NodeRef `json:"nodes"`
	E2B   E2B       `json:"e2b"`
	// Auth names the token-signing key files (docs/security.md).
	Auth Auth `json:"auth"`
	// Debug holds switches for profiling; all off by default.
	Debug Debug `json:"debug"`
}

// Debug configures the daemons' profiling endpoint.
type Debug struct {
	// PprofListen, when set, is a loopback host:port (127.0.0.1:6060,
	// [::1]:6060) where every daemon of this config serves Go's
	// /debug/pprof/ (CPU and heap profiles, goroutine dumps, traces)
	// without authentication: anyone on the host who can reach loopback
	// can read them. Off when empty.
	PprofListen string `json:"pprof_listen,omitempty"`
}

// Auth configures token signing and verification. Tokens are signed with
// an ed25519 private key that only the issuer holds (`opendsec up`,
// `opendsec token create`, opendsec-e2b); every other component verifies
// with the public key. Empty paths mean the defaults in the data dir (see
// the methods).
type Auth struct {
	// PrivateKeyFile is the issuer's ed25519 private key (PEM, PKCS #8).
	PrivateKeyFile string `json:"private_key_file,omitempty"`
	// PublicKeyFile is the key every component verifies tokens with (PEM).
	PublicKeyFile string `json:"public_key_file,omitempty"`
	// ServiceTokenFile holds the node-scope token the separate
	// opendsec-apiserver and opendsec-watcher call other components with;
	// the operator mints it on the issuer (`opendsec token create --scope
	// node`). `opendsec up` mints its own and does not read it.
	ServiceTokenFile string `json:"service_token_file,omitempty"`
}

// PrivateKeyPath is Auth.PrivateKeyFile, by default <data_dir>/auth.ed25519.
func (c Config) PrivateKeyPath() string {
	return orDefault(c.Auth.PrivateKeyFile, filepath.Join(c.DataDir, "auth.ed25519"))
}

// PublicKeyPath is Auth.PublicKeyFile, by default <data_dir>/auth.ed25519.pub.
func (c Config) PublicKeyPath() string {
	return orDefault(c.Auth.PublicKeyFile, filepath.Join(c.DataDir, "auth.ed25519.pub"))
}

// ServiceTokenPath is Auth.ServiceTokenFile, by default <data_dir>/service.token.
func (c Config) ServiceTokenPath() string {
	return orDefault(c.Auth.ServiceTokenFile, filepath.Join(c.DataDir, "service.token"))
}

func orDefault(s, def string) string {
	if s != "" {
		return s
	}
	return def
}

// E2B configures the E2B-compatible gateway (opendsec-e2b).
type E2B struct {
	// Listen is host:port for the E2B API and sandbox traffic.
	Listen string `json:"listen"`
	// Domain is the base domain of sandbox hosts (<port>-<id>.<domain>).
	Domain string `json:"domain"`
	// APIAddress is the apiserver's base URL.
	APIAddress string `json:"api_address"`
	// Templates map E2B template names to images; others are image names.
	Templates map[string]string `json:"templates"`
	// DefaultInternetAccess is what an E2B create that names no network
	// option gets: true (unset), E2B's default, the public internet (no
	// private, link-local, loopback or sandbox-pool addresses); false, the
	// node's default rule sets (by default no network), as the native API.
	DefaultInternetAccess *bool `json:"default_internet_access,omitempty"`
	// AllowPrivilegeEscalation: E2B sandboxes run setuid programs (sudo as
	// "user", as in E2B) when true (unset); false keeps no_new_privs, as
	// the native API does by default (allow_privilege_escalation).
	AllowPrivilegeEscalation *bool `json:"allow_privilege_escalation,omitempty"`
	// Backend runs E2B sandboxes (E2B clients cannot pick one): empty,
	// the node's default (node.default_backend), or e.g. "container",
	// which a filesystem-only pause (E2B's memory: false) needs.
	Backend string `json:"backend,omitempty"`
	// TLS serves the gateway (API and sandbox traffic) over TLS with HTTP/2.
	TLS E2BTLS `json:"tls"`
}

// E2BTLS configures TLS on the E2B gateway. Enabled without files, the
// gateway uses a certificate from OpenDsec's own CA, made once in
// <data_dir>/e2b/tls (CATLSDir) for the domain, *.<domain>, localhost,
// 127.0.0.1, ::1 and Names; clients trust <data_dir>/e2b/tls/ca.pem
// (`opendsec e2b ca`).
type E2BTLS struct {
	Enabled bool `json:"enabled"`
	// CertFile and KeyFile are the operator's certificate chain and key
	// (PEM), used instead of OpenDsec's CA; give both or neither.
	CertFile string `json:"cert_file,omitempty"`
	KeyFile  string `json:"key_file,omitempty"`
	// Names are more DNS names or IP addresses the made certificate covers
	// (the gateway's public name or address).
	Names []string `json:"names,omitempty"`
}

// E2BTLSDir is where the gateway keeps OpenDsec's CA and its certificate.
func (c Config) E2BTLSDir() string { return filepath.Join(c.DataDir, "e2b", "tls") }

// Log configures logging.
type Log struct {
	Level  string `json:"level"`
	Format string `json:"format"`
}

// APIServer configures opendsec-apiserver.
type APIServer struct {
	// Listen is host:port for the public API (Connect, gRPC, gRPC-Web).
	Listen string `json:"listen"`
	// WatcherAddress is the watcher's base URL.
	WatcherAddress string `json:"watcher_address"`
	// PlacementSample is k in power-of-k placement.
	PlacementSample int `json:"placement_sample"`
}

// Watcher configures opendsec-watcher.
type Watcher struct {
	Listen string `json:"listen"`
	// PollIntervalMS between node polls.
	PollIntervalMS int `json:"poll_interval_ms"`
}

// Node configures opendsec-node.
type Node struct {
	ID string `json:"id"`
	// Listen is host:port, or unix:///path for a unix socket.
	Listen string `json:"listen"`
	// Backends configures the node's backends: each key is a backend name
	// (container, and any other this build registers) with that backend's
	// own settings. Empty means {"container": {}}. agent_path, init_path
	// and agent_idle_exit_ms below are the container backend's and are
	// copied into its section when it does not set them (the older place
	// for them).
	Backends map[string]json.RawMessage `json:"backends,omitempty"`
	// AgentPath is the static opendsec-agent binary put in every sandbox.
	AgentPath string `json:"agent_path"`
	// InitPath is the static opendsec-init binary, every container
	// sandbox's PID 1; empty means opendsec-init next to AgentPath.
	InitPath string `json:"init_path,omitempty"`
	// AgentIdleExitMS: the agent server inside a sandbox exits after this
	// long without requests, processes or watchers, and opendsec-init starts
	// it again on the next connection (an idle sandbox then costs only
	// init's memory). 0 keeps the server running.
	AgentIdleExitMS int64 `json:"agent_idle_exit_ms"`
	// ImageDir is the image store.
	ImageDir string `json:"image_dir"`
	// ImportDir is the only directory archive imports through the API
	// (oci-layout:PATH, docker-archive:PATH) may read from.
	ImportDir string `json:"import_dir"`
	// DefaultBackend is used when a create names none: "auto" (the
	// default) is microvm where the microvm backend can run (hardware KVM
	// and Firecracker), else container; a backend's name is that backend,
	// refused at start when it cannot run here.
	DefaultBackend string `json:"default_backend"`
	// PVMGuestKernel is a PVM guest kernel (an uncompressed x86-64 ELF
	// vmlinux built for this host's PVM ABI). On a PVM host (kvm_pvm) VMs
	// use KVM only with one that passed a boot probe; else TCG. See
	// docs/operations.md, "VM accelerator".
	PVMGuestKernel string `json:"pvm_guest_kernel,omitempty"`
	// Capacity the node offers; 0 means detect (all CPUs, 90% of memory).
	CPU      float64 `json:"cpu"`
	MemoryMB int64   `json:"memory_mb"`
	// CPUOvercommit: the node offers this many times CPU in CFS quotas
	// (sandboxes of a rollout idle most of the time); 0 means
	// DefaultCPUOvercommit.
	CPUOvercommit float64 `json:"cpu_overcommit"`
	// MemoryOvercommit: the node admits memory limits adding up to this
	// many times MemoryMB; 0 means DefaultMemoryOvercommit (1: no
	// overcommit).
	MemoryOvercommit float64 `json:"memory_overcommit"`
	// MaxSandboxes is the admission cap on sandboxes.
	MaxSandboxes int64 `json:"max_sandboxes"`
	// MaxPidsLimit is the largest pids_limit one sandbox may ask for;
	// 0 means sandboxspec.DefaultMaxPidsLimit.
	MaxPidsLimit int64 `json:"max_pids_limit"`
	// TotalPidsLimit bounds the processes and threads of all the node's
	// sandboxes together (the pids.max of the backend's cgroup parent);
	// 0 means what the host can run less headroom for the node, runc and
	// sshd (sandboxspec.TotalPidsCeiling). See TotalPids.
	TotalPidsLimit int64 `json:"total_pids_limit"`
	// NofileLimit is every sandbox process's RLIMIT_NOFILE (soft and
	// hard); 0 means sandboxspec.DefaultNofileLimit.
	NofileLimit int64 `json:"nofile_limit"`
	// MaxUploadMB caps one file write.
	MaxUploadMB int64 `json:"max_upload_mb"`
	// Disk is the sandboxes' writable-layer quota and the node's reserve.
	Disk NodeDisk `json:"disk"`
	// MaxPaused is how long a sandbox may stay paused before the node stops
	// it, as a Go duration ("24h", "90m"); "0" keeps paused sandboxes until
	// they are resumed or stopped. See MaxPausedDuration.
	MaxPaused string `json:"max_paused"`
	// Network is the sandboxes' network policy (docs/network.md).
	Network NodeNetwork `json:"network"`
	// WarmPool keeps prestarted sandboxes of recently created shapes
	// (docs/concepts.md, "Warm pool").
	WarmPool WarmPool `json:"warm_pool"`
	// Build configures image builds (docs/images.md, "Building images").
	Build NodeBuild `json:"build"`
	// Trajectory is every sandbox's trajectory log (docs/concepts.md,
	// "Trajectory log").
	Trajectory Trajectory `json:"trajectory"`
}

// NodeBuild configures image builds on a node: every RUN step runs in a
// build sandbox of this size, with this network policy.
type NodeBuild struct {
	// TimeoutSec bounds one build when the request gives no timeout.
	TimeoutSec int64 `json:"timeout_sec"`
	// MaxTimeoutSec is the longest timeout a request may ask for.
	MaxTimeoutSec int64 `json:"max_timeout_sec"`
	// MaxContextMB bounds an uploaded build context.
	MaxContextMB int64 `json:"max_context_mb"`
	// RuleSets are the named rule sets (node.network.rule_sets) a build
	// sandbox may reach, e.g. a package mirror; empty is no network.
	RuleSets []string `json:"rule_sets,omitempty"`
	// CPU, MemoryMB and DiskMB size each build sandbox (0: the defaults
	// of a sandbox; disk: node.disk.default_mb).
	CPU      float64 `json:"cpu"`
	MemoryMB int64   `json:"memory_mb"`
	DiskMB   int64   `json:"disk_mb"`
}

// Build defaults.
const (
	DefaultBuildTimeoutSec    = 1800
	DefaultBuildMaxTimeoutSec = 6 * 3600
	DefaultBuildMaxContextMB  = 512
)

// Trajectory configures the trajectory log (node.trajectory). Zero values
// take the defaults below.
type Trajectory struct {
	// Off turns the log and exactly-once calls off.
	Off bool `json:"off,omitempty"`
	// MaxLogMB bounds one sandbox's log file: past it the output of the
	// oldest calls is dropped (marked output_compacted), never a call
	// record.
	MaxLogMB int64 `json:"max_log_mb,omitempty"`
	// MaxOutputKB bounds the recorded output of each stream of one call
	// (a call's own output_limit_bytes lowers it).
	MaxOutputKB int64 `json:"max_output_kb,omitempty"`
	// RetentionSec is how long a stopped sandbox's log stays readable;
	// -1 removes it at the stop.
	RetentionSec int64 `json:"retention_sec,omitempty"`
	// Fsync makes every call's begin and end durable against a machine
	// crash (~1 ms each); without it they survive a kill of the node.
	Fsync bool `json:"fsync,omitempty"`
}

// Trajectory defaults (node.trajectory).
const (
	DefaultTrajectoryMaxLogMB     = 64
	DefaultTrajectoryMaxOutputKB  = 1024
	DefaultTrajectoryRetentionSec = 86400
)

// NodeDisk configures the quota of every sandbox's writable layer (bytes,
// and inodes one per 16 KiB; docs/security.md) and the free space the
// node keeps for itself.
type NodeDisk struct {
	// DefaultMB is the quota of a sandbox that asks for none (disk_mb 0).
	DefaultMB int64 `json:"default_mb"`
	// MaxMB is the largest disk_mb a create may ask for.
	MaxMB int64 `json:"max_mb"`
	// ReserveMB: creates are refused while the node's state directory's
	// filesystem (the sandbox table and the writable layers) has less than
	// this free; 0 turns the check off.
	ReserveMB int64 `json:"reserve_mb"`
}

// Disk defaults (node.disk).
const (
	DefaultDiskMB        = 5120
	DefaultDiskMaxMB     = 51200
	DefaultDiskReserveMB = 2048
)

// Overcommit defaults and bounds (node.cpu_overcommit, node.memory_overcommit).
const (
	DefaultCPUOvercommit    = 16
	DefaultMemoryOvercommit = 1
	MaxCPUOvercommit        = 1000
	MaxMemoryOvercommit     = 100
)

// Overcommit returns node.cpu_overcommit and node.memory_overcommit with
// their defaults filled in, or an error naming the key.
func (n Node) Overcommit() (cpu, mem float64, err error) {
	cpu, mem = n.CPUOvercommit, n.MemoryOvercommit
	if cpu == 0 {
		cpu = DefaultCPUOvercommit
	}
	if mem == 0 {
		mem = DefaultMemoryOvercommit
	}
	if cpu < 1 || cpu > MaxCPUOvercommit || math.IsNaN(cpu) {
		return 0, 0, errdefs.Invalid("node.cpu_overcommit", "is %g; give 1 (quotas add up to the cores) to %d times the cores, or 0 for %d", n.CPUOvercommit, MaxCPUOvercommit, DefaultCPUOvercommit)
	}
	if mem < 1 || mem > MaxMemoryOvercommit || math.IsNaN(mem) {
		return 0, 0, errdefs.Invalid("node.memory_overcommit", "is %g; give 1 (limits add up to node.memory_mb at most) to %d times it, or 0 for %d", n.MemoryOvercommit, MaxMemoryOvercommit, DefaultMemoryOvercommit)
	}
	return cpu, mem, nil
}

// MaxWarmPoolSandboxes is the largest node.warm_pool.max_sandboxes: room
// for a prewarm of a batch of a few thousand.
const MaxWarmPoolSandboxes = 4096

// WarmPool configures a node's warm pool.
type WarmPool struct {
	// Size is how many prestarted sandboxes each shape (backend, image,
	// cpu, memory, pids limit, user, workdir, network rules) keeps ready;
	// 0 turns the pool off.
	Size int `json:"size"`
	// MaxSandboxes bounds the prestarted sandboxes of all shapes together,
	// those a prewarm asks for included (1 to MaxWarmPoolSandboxes).
	MaxSandboxes int `json:"max_sandboxes"`
	// IdleTTLSec: a shape nobody created for this long loses its sandboxes.
	IdleTTLSec int64 `json:"idle_ttl_sec"`
}

// NodeNetwork configures sandbox networking: the netpolicy settings plus
// whether to use it at all.
type NodeNetwork struct {
	// Enabled: unset means on when the node can (root, nftables works),
	// with a warning when it cannot; true makes failure fatal; false leaves
	// every sandbox in an empty network namespace (no network at all).
	Enabled *bool `json:"enabled,omitempty"`
	netpolicy.Config
}

// NodeRef names a node and where it listens.
type NodeRef struct {
	ID      string `json:"id"`
	Address string `json:"address"`
}

// Default returns the configuration for one machine rooted at dataDir.
func Default(dataDir string) Config {
	return Config{
		Version: 1,
		DataDir: dataDir,
		Log:     Log{Level: "info", Format: "text"},
		APIServer: APIServer{
			Listen:          "127.0.0.1:7070",
			WatcherAddress:  "http://127.0.0.1:7072",
			PlacementSample: 2,
		},
		Watcher: Watcher{Listen: "127.0.0.1:7072", PollIntervalMS: 1000},
		Node: Node{
			ID:               "n001",
			Listen:           "127.0.0.1:7071",
			AgentPath:        "/usr/local/lib/opendsec/opendsec-agent",
			AgentIdleExitMS:  30000,
			WarmPool:         WarmPool{Size: 2, MaxSandboxes: 8, IdleTTLSec: 600},
			ImageDir:         filepath.Join(dataDir, "images"),
			ImportDir:        filepath.Join(dataDir, "import"),
			DefaultBackend:   DefaultBackendAuto,
			CPUOvercommit:    DefaultCPUOvercommit,
			MemoryOvercommit: DefaultMemoryOvercommit,
			MaxSandboxes:     1000,
			MaxPidsLimit:     sandboxspec.DefaultMaxPidsLimit,
			NofileLimit:      sandboxspec.DefaultNofileLimit,
			MaxUploadMB:      1024,
			Disk:             NodeDisk{DefaultMB: DefaultDiskMB, MaxMB: DefaultDiskMaxMB, ReserveMB: DefaultDiskReserveMB},
			MaxPaused:        DefaultMaxPaused,
			Build:            NodeBuild{TimeoutSec: DefaultBuildTimeoutSec, MaxTimeoutSec: DefaultBuildMaxTimeoutSec, MaxContextMB: DefaultBuildMaxContextMB, CPU: 2, MemoryMB: 2048},
		},
		Nodes: []NodeRef{{ID: "n001", Address: "http://127.0.0.1:7071"}},
		E2B:   E2B{Listen: "127.0.0.1:3000", Domain: "opendsec.local", Templates: map[string]string{"base": "root/base", "code-interpreter-v1": "root/code-interpreter"}},
	}
}

// Load reads path (DefaultPath if empty) over the defaults for dataDir and
// validates the result. A missing file at the default path is not an error.
func Load(path, dataDir string) (Config, error) {
	c := Default(dataDir)
	explicit := path != ""
	if !explicit {
		path = DefaultPath
	}
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&c); err != nil {
			return c, errdefs.Invalid("config", "%s: %v; fix the JSON (see docs/operations.md)", path, err)
		}
	case os.IsNotExist(err) && !explicit:
	default:
		return c, fmt.Errorf("read config: %w", err)
	}
	if dataDir != "" {
		c.DataDir = dataDir
	}
	return c, c.Validate()
}

// Validate checks the configuration; errors name the field.
func (c *Config) Validate() error {
	if c.Version != 1 {
		return errdefs.Invalid("version", "is %d; this OpenDsec reads version 1", c.Version)
	}
	if c.DataDir == "" || !filepath.IsAbs(c.DataDir) {
		return errdefs.Invalid("data_dir", "%q must be an absolute path", c.DataDir)
	}
	if err := validatePprofListen(c.Debug.PprofListen); err != nil {
		return err
	}
	if err := sandboxid.ValidNode(c.Node.ID); err != nil {
		return errdefs.Invalid("node.id", "%q must be exactly 4 characters of [a-z0-9]", c.Node.ID)
	}
	if wp := c.Node.WarmPool; wp.Size < 0 || wp.Size > 64 {
		return errdefs.Invalid("node.warm_pool.size", "is %d; give 0 (off) to 64 prestarted sandboxes per shape", wp.Size)
	} else if wp.Size > 0 && (wp.MaxSandboxes < 1 || wp.MaxSandboxes > MaxWarmPoolSandboxes) {
		return errdefs.Invalid("node.warm_pool.max_sandboxes", "is %d; give 1 to %d (a prewarm holds at most this many)", wp.MaxSandboxes, MaxWarmPoolSandboxes)
	} else if wp.Size > 0 && (wp.IdleTTLSec < 1 || wp.IdleTTLSec > 7*24*3600) {
		return errdefs.Invalid("node.warm_pool.idle_ttl_sec", "is %d; give 1 to 604800 seconds", wp.IdleTTLSec)
	}
	if c.Node.AgentIdleExitMS < 0 {
		return errdefs.Invalid("node.agent_idle_exit_ms", "is %d; give 0 (never exit) or milliseconds, e.g. 30000", c.Node.AgentIdleExitMS)
	}
	if c.Node.InitPath != "" && !filepath.IsAbs(c.Node.InitPath) {
		return errdefs.Invalid("node.init_path", "%q is not absolute; give the absolute path of opendsec-init", c.Node.InitPath)
	}
	if c.Node.ImportDir == "" || !filepath.IsAbs(c.Node.ImportDir) || filepath.Clean(c.Node.ImportDir) == "/" {
		return errdefs.Invalid("node.import_dir", "%q must be an absolute directory other than /, e.g. /var/lib/opendsec/import", c.Node.ImportDir)
	}
	if tr := c.Node.Trajectory; tr.MaxLogMB < 0 || tr.MaxLogMB > 1<<20 {
		return errdefs.Invalid("node.trajectory.max_log_mb", "is %d; give 1 to 1048576 MiB, or 0 for %d", tr.MaxLogMB, DefaultTrajectoryMaxLogMB)
	} else if tr.MaxOutputKB < 0 || tr.MaxOutputKB > 1<<20 {
		return errdefs.Invalid("node.trajectory.max_output_kb", "is %d; give 1 to 1048576 KiB, or 0 for %d", tr.MaxOutputKB, DefaultTrajectoryMaxOutputKB)
	} else if tr.MaxOutputKB<<10 > tr.MaxLogMB<<20 && tr.MaxLogMB > 0 {
		return errdefs.Invalid("node.trajectory.max_output_kb", "is %d KiB, more than node.trajectory.max_log_mb (%d MiB); one call's output must fit in a log", tr.MaxOutputKB, tr.MaxLogMB)
	} else if tr.RetentionSec < -1 {
		return errdefs.Invalid("node.trajectory.retention_sec", "is %d; give seconds, 0 for %d, or -1 to remove a log at its sandbox's stop", tr.RetentionSec, DefaultTrajectoryRetentionSec)
	}
	if c.Node.MaxUploadMB <= 0 {
		return errdefs.Invalid("node.max_upload_mb", "must be positive")
	}
	if b := c.Node.Build; b.TimeoutSec <= 0 {
		return errdefs.Invalid("node.build.timeout_sec", "is %d; give seconds, e.g. %d", b.TimeoutSec, DefaultBuildTimeoutSec)
	} else if b.MaxTimeoutSec < b.TimeoutSec {
		return errdefs.Invalid("node.build.max_timeout_sec", "is %d, below node.build.timeout_sec %d; give at least that", b.MaxTimeoutSec, b.TimeoutSec)
	} else if b.MaxContextMB <= 0 {
		return errdefs.Invalid("node.build.max_context_mb", "is %d; give a positive size in MiB, e.g. %d", b.MaxContextMB, DefaultBuildMaxContextMB)
	} else if b.CPU < 0 || b.MemoryMB < 0 || b.DiskMB < 0 {
		return errdefs.Invalid("node.build", "cpu, memory_mb and disk_mb must not be negative")
	}
	if c.Node.MaxSandboxes <= 0 {
		return errdefs.Invalid("node.max_sandboxes", "must be positive")
	}
	if d := c.Node.Disk; d.MaxMB < sandboxspec.MinDiskMB {
		return errdefs.Invalid("node.disk.max_mb", "is %d; give at least %d MiB (default %d)", d.MaxMB, sandboxspec.MinDiskMB, DefaultDiskMaxMB)
	} else if d.DefaultMB < sandboxspec.MinDiskMB || d.DefaultMB > d.MaxMB {
		return errdefs.Invalid("node.disk.default_mb", "is %d; give %d to node.disk.max_mb (%d) MiB (default %d)", d.DefaultMB, sandboxspec.MinDiskMB, d.MaxMB, DefaultDiskMB)
	} else if d.ReserveMB < 0 {
		return errdefs.Invalid("node.disk.reserve_mb", "is %d; give 0 (no reserve) or MiB to keep free (default %d)", d.ReserveMB, DefaultDiskReserveMB)
	}
	if _, _, err := c.Node.Overcommit(); err != nil {
		return err
	}
	if _, err := c.Node.MaxPausedDuration(); err != nil {
		return err
	}
	if _, err := c.Node.Limits(); err != nil {
		return err
	}
	if err := netpolicy.ValidateRuleSets(c.Node.Network.RuleSets); err != nil {
		return err
	}
	if err := sandboxspec.CheckBackend("e2b.backend", c.E2B.Backend); err != nil {
		return err
	}
	if t := c.E2B.TLS; (t.CertFile == "") != (t.KeyFile == "") {
		return errdefs.Invalid("e2b.tls", "give both cert_file and key_file, or neither (OpenDsec's own CA makes a certificate)")
	} else if t.CertFile != "" && (!filepath.IsAbs(t.CertFile) || !filepath.IsAbs(t.KeyFile)) {
		return errdefs.Invalid("e2b.tls", "cert_file and key_file must be absolute paths")
	}
	if c.APIServer.PlacementSample < 1 {
		return errdefs.Invalid("apiserver.placement_sample", "must be at least 1")
	}
	if c.Watcher.PollIntervalMS < 50 {
		return errdefs.Invalid("watcher.poll_interval_ms", "must be at least 50")
	}
	seen := map[string]bool{}
	for i, n := range c.Nodes {
		if err := sandboxid.ValidNode(n.ID); err != nil {
			return errdefs.Invalid(fmt.Sprintf("nodes[%d].id", i), "%q must be exactly 4 characters of [a-z0-9]", n.ID)
		}
		if seen[n.ID] {
			return errdefs.Invalid(fmt.Sprintf("nodes[%d].id", i), "%q is listed twice", n.ID)
		}
		seen[n.ID] = true
		if n.Address == "" {
			return errdefs.Invalid(fmt.Sprintf("nodes[%d].address", i), "is empty; give http://host:port")
		}
	}
	return nil
}

// DefaultBackendAuto is node.default_backend's default: the node picks
// microvm where that backend can run, else container, and says why.
const DefaultBackendAuto = "auto"

// DefaultMaxPaused is node.max_paused when the config does not set it.
const DefaultMaxPaused = "24h"

// BackendConfigs returns each configured backend's section, with the
// container backend's agent settings filled from node.agent_path,
// node.init_path and node.agent_idle_exit_ms where its section does not
// set them.
func (n Node) BackendConfigs() (map[string]json.RawMessage, error) {
	out := make(map[string]json.RawMessage, len(n.Backends)+1)
	for k, v := range n.Backends {
		out[k] = v
	}
	if len(out) == 0 {
		out["container"] = json.RawMessage("{}")
	}
	raw, ok := out["container"]
	if !ok {
		return out, nil
	}
	sec := map[string]any{}
	if len(raw) > 0 && string(raw) != "null" {
		if err := json.Unmarshal(raw, &sec); err != nil {
			return nil, errdefs.Invalid("node.backends.container", "%v; give an object, e.g. {\"agent_path\": \"/usr/local/lib/opendsec/opendsec-agent\"}", err)
		}
	}
	if _, set := sec["agent_path"]; !set && n.AgentPath != "" {
		sec["agent_path"] = n.AgentPath
	}
	if _, set := sec["init_path"]; !set && n.InitPath != "" {
		sec["init_path"] = n.InitPath
	}
	if _, set := sec["agent_idle_exit_ms"]; !set {
		sec["agent_idle_exit_ms"] = n.AgentIdleExitMS
	}
	b, err := json.Marshal(sec)
	if err != nil {
		return nil, fmt.Errorf("encode container backend config: %w", err)
	}
	out["container"] = b
	return out, nil
}

// MaxPausedDuration parses MaxPaused: 0 means paused sandboxes are kept
// until resumed or stopped. Empty means DefaultMaxPaused.
func (n Node) MaxPausedDuration() (time.Duration, error) {
	v := n.MaxPaused
	if v == "" {
		v = DefaultMaxPaused
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return 0, errdefs.Invalid("node.max_paused", "%q is not a duration; give e.g. \"24h\" or \"90m\", or \"0\" to keep paused sandboxes until they are resumed or stopped", n.MaxPaused)
	}
	return d, nil
}

// Limits resolves and checks the node's process and file limits
// (max_pids_limit, total_pids_limit, nofile_limit), filling defaults: an
// unset total_pids_limit is what the host can run (sandboxspec.HostPids)
// less headroom. Errors name the field and the fix.
func (n Node) Limits() (runtime.NodeLimits, error) {
	l := runtime.NodeLimits{MaxPidsLimit: n.MaxPidsLimit, TotalPidsLimit: n.TotalPidsLimit, NofileLimit: n.NofileLimit}
	if l.MaxPidsLimit == 0 {
		l.MaxPidsLimit = sandboxspec.DefaultMaxPidsLimit
	}
	if l.NofileLimit == 0 {
		l.NofileLimit = sandboxspec.DefaultNofileLimit
	}
	if l.MaxPidsLimit < sandboxspec.DefaultPidsLimit || l.MaxPidsLimit > sandboxspec.MaxPidsLimit {
		return l, errdefs.Invalid("node.max_pids_limit", "is %d; give %d (the default pids_limit) to %d processes per sandbox, or 0 for %d", n.MaxPidsLimit, sandboxspec.DefaultPidsLimit, sandboxspec.MaxPidsLimit, sandboxspec.DefaultMaxPidsLimit)
	}
	if l.NofileLimit < sandboxspec.MinNofileLimit || l.NofileLimit > sandboxspec.MaxNofileLimit {
		return l, errdefs.Invalid("node.nofile_limit", "is %d; give %d to %d open files per sandbox process, or 0 for %d", n.NofileLimit, sandboxspec.MinNofileLimit, sandboxspec.MaxNofileLimit, sandboxspec.DefaultNofileLimit)
	}
	if l.TotalPidsLimit < 0 {
		return l, errdefs.Invalid("node.total_pids_limit", "is %d; give the processes all sandboxes may have together, or 0 to derive it from kernel.pid_max", n.TotalPidsLimit)
	}
	avail, err := sandboxspec.HostPids()
	switch {
	case err != nil && l.TotalPidsLimit == 0:
		return l, errdefs.Invalid("node.total_pids_limit", "is unset and the host's pid limit cannot be read (%v); set it", err)
	case err != nil:
	case l.TotalPidsLimit == 0:
		l.TotalPidsLimit = sandboxspec.TotalPidsCeiling(avail)
	case l.TotalPidsLimit > avail:
		return l, errdefs.Invalid("node.total_pids_limit", "%d is more than this host can run (kernel.pid_max/threads-max: %d); give at most %d, or 0 for %d (which leaves the node, runc and sshd %d)", n.TotalPidsLimit, avail, avail, sandboxspec.TotalPidsCeiling(avail), avail-sandboxspec.TotalPidsCeiling(avail))
	}
	if l.MaxPidsLimit > l.TotalPidsLimit {
		return l, errdefs.Invalid("node.max_pids_limit", "%d is above node.total_pids_limit (%d, for all sandboxes together); lower it, or raise the total (kernel.pid_max)", l.MaxPidsLimit, l.TotalPidsLimit)
	}
	return l, nil
}

// validatePprofListen refuses a profiling address that is not a loopback
// IP and a port: the endpoint has no authentication.
func validatePprofListen(addr string) error {
	if addr == "" {
		return nil
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return errdefs.Invalid("debug.pprof_listen", "%q is not host:port (%v); give a loopback address, e.g. 127.0.0.1:6060", addr, err)
	}
	ip, err := netip.ParseAddr(host)
	if err != nil || !ip.IsLoopback() {
		return errdefs.Invalid("debug.pprof_listen", "%q: %q is not a loopback IP address; the profiling endpoint has no authentication, give e.g. 127.0.0.1:6060", addr, host)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return errdefs.Invalid("debug.pprof_listen", "%q: port %q must be 1 to 65535", addr, port)
	}
	return nil
}
