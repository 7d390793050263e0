// Package sandboxspec is the one internal shape of a sandbox spec, with its
// defaults, limits and validation written once. The apiserver normalizes a
// caller's spec with it before placement; the node normalizes again (a node
// may be called directly) and adds only what depends on the node: which
// backends it has, its capacity (CheckFits), whether the backend can pause,
// and network rule sets. Mapping to and from the public protobuf message is
// in the specpb sub-package, so this package (imported by backends too)
// depends on nothing but errdefs (and reads the host's pid limits from
// /proc for the node-wide default, HostPids).
package sandboxspec

import (
	"fmt"
	"math"
	"os"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// The actions of on_timeout.
const (
	OnTimeoutStop  = "stop"
	OnTimeoutPause = "pause"
	// OnTimeoutPauseFilesystem pauses keeping only the sandbox's files
	// (its processes end; a resume starts it again on them).
	OnTimeoutPauseFilesystem = "pause_filesystem"
)

// The CPU classes of cpu_class.
const (
	CPUClassLatency    = "latency"
	CPUClassBestEffort = "best_effort"
)

// PauseOnTimeout reports whether a timeout of a sandbox with spec s pauses
// it (on_timeout "pause" or "pause_filesystem", or auto_pause in a record
// written before on_timeout existed) rather than stopping it.
func (s Spec) PauseOnTimeout() bool {
	return s.OnTimeout == OnTimeoutPause || s.OnTimeout == OnTimeoutPauseFilesystem || s.AutoPause
}

// FilesystemPauseOnTimeout reports whether that pause keeps only the
// sandbox's files (on_timeout "pause_filesystem").
func (s Spec) FilesystemPauseOnTimeout() bool { return s.OnTimeout == OnTimeoutPauseFilesystem }

// Defaults applied to a spec's zero fields, and the limits every spec must
// keep whatever node runs it. docs/api.md lists the same numbers.
const (
	DefaultCPU = 1.0
	// MinCPU is the kernel's smallest CPU quota (1 ms per 100 ms period).
	MinCPU = 0.01

	DefaultMemoryMB = 512
	// MinMemoryMB is the smallest memory limit a sandbox (its init and
	// agent) can run with.
	MinMemoryMB = 16

	DefaultTimeoutSec = 300
	// MaxTimeoutSec bounds timeout_seconds and idle_timeout_seconds (24 h).
	MaxTimeoutSec = 86400

	DefaultPidsLimit = 1024
	// MinPidsLimit: the agent's own threads count against the limit.
	MinPidsLimit = 16
	// MaxPidsLimit is the kernel's own limit on pids (PID_MAX_LIMIT on
	// 64-bit): no host runs more, so no node accepts more. Each node
	// refuses what is above its node.max_pids_limit (CheckFits).
	MaxPidsLimit = 4194304
	// DefaultMaxPidsLimit is node.max_pids_limit when the config sets none:
	// the most pids_limit one sandbox may ask for. Seven sandboxes at it fill
	// the default ceiling of a host with the kernel's default pid_max
	// (32768; see TotalPidsCeiling), so a few runaway sandboxes cannot take
	// every pid the node's sandboxes have together.
	DefaultMaxPidsLimit = 4096

	// DefaultNofileLimit is node.nofile_limit when the config sets none:
	// every sandbox process's RLIMIT_NOFILE (soft and hard). The agent holds
	// three or four descriptors per process it runs and two per port
	// tunnel, so this leaves it room for about a thousand of them.
	DefaultNofileLimit = 4096
	// MinNofileLimit and MaxNofileLimit bound node.nofile_limit: below it
	// the agent and a shell are short of descriptors; above it is the
	// kernel's fs.nr_open default (1048576).
	MinNofileLimit = 256
	MaxNofileLimit = 1 << 20

	// MinDiskMB is the smallest writable-layer quota (disk_mb). The node
	// has the default and the maximum (node.disk.default_mb, max_mb).
	MinDiskMB = 16

	// MaxEnvEntryBytes is the kernel's limit on one "KEY=VALUE" string
	// passed to exec (MAX_ARG_STRLEN, 32 pages, with its NUL).
	MaxEnvEntryBytes = 128 << 10
	// MaxEnvBytes bounds all of env together ("KEY=VALUE" strings).
	MaxEnvBytes = 1 << 20

	MaxLabelKeyLen   = 63
	MaxLabelValueLen = 256
	MaxTaskIDLen     = 128
	MaxUserLen       = 32
	MaxPathLen       = 4096

	MaxBackendOptions        = 32
	MaxBackendOptionValueLen = 4096

	// MaxEnvVars bounds how many variables env holds.
	MaxEnvVars = 4096
	// MaxLabels bounds how many labels a sandbox has (the E2B gateway adds
	// up to 4 of its own to at most 64 metadata entries).
	MaxLabels = 128
	// MaxImageLen bounds an image name.
	MaxImageLen = 1024
	// MaxRuleSets and MaxNetworkRules bound network.rule_sets and
	// network.allow (an E2B denyOut list becomes its complement: up to a
	// few thousand prefixes); MaxRuleFieldLen bounds each string in a rule
	// and a rule set's name.
	MaxRuleSets     = 64
	MaxNetworkRules = 4096
	MaxRuleFieldLen = 255

	// MaxRequestIDLen bounds a create's request_id (a batch's too: its
	// items' keys add "-<index>", which the node allows for).
	MaxRequestIDLen = 128
	// MaxNodeRequestIDLen is what the node accepts: a public request_id
	// with a batch item's "-<index>".
	MaxNodeRequestIDLen = MaxRequestIDLen + 16

	// MaxForkCount is the most sandboxes one fork makes.
	MaxForkCount = 64
)

var (
	backendRe   = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,31}$`)
	userRe      = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`)
	labelKeyRe  = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62})$`)
	optionKeyRe = regexp.MustCompile(`^[a-z][a-z0-9_.-]{0,62}$`)
)

// Spec is a sandbox spec. The JSON names are the node's sandbox table
// format: records written by any version must keep decoding, so fields are
// only ever added (with omitempty), never renamed. Owner and project are
// not part of a spec: they come from the caller's identity.
type Spec struct {
	// Backend: "container", ...; empty means the node's default.
	Backend string `json:"backend"`
	// Image is an image name, e.g. "root/py:3.11".
	Image string `json:"image"`
	// CPU in cores (fractions allowed); 0 means DefaultCPU.
	CPU float64 `json:"cpu"`
	// MemoryMB is the memory limit in MiB; 0 means DefaultMemoryMB.
	MemoryMB int64 `json:"memory_mb"`
	// TimeoutSec is the lifetime from creation; 0 means DefaultTimeoutSec.
	TimeoutSec int64 `json:"timeout_seconds"`
	// IdleSec stops the sandbox after this long without traffic; 0 is off.
	IdleSec int64             `json:"idle_timeout_seconds"`
	Env     map[string]string `json:"env,omitempty"`
	// User is the default user for processes; empty is the image's.
	User   string            `json:"user,omitempty"`
	Labels map[string]string `json:"labels,omitempty"`
	// TaskID is the task the sandbox belongs to (listing, task pause).
	TaskID string `json:"task_id,omitempty"`
	// PidsLimit is the pids cgroup's limit; 0 means DefaultPidsLimit.
	PidsLimit int64 `json:"pids_limit"`
	// DiskMB is the quota of the writable layer in MiB (bytes; inodes one
	// per 16 KiB); 0 means the node's default (node.disk.default_mb).
	DiskMB int64 `json:"disk_mb,omitempty"`
	// Workdir is the processes' working directory; empty is the image's.
	Workdir string `json:"workdir,omitempty"`
	// Network is the caller's network policy; nil means the node's default.
	Network *NetworkRules `json:"network,omitempty"`
	// AutoPause pauses instead of stopping when a timeout ends: an alias of
	// OnTimeout "pause". Normalize makes the two agree.
	AutoPause bool `json:"auto_pause,omitempty"`
	// OnTimeout is what a lifetime or idle timeout does: OnTimeoutStop or
	// OnTimeoutPause; empty means stop (or pause with AutoPause).
	OnTimeout string `json:"on_timeout,omitempty"`
	// AllowPrivilegeEscalation runs the sandbox without no_new_privs, so
	// setuid programs (sudo) work inside it (see the API's field).
	AllowPrivilegeEscalation bool `json:"allow_privilege_escalation,omitempty"`
	// CPUClass is CPUClassLatency (the default) or CPUClassBestEffort: the
	// sandbox's processes (a VM's QEMU threads) run under SCHED_IDLE with
	// the least cgroup CPU weight, on CPU time nothing else wants.
	CPUClass string `json:"cpu_class,omitempty"`
	// BackendOptions are backend-specific settings. Normalize checks only
	// their shape; the backend that runs the sandbox validates their meaning
	// (and refuses keys it does not know).
	BackendOptions map[string]string `json:"backend_options,omitempty"`
	// Snapshot is the snapshot the sandbox starts from (FromSnapshot
	// resolves it: Image is then SnapshotImage(Snapshot)).
	Snapshot string `json:"snapshot,omitempty"`
}

// NetworkRules is what a sandbox may reach: named rule sets from the node's
// configuration plus rules given directly (internal/netpolicy enforces it;
// netpolicy.Rules is this type).
type NetworkRules struct {
	RuleSets []string      `json:"rule_sets,omitempty"`
	Allow    []NetworkRule `json:"allow,omitempty"`
}

// NetworkRule allows one kind of egress. Exactly one of CIDR and Domain is
// set; netpolicy validates the values against the node's policy.
type NetworkRule struct {
	// CIDR is an IPv4 prefix ("10.1.0.0/16") or address ("10.1.2.3").
	CIDR string `json:"cidr,omitempty"`
	// Domain is an exact name ("pypi.org") or a suffix pattern
	// ("*.pythonhosted.org", which matches every name below the suffix but
	// not the suffix itself).
	Domain string `json:"domain,omitempty"`
	// Protocol is "tcp", "udp", "icmp" or empty (tcp and udp with ports,
	// every IPv4 protocol without).
	Protocol string `json:"protocol,omitempty"`
	// Ports is "443" or "8000-8100"; empty means every port. Not allowed
	// with icmp.
	Ports string `json:"ports,omitempty"`
}

// Normalize validates s against the rules that hold on every node and
// returns it with defaults filled. An empty Backend stays empty (the node
// picks its default). Errors are errdefs.Invalid naming the field and the
// fix. It never modifies s's maps or slices.
func Normalize(s Spec) (Spec, error) {
	if err := checkSnapshotSource(s); err != nil {
		return Spec{}, err
	}
	if strings.TrimSpace(s.Image) == "" {
		return Spec{}, errdefs.Invalid("image", "is empty; e.g. root/py:3.11 — list images with `opendsecctl image list`")
	}
	if len(s.Image) > MaxImageLen {
		return Spec{}, errdefs.Invalid("image", "is %d bytes; an image name has at most %d", len(s.Image), MaxImageLen)
	}
	if !utf8.ValidString(s.Image) || strings.ContainsAny(s.Image, " \t\n\x00") {
		return Spec{}, errdefs.Invalid("image", "%q is not an image name; e.g. root/py:3.11", s.Image)
	}
	if err := CheckBackend("backend", s.Backend); err != nil {
		return Spec{}, err
	}
	switch {
	case math.IsNaN(s.CPU) || math.IsInf(s.CPU, 0) || s.CPU < 0:
		return Spec{}, errdefs.Invalid("cpu", "%v must be a number of cores ≥ 0 (0 means %g)", s.CPU, DefaultCPU)
	case s.CPU == 0:
		s.CPU = DefaultCPU
	case s.CPU < MinCPU:
		return Spec{}, errdefs.Invalid("cpu", "%v is below the smallest quota; give at least %g cores, or 0 for the default %g", s.CPU, MinCPU, DefaultCPU)
	}
	switch {
	case s.MemoryMB == 0:
		s.MemoryMB = DefaultMemoryMB
	case s.MemoryMB < MinMemoryMB:
		return Spec{}, MemoryTooSmall(s.MemoryMB)
	}
	switch {
	case s.TimeoutSec < 0 || s.TimeoutSec > MaxTimeoutSec:
		return Spec{}, errdefs.Invalid("timeout_seconds", "%d must be between 0 and %d (0 means %d)", s.TimeoutSec, MaxTimeoutSec, DefaultTimeoutSec)
	case s.TimeoutSec == 0:
		s.TimeoutSec = DefaultTimeoutSec
	}
	if s.IdleSec < 0 || s.IdleSec > MaxTimeoutSec {
		return Spec{}, errdefs.Invalid("idle_timeout_seconds", "%d must be between 0 (off) and %d", s.IdleSec, MaxTimeoutSec)
	}
	switch s.OnTimeout {
	case "":
		s.OnTimeout = OnTimeoutStop
		if s.AutoPause {
			s.OnTimeout = OnTimeoutPause
		}
	case OnTimeoutPause, OnTimeoutPauseFilesystem:
		s.AutoPause = true
	case OnTimeoutStop:
		if s.AutoPause {
			return Spec{}, errdefs.Invalid("on_timeout", "is %q but auto_pause is true (an alias of on_timeout \"pause\"); set only one of them", s.OnTimeout)
		}
	default:
		return Spec{}, errdefs.Invalid("on_timeout", "%q is not an action; give \"stop\" (the default), \"pause\" or \"pause_filesystem\" (a pause that keeps only the files)", s.OnTimeout)
	}
	switch s.CPUClass {
	case "":
		s.CPUClass = CPUClassLatency
	case CPUClassLatency, CPUClassBestEffort:
	default:
		return Spec{}, errdefs.Invalid("cpu_class", "%q is not a CPU class; give \"latency\" (the default) or \"best_effort\"", s.CPUClass)
	}
	switch {
	case s.PidsLimit < 0:
		return Spec{}, errdefs.Invalid("pids_limit", "%d must be ≥ 0 (0 means the default %d)", s.PidsLimit, DefaultPidsLimit)
	case s.PidsLimit == 0:
		s.PidsLimit = DefaultPidsLimit
	case s.PidsLimit < MinPidsLimit:
		return Spec{}, errdefs.Invalid("pids_limit", "%d is too few (the agent's own threads count); give at least %d, or 0 for the default %d", s.PidsLimit, MinPidsLimit, DefaultPidsLimit)
	case s.PidsLimit > MaxPidsLimit:
		return Spec{}, errdefs.Invalid("pids_limit", "%d is more than the kernel can run (%d); ask for at most the node's node.max_pids_limit (%d unless configured), or 0 for the default %d", s.PidsLimit, MaxPidsLimit, DefaultMaxPidsLimit, DefaultPidsLimit)
	}
	if s.DiskMB < 0 || s.DiskMB > 0 && s.DiskMB < MinDiskMB {
		return Spec{}, errdefs.Invalid("disk_mb", "%d must be 0 (the node's default) or at least %d MiB", s.DiskMB, MinDiskMB)
	}
	if err := CheckEnv("env", s.Env); err != nil {
		return Spec{}, err
	}
	if err := CheckUser("user", s.User); err != nil {
		return Spec{}, err
	}
	if len(s.Labels) > MaxLabels {
		return Spec{}, errdefs.Invalid("labels", "has %d entries; at most %d are allowed", len(s.Labels), MaxLabels)
	}
	for k, v := range s.Labels {
		if !labelKeyRe.MatchString(k) {
			return Spec{}, errdefs.Invalid("labels", "key %q must be 1-%d characters of [A-Za-z0-9._/-] starting with a letter or digit", k, MaxLabelKeyLen)
		}
		if len(v) > MaxLabelValueLen || !utf8.ValidString(v) {
			return Spec{}, errdefs.Invalid("labels", "value of %q must be valid UTF-8 of at most %d bytes", k, MaxLabelValueLen)
		}
	}
	if len(s.TaskID) > MaxTaskIDLen || !utf8.ValidString(s.TaskID) || strings.ContainsRune(s.TaskID, 0) {
		return Spec{}, errdefs.Invalid("task_id", "must be valid UTF-8 without NUL of at most %d bytes", MaxTaskIDLen)
	}
	if len(s.Workdir) > MaxPathLen {
		return Spec{}, errdefs.Invalid("workdir", "is %d bytes; a path has at most %d", len(s.Workdir), MaxPathLen)
	}
	if s.Workdir != "" && (!path.IsAbs(s.Workdir) || !utf8.ValidString(s.Workdir) || strings.ContainsRune(s.Workdir, 0)) {
		return Spec{}, errdefs.Invalid("workdir", "%q must be an absolute path, e.g. /home/user", s.Workdir)
	}
	if err := checkNetworkShape(s.Network); err != nil {
		return Spec{}, err
	}
	if len(s.BackendOptions) > MaxBackendOptions {
		return Spec{}, errdefs.Invalid("backend_options", "has %d entries; at most %d are allowed", len(s.BackendOptions), MaxBackendOptions)
	}
	for k, v := range s.BackendOptions {
		if !optionKeyRe.MatchString(k) {
			return Spec{}, errdefs.Invalid("backend_options", "key %q must be 1-63 characters of [a-z0-9_.-] starting with a letter", k)
		}
		if len(v) > MaxBackendOptionValueLen || !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
			return Spec{}, errdefs.Invalid("backend_options", "value of %q must be valid UTF-8 without NUL of at most %d bytes", k, MaxBackendOptionValueLen)
		}
	}
	return s, nil
}

// MemoryTooSmall is the error for a memory_mb below MinMemoryMB (the proto
// mapping uses it for an explicit 0).
func MemoryTooSmall(mb int64) error {
	return errdefs.Invalid("memory_mb", "%d MiB is too small; give at least %d, or leave it unset for the default %d", mb, MinMemoryMB, DefaultMemoryMB)
}

// checkNetworkShape bounds a network policy's sizes; netpolicy validates
// its meaning on the node.
func checkNetworkShape(r *NetworkRules) error {
	if r == nil {
		return nil
	}
	if len(r.RuleSets) > MaxRuleSets {
		return errdefs.Invalid("network.rule_sets", "has %d entries; at most %d are allowed", len(r.RuleSets), MaxRuleSets)
	}
	for i, name := range r.RuleSets {
		if len(name) > MaxRuleFieldLen {
			return errdefs.Invalid(fmt.Sprintf("network.rule_sets[%d]", i), "is %d bytes; a rule set name has at most %d", len(name), MaxRuleFieldLen)
		}
	}
	if len(r.Allow) > MaxNetworkRules {
		return errdefs.Invalid("network.allow", "has %d rules; at most %d are allowed", len(r.Allow), MaxNetworkRules)
	}
	for i, a := range r.Allow {
		for _, f := range []struct{ name, v string }{{"cidr", a.CIDR}, {"domain", a.Domain}, {"protocol", a.Protocol}, {"ports", a.Ports}} {
			if len(f.v) > MaxRuleFieldLen {
				return errdefs.Invalid(fmt.Sprintf("network.allow[%d].%s", i, f.name), "is %d bytes; at most %d are allowed", len(f.v), MaxRuleFieldLen)
			}
		}
	}
	return nil
}

// CheckBackend refuses a backend name (field names it in the error) that
// cannot be one; empty (the node's default) is fine.
func CheckBackend(field, name string) error {
	if name != "" && !backendRe.MatchString(name) {
		return errdefs.Invalid(field, "%q is not a backend name: lowercase letters, digits, '-' and '_', e.g. container (empty means the node default)", name)
	}
	return nil
}

// CheckRequestID validates an idempotency key (request_id) of at most max
// bytes: printable UTF-8, e.g. a UUID.
func CheckRequestID(field, id string, max int) error {
	if len(id) > max {
		return errdefs.Invalid(field, "is %d bytes; at most %d are allowed (e.g. a UUID)", len(id), max)
	}
	if !utf8.ValidString(id) {
		return errdefs.Invalid(field, "is not valid UTF-8; use printable text, e.g. a UUID")
	}
	for _, r := range id {
		if r < 0x20 || r == 0x7f {
			return errdefs.Invalid(field, "contains the control character %U; use printable text, e.g. a UUID", r)
		}
	}
	return nil
}

// CheckEnv validates environment variables (spec env, exec env).
func CheckEnv(field string, env map[string]string) error {
	if len(env) > MaxEnvVars {
		return errdefs.Invalid(field, "has %d variables; at most %d are allowed", len(env), MaxEnvVars)
	}
	total := 0
	for k, v := range env {
		if k == "" || strings.ContainsAny(k, "=\x00") || !utf8.ValidString(k) {
			return errdefs.Invalid(field, "key %q must be non-empty without '=' or NUL, e.g. {\"PATH\": \"/usr/bin\"}", k)
		}
		if strings.ContainsRune(v, 0) {
			return errdefs.Invalid(field, "value of %q contains a NUL byte", k)
		}
		n := len(k) + 1 + len(v)
		if n+1 > MaxEnvEntryBytes {
			return errdefs.Invalid(field, "%q=... is %d bytes; one variable may be at most %d (the kernel's limit for exec)", k, n, MaxEnvEntryBytes-1)
		}
		total += n
	}
	if total > MaxEnvBytes {
		return errdefs.Invalid(field, "is %d bytes in all; at most %d are allowed — pass large data as a file instead", total, MaxEnvBytes)
	}
	return nil
}

// CheckUser validates a user name (spec user, exec user).
func CheckUser(field, u string) error {
	if u != "" && !userRe.MatchString(u) {
		return errdefs.Invalid(field, "%q is not a user name: use lowercase letters, digits, '_' or '-' (at most %d), e.g. \"root\" or \"user\"", u, MaxUserLen)
	}
	return nil
}

// Limits are what one node (or, for placement, the largest node) offers.
type Limits struct {
	// Where names the node in messages, e.g. "node n001".
	Where string
	// MaxCPU and MaxMemoryMB are the node's totals; 0 means unchecked.
	MaxCPU      float64
	MaxMemoryMB int64
	// MaxDiskMB is the largest disk_mb (node.disk.max_mb); 0 means
	// unchecked.
	MaxDiskMB int64
	// Backends the node offers; nil means unchecked.
	Backends []string
	// MaxPidsLimit is the node's node.max_pids_limit; 0 means unchecked.
	MaxPidsLimit int64
}

// CheckFits refuses a normalized spec the node can never run, whatever
// else runs there: a backend it lacks, more CPU or memory than it has.
// The backend must be filled in (the node's default) when Backends is set.
func CheckFits(s Spec, l Limits) error {
	where := l.Where
	if where == "" {
		where = "this node"
	}
	if l.Backends != nil && !slices.Contains(l.Backends, s.Backend) {
		return errdefs.Invalid("backend", "%q is not available on %s (available: %s)", s.Backend, where, strings.Join(l.Backends, ", "))
	}
	if l.MaxMemoryMB > 0 && s.MemoryMB > l.MaxMemoryMB {
		return errdefs.Invalid("memory_mb", "%d MiB exceeds the %d MiB of %s; ask for at most %d", s.MemoryMB, l.MaxMemoryMB, where, l.MaxMemoryMB)
	}
	if l.MaxDiskMB > 0 && s.DiskMB > l.MaxDiskMB {
		return errdefs.Invalid("disk_mb", "%d MiB exceeds the maximum of %d MiB on %s (node.disk.max_mb); ask for at most %d", s.DiskMB, l.MaxDiskMB, where, l.MaxDiskMB)
	}
	// The tolerance keeps sums of fractions (0.1+0.2) from missing an
	// exact fit.
	if l.MaxCPU > 0 && s.CPU > l.MaxCPU+1e-9 {
		return errdefs.Invalid("cpu", "%g cores exceeds the %g of %s; ask for at most %g", s.CPU, l.MaxCPU, where, l.MaxCPU)
	}
	if l.MaxPidsLimit > 0 && s.PidsLimit > l.MaxPidsLimit {
		return PidsAboveMax(s.PidsLimit, l.MaxPidsLimit, where)
	}
	return nil
}

// PidsAboveMax is the error for a pids_limit above a node's
// node.max_pids_limit (the node's admission and the backend both use it).
func PidsAboveMax(pids, maxPids int64, where string) error {
	return errdefs.Invalid("pids_limit", "%d processes exceeds the %d one sandbox may have on %s (node.max_pids_limit); ask for at most %d, or 0 for the default %d", pids, maxPids, where, maxPids, DefaultPidsLimit)
}

// Headroom the default node-wide pids ceiling leaves the host (the node,
// runc, sshd and whatever else runs there): the larger of these.
const (
	HostPidsHeadroomMin     = 2048
	HostPidsHeadroomPercent = 10
)

// TotalPidsCeiling is the default node.total_pids_limit for a host that
// can run avail pids (the smaller of kernel.pid_max and kernel.threads-max):
// avail less the larger of 2048 and 10% of it, and never less than half of
// avail. For the kernel's default pid_max 32768 that is 29492.
func TotalPidsCeiling(avail int64) int64 {
	headroom := max(HostPidsHeadroomMin, avail*HostPidsHeadroomPercent/100)
	return max(avail-headroom, avail/2)
}

// HostPids reads how many pids (tasks: processes and threads) this host can
// run at once: the smaller of /proc/sys/kernel/pid_max and
// /proc/sys/kernel/threads-max.
func HostPids() (int64, error) {
	var avail int64
	for _, f := range []string{"/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"} {
		b, err := os.ReadFile(f)
		if err != nil {
			return 0, fmt.Errorf("read %s: %w", f, err)
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil || n <= 0 {
			return 0, fmt.Errorf("parse %s: %q is not a count", f, b)
		}
		if avail == 0 || n < avail {
			avail = n
		}
	}
	return avail, nil
}
