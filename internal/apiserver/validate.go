package apiserver

import (
	"regexp"
	"strings"
	"unicode/utf8"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
)

// Spec defaults and limits are sandboxspec's (internal/sandboxspec).

var (
	methodRe     = regexp.MustCompile("^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}$")
	headerNameRe = regexp.MustCompile("^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}$")
)

// normalizeSpec validates a create spec and returns a copy with defaults
// filled (sandboxspec, the same rules the node applies). Limits that depend
// on the nodes (cpu, memory_mb above the largest node, backend offered) are
// checked by placement.
func normalizeSpec(in *v1.SandboxSpec) (*v1.SandboxSpec, error) {
	s, err := specpb.FromProto(in)
	if err != nil {
		return nil, err
	}
	if s, err = sandboxspec.Normalize(s); err != nil {
		return nil, err
	}
	// Which backends exist is the nodes' word: placement refuses one no
	// node offers, naming those that are (backends register per build).
	return specpb.ToProto(s), nil
}

func validateEnv(field string, env map[string]string) error {
	return sandboxspec.CheckEnv(field, env)
}

func validateUser(field, u string) error {
	return sandboxspec.CheckUser(field, u)
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
	if secs < 0 || secs > sandboxspec.MaxTimeoutSec {
		return errdefs.Invalid(field, "%d must be between 0 and %d seconds", secs, sandboxspec.MaxTimeoutSec)
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

// sizeLimitErr refuses an upload above the limit (node.max_upload_mb): a
// limit, not a malformed request, so resource_exhausted, naming the field
// and the limit.
func sizeLimitErr(size, limit int64) error {
	return errdefs.New(errdefs.ErrResourceExhausted, "size: %d bytes exceeds the upload limit of %d bytes (%d MiB, node.max_upload_mb); split the file", size, limit, limit>>20)
}
