package agent

import (
	"fmt"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/interpreter"
)

// Defaults for Config fields left zero.
const (
	DefaultUser           = "root"
	DefaultMaxOutputBytes = 1 << 20 // retained output per process
	DefaultMaxUploadBytes = 1 << 30 // one POST /files body
	DefaultEtcDir         = "/etc"
	maxChunk              = 32 << 10 // one output event
)

// Config configures an Agent. The zero value is usable.
type Config struct {
	// DefaultUser runs processes and owns files when a request names no user.
	DefaultUser string
	// DefaultWorkdir is the cwd of processes started without one; empty means
	// the user's home.
	DefaultWorkdir string
	// MaxOutputBytes caps the output retained per process (oldest dropped).
	MaxOutputBytes int
	// MaxUploadBytes caps one uploaded file (POST /files).
	MaxUploadBytes int64
	// AccessToken, when set, is required as X-Access-Token (or a v1_ file
	// URL signature) on every route but /health.
	AccessToken string
	// EtcDir holds the passwd and group files users are resolved from.
	EtcDir string
	// Env is the sandbox-wide environment ("K=V"), given to every process and
	// served by GET /envs. Nil means the agent's own environment.
	Env []string
	// IdleTrimAfter is how long the agent waits after its last request ends
	// before it returns the memory it freed to the OS (once per idle spell).
	// Zero means DefaultIdleTrimAfter; negative disables it.
	IdleTrimAfter time.Duration
	// InterpreterPath is the code interpreter's runner, started with the
	// image's python3 on the first tunnel to its port. Empty means
	// interpreter.PathInSandbox.
	InterpreterPath string
	// InterpreterPort is the port the code interpreter listens on (on
	// 127.0.0.1); zero means interpreter.Port.
	InterpreterPort int
	// ReservedPaths are the agent's own paths: the file API refuses to write,
	// move, remove or make anything at or inside them (InterpreterPath
	// included). Nil means DefaultReservedPaths.
	ReservedPaths []string
	// Init makes the agent act as PID 1: reap every child (orphans included)
	// and bring up the loopback interface.
	Init bool
	// Subreaper makes the agent a child subreaper (PR_SET_CHILD_SUBREAPER)
	// with Init's duties: the server under opendsec-init, which is PID 1.
	Subreaper bool
}

func (c *Config) setDefaults() {
	if c.DefaultUser == "" {
		c.DefaultUser = DefaultUser
	}
	if c.MaxOutputBytes == 0 {
		c.MaxOutputBytes = DefaultMaxOutputBytes
	}
	if c.MaxUploadBytes == 0 {
		c.MaxUploadBytes = DefaultMaxUploadBytes
	}
	if c.IdleTrimAfter == 0 {
		c.IdleTrimAfter = DefaultIdleTrimAfter
	}
	if c.InterpreterPath == "" {
		c.InterpreterPath = interpreter.PathInSandbox
	}
	if c.InterpreterPort == 0 {
		c.InterpreterPort = interpreter.Port
	}
	if c.EtcDir == "" {
		c.EtcDir = DefaultEtcDir
	}
	if c.ReservedPaths == nil {
		c.ReservedPaths = DefaultReservedPaths
	}
}

// Validate reports the first invalid field.
func (c *Config) Validate() error {
	if c.MaxOutputBytes < maxChunk {
		return errdefs.Invalid("max_output_bytes", "is %d; must be at least %d", c.MaxOutputBytes, maxChunk)
	}
	if c.MaxUploadBytes < 0 {
		return errdefs.Invalid("max_upload_bytes", "is %d; must not be negative", c.MaxUploadBytes)
	}
	if c.InterpreterPort < 0 || c.InterpreterPort > 65535 {
		return errdefs.Invalid("interpreter_port", "is %d; use 1..65535", c.InterpreterPort)
	}
	if c.DefaultWorkdir != "" && c.DefaultWorkdir[0] != '/' {
		return errdefs.Invalid("default_workdir", "%q is not absolute; give an absolute path", c.DefaultWorkdir)
	}
	return nil
}

func (c *Config) String() string {
	return fmt.Sprintf("user=%s workdir=%q max_output=%d max_upload=%d init=%t subreaper=%t token=%t",
		c.DefaultUser, c.DefaultWorkdir, c.MaxOutputBytes, c.MaxUploadBytes, c.Init, c.Subreaper, c.AccessToken != "")
}
