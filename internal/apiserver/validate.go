package apiserver

import (
	"math"
	"path"
	"regexp"
	"slices"
	"strings"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// Spec defaults and limits.
const (
	DefaultCPU            = 1.0
	DefaultMemoryMB       = 512
	DefaultTimeoutSeconds = 300
	MaxTimeoutSeconds     = 86400
)

// KnownBackends are the backend names OpenDsec has; whether a node offers
// one is decided by placement.
var KnownBackends = []string{"container", "microvm", "vm", "gvisor"}

var (
	userRe       = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`)
	labelKeyRe   = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62})$`)
	methodRe     = regexp.MustCompile("^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}$")
	headerNameRe = regexp.MustCompile("^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}$")
)

// normalizeSpec validates a create spec and returns a copy with defaults
// filled. Limits that depend on the nodes (cpu, memory_mb above the largest
// node, backend offered) are checked by placement.
// MinMemoryMB is the smallest memory limit a sandbox can run with.
const MinMemoryMB = 16

func normalizeSpec(in *v1.SandboxSpec) (*v1.SandboxSpec, error) {
	if in == nil {
		return nil, errdefs.Invalid("spec", "is missing; give at least an image, e.g. {\"image\": \"root/busybox\"}")
	}
	s := proto.CloneOf(in)
	if strings.TrimSpace(s.Image) == "" {
		return nil, errdefs.Invalid("image", "is empty; e.g. root/py:3.11 — list images with `opendsecctl image list`")
	}
	if !utf8.ValidString(s.Image) || strings.ContainsAny(s.Image, " \t\n\x00") {
		return nil, errdefs.Invalid("image", "%q is not an image name; e.g. root/py:3.11", s.Image)
	}
	if s.Backend != "" && !slices.Contains(KnownBackends, s.Backend) {
		return nil, errdefs.Invalid("backend", "%q is unknown; known: %s (empty means the node default)", s.Backend, strings.Join(KnownBackends, ", "))
	}
	switch {
	case math.IsNaN(s.Cpu) || math.IsInf(s.Cpu, 0) || s.Cpu < 0:
		return nil, errdefs.Invalid("cpu", "%v must be a number of cores ≥ 0 (0 means %g)", s.Cpu, DefaultCPU)
	case s.Cpu == 0:
		s.Cpu = DefaultCPU
	}
	switch {
	case s.MemoryMb == nil:
		s.MemoryMb = proto.Int64(DefaultMemoryMB)
	case *s.MemoryMb < MinMemoryMB:
		return nil, errdefs.Invalid("memory_mb", "%d MiB is too small; give at least %d, or leave it unset for the default %d", *s.MemoryMb, MinMemoryMB, DefaultMemoryMB)
	}
	switch {
	case s.TimeoutSeconds < 0 || s.TimeoutSeconds > MaxTimeoutSeconds:
		return nil, errdefs.Invalid("timeout_seconds", "%d must be between 0 and %d (0 means %d)", s.TimeoutSeconds, MaxTimeoutSeconds, DefaultTimeoutSeconds)
	case s.TimeoutSeconds == 0:
		s.TimeoutSeconds = DefaultTimeoutSeconds
	}
	if s.IdleTimeoutSeconds < 0 || s.IdleTimeoutSeconds > MaxTimeoutSeconds {
		return nil, errdefs.Invalid("idle_timeout_seconds", "%d must be between 0 (off) and %d", s.IdleTimeoutSeconds, MaxTimeoutSeconds)
	}
	if s.PidsLimit < 0 {
		return nil, errdefs.Invalid("pids_limit", "%d must be ≥ 0 (0 means the default 1024)", s.PidsLimit)
	}
	if err := validateEnv("env", s.Env); err != nil {
		return nil, err
	}
	if err := validateUser("user", s.User); err != nil {
		return nil, err
	}
	for k, v := range s.Labels {
		if !labelKeyRe.MatchString(k) {
			return nil, errdefs.Invalid("labels", "key %q must be 1-63 characters of [A-Za-z0-9._/-] starting with a letter or digit", k)
		}
		if len(v) > 256 || !utf8.ValidString(v) {
			return nil, errdefs.Invalid("labels", "value of %q must be valid UTF-8 of at most 256 bytes", k)
		}
	}
	if len(s.TaskId) > 128 || !utf8.ValidString(s.TaskId) || strings.ContainsRune(s.TaskId, 0) {
		return nil, errdefs.Invalid("task_id", "must be valid UTF-8 of at most 128 bytes")
	}
	if s.Workdir != "" && (!path.IsAbs(s.Workdir) || !validPath(s.Workdir)) {
		return nil, errdefs.Invalid("workdir", "%q must be an absolute path, e.g. /home/user", s.Workdir)
	}
	return s, nil
}

func validateEnv(field string, env map[string]string) error {
	for k, v := range env {
		if k == "" || strings.ContainsAny(k, "=\x00") || !utf8.ValidString(k) {
			return errdefs.Invalid(field, "key %q must be non-empty without '=' or NUL, e.g. {\"PATH\": \"/usr/bin\"}", k)
		}
		if strings.ContainsRune(v, 0) {
			return errdefs.Invalid(field, "value of %q contains a NUL byte", k)
		}
	}
	return nil
}

func validateUser(field, u string) error {
	if u != "" && !userRe.MatchString(u) {
		return errdefs.Invalid(field, "%q is not a user name: use lowercase letters, digits, '_' or '-' (at most 32), e.g. \"root\" or \"user\"", u)
	}
	return nil
}

func validPath(p string) bool {
	return utf8.ValidString(p) && !strings.ContainsRune(p, 0)
}

// checkPath validates a path inside a sandbox.
func checkPath(field, p string) error {
	if p == "" {
		return errdefs.Invalid(field, "is empty; give a path inside the sandbox, e.g. /tmp/data.txt")
	}
	if !utf8.ValidString(p) {
		return errdefs.Invalid(field, "%q is not valid UTF-8; paths must be UTF-8 text", p)
	}
	if strings.ContainsRune(p, 0) {
		return errdefs.Invalid(field, "contains a NUL byte")
	}
	if len(p) > 4096 {
		return errdefs.Invalid(field, "is %d bytes; the limit is 4096", len(p))
	}
	return nil
}

func checkTimeout(field string, secs int64) error {
	if secs < 0 || secs > MaxTimeoutSeconds {
		return errdefs.Invalid(field, "%d must be between 0 and %d seconds", secs, MaxTimeoutSeconds)
	}
	return nil
}

func checkSignal(sig int32) error {
	if sig != 9 && sig != 15 {
		return errdefs.Invalid("signal", "%d is not supported; use 15 (SIGTERM) or 9 (SIGKILL)", sig)
	}
	return nil
}

func checkPid(pid uint32) error {
	if pid == 0 {
		return errdefs.Invalid("pid", "is 0; give the pid from ExecStarted or ListProcesses")
	}
	return nil
}

func checkPtySize(field string, p *v1.PtySize) error {
	if p == nil {
		return errdefs.Invalid(field, "is missing; give cols and rows, e.g. {\"cols\": 80, \"rows\": 24}")
	}
	if p.Cols == 0 || p.Rows == 0 || p.Cols > 10000 || p.Rows > 10000 {
		return errdefs.Invalid(field, "%dx%d must have cols and rows between 1 and 10000", p.Cols, p.Rows)
	}
	return nil
}

func sizeLimitErr(size, limit int64) error {
	return errdefs.Invalid("size", "%d bytes exceeds the %d-byte upload limit; split the file", size, limit)
}
