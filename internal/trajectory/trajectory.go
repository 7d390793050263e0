// Package trajectory is a sandbox's trajectory log: every exec, file
// write and code-interpreter execution the node passed to the sandbox's agent, in order, with its request,
// its times, its exit and its output (up to a cap), so that a call carrying
// a call ID already in the log is answered from the log instead of running
// again (exactly-once calls; see docs/concepts.md "Trajectory log").
//
// A log is one append-only file per sandbox. Each entry is a frame: a 4-byte
// big-endian length, the payload's 4-byte CRC-32C, then the payload: the
// JSON of a whole Call (or of the log's Meta). A call's entries are
// upserts by sequence number: its begin (written before the process
// starts), its pid, its end. Loading keeps the last entry of each call and
// stops at the first torn or corrupt frame, which it cuts off. When the
// file passes its size bound the log is rewritten with one entry per call,
// dropping the output of the oldest calls first; the call records
// themselves are never dropped.
package trajectory

import (
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// MaxCallIDBytes bounds a call ID.
const MaxCallIDBytes = 256

// Kinds of call.
const (
	KindExec = "exec"
	// KindFileWrite is an upload through the node's POST /files (the
	// apiserver's WriteFile, E2B's files.write): the target path, the
	// content's sha256 and size, and the agent's answer.
	KindFileWrite = "file_write"
	// KindCode is a code-interpreter execution (POST /execute on the
	// interpreter's port, through a port tunnel the node serves as HTTP):
	// the code, its language or context and env vars; the interpreter's
	// result lines (NDJSON) are its output, the interpreter's answer status
	// its HTTPStatus, and an error line its Status "error" with ExitErr
	// "Name: value".
	KindCode = "code"
)

// States of a call.
const (
	// StateRunning: begun and not ended. After a node restart a running
	// call is re-attached to its process, or marked interrupted.
	StateRunning = "running"
	// StateDone: ended with its result recorded.
	StateDone = "done"
	// StateInterrupted: the node lost the call's result (it restarted while
	// the call ran and the process's end was no longer to be had). The
	// call is not run again.
	StateInterrupted = "interrupted"
)

// ValidateCallID checks a caller's call ID: at most MaxCallIDBytes of
// printable UTF-8.
func ValidateCallID(id string) error {
	if len(id) > MaxCallIDBytes {
		return errdefs.Invalid("call_id", "is %d bytes; at most %d are allowed — use a short step name such as \"<rollout>/<step>\"", len(id), MaxCallIDBytes)
	}
	if !utf8.ValidString(id) {
		return errdefs.Invalid("call_id", "must be UTF-8")
	}
	for _, r := range id {
		if r < 0x20 || r == 0x7f {
			return errdefs.Invalid("call_id", "must not contain control characters")
		}
	}
	return nil
}

// Request is what a call asked for. Two calls with the same call ID must
// have equal requests.
type Request struct {
	Kind    string            `json:"kind"`
	Command []string          `json:"command,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	Cwd     string            `json:"cwd,omitempty"`
	User    string            `json:"user,omitempty"`
	Stdin   bool              `json:"stdin,omitempty"`
	Pty     bool              `json:"pty,omitempty"`
	Tag     string            `json:"tag,omitempty"`
	// TimeoutMs is the process lifetime asked for (0: none).
	TimeoutMs int64 `json:"timeout_ms,omitempty"`
	// Path, SHA256 and Size describe a file write (the content's hash,
	// known once the whole body went through). A multipart upload lists
	// its files in Files instead (Path is then its ?path=, if any).
	Path   string    `json:"path,omitempty"`
	SHA256 string    `json:"sha256,omitempty"`
	Size   int64     `json:"size,omitempty"`
	Files  []FileRef `json:"files,omitempty"`
	// Code, Language and ContextID describe a code-interpreter execution
	// (its env vars are in Env).
	Code      string `json:"code,omitempty"`
	Language  string `json:"language,omitempty"`
	ContextID string `json:"context_id,omitempty"`
}

// FileRef is one file of a multipart upload.
type FileRef struct {
	Path   string `json:"path"`
	SHA256 string `json:"sha256"`
	Size   int64  `json:"size"`
}

// HasContent reports whether the content of a file write is known.
func (r Request) HasContent() bool { return r.SHA256 != "" || len(r.Files) > 0 }

// SameContent reports whether two file writes whose content is known
// wrote the same bytes.
func (r Request) SameContent(o Request) bool {
	return r.SHA256 == o.SHA256 && r.Size == o.Size && slices.Equal(r.Files, o.Files)
}

// Same reports whether r and o ask for the same thing. A file write's
// content hash is compared only when both are known.
func (r Request) Same(o Request) bool {
	if r.Kind != o.Kind || !slices.Equal(r.Command, o.Command) || r.Cwd != o.Cwd || r.User != o.User ||
		r.Stdin != o.Stdin || r.Pty != o.Pty || r.Tag != o.Tag || r.TimeoutMs != o.TimeoutMs || r.Path != o.Path ||
		r.Code != o.Code || r.Language != o.Language || r.ContextID != o.ContextID {
		return false
	}
	if len(r.Env) != len(o.Env) {
		return false
	}
	for k, v := range r.Env {
		if w, ok := o.Env[k]; !ok || w != v {
			return false
		}
	}
	if r.HasContent() && o.HasContent() && !r.SameContent(o) {
		return false
	}
	return true
}

// String names the request in errors: its kind and command or path.
func (r Request) String() string {
	switch r.Kind {
	case KindFileWrite:
		s := "file write " + quote(r.Path)
		if r.SHA256 != "" {
			s += fmt.Sprintf(" (%d bytes, sha256 %s)", r.Size, short(r.SHA256))
		}
		if len(r.Files) > 0 {
			parts := make([]string, len(r.Files))
			for i, f := range r.Files {
				parts[i] = fmt.Sprintf("%s (%d bytes, sha256 %s)", quote(f.Path), f.Size, short(f.SHA256))
			}
			if r.Path == "" {
				s = "file write"
			}
			s += " of " + strings.Join(parts, ", ")
		}
		return s
	case KindCode:
		s := "code " + quote(r.Code)
		if r.Language != "" {
			s += " (" + r.Language + ")"
		}
		if r.ContextID != "" {
			s += " in context " + quote(r.ContextID)
		}
		if len(r.Env) > 0 {
			s += fmt.Sprintf(" with %d env vars", len(r.Env))
		}
		return s
	default:
		parts := make([]string, len(r.Command))
		for i, a := range r.Command {
			parts[i] = quote(a)
		}
		s := "exec [" + strings.Join(parts, " ") + "]"
		if r.Cwd != "" {
			s += " in " + quote(r.Cwd)
		}
		if r.User != "" {
			s += " as " + r.User
		}
		if len(r.Env) > 0 {
			s += fmt.Sprintf(" with %d env vars", len(r.Env))
		}
		return s
	}
}

func short(h string) string {
	if len(h) > 12 {
		return h[:12]
	}
	return h
}

// quote quotes s, cut to 200 bytes.
func quote(s string) string {
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return fmt.Sprintf("%q", s)
}

// Streams of an output chunk.
const (
	Stdout = "stdout"
	Stderr = "stderr"
	PTY    = "pty"
)

// Chunk is output in the order it came.
type Chunk struct {
	Stream string `json:"s"`
	Data   []byte `json:"d"`
}

// Call is one entry of the log.
type Call struct {
	Seq    uint64  `json:"seq"`
	CallID string  `json:"call_id,omitempty"`
	State  string  `json:"state"`
	Req    Request `json:"request"`
	// Origin is the sandbox the call ran in when it is not this log's own
	// (a fork's log starts with its parent's calls).
	Origin  string    `json:"origin,omitempty"`
	Started time.Time `json:"started"`
	Ended   time.Time `json:"ended,omitzero"`
	Pid     uint32    `json:"pid,omitempty"`

	// The exit of an exec, as the agent's end event said.
	Exited   bool   `json:"exited,omitempty"`
	ExitCode int32  `json:"exit_code"`
	Status   string `json:"status,omitempty"`
	ExitErr  string `json:"exit_error,omitempty"`
	// ErrCode and ErrMsg: the call ended with an error instead of (or
	// after) an end event, e.g. deadline_exceeded for a process its
	// lifetime killed. Its replay ends with the same error.
	// End: the agent sent the process's end event.
	End     bool   `json:"end,omitempty"`
	ErrCode string `json:"error_code,omitempty"`
	ErrMsg  string `json:"error,omitempty"`
	// HTTPStatus and Body: a file write's answer; a code call's answer
	// status (and its body when not 200: the interpreter refused it).
	HTTPStatus int    `json:"http_status,omitempty"`
	Body       []byte `json:"body,omitempty"`

	Output      []Chunk `json:"output,omitempty"`
	StdoutBytes int64   `json:"stdout_bytes,omitempty"`
	StderrBytes int64   `json:"stderr_bytes,omitempty"`
	// Truncated: the output passed the call's cap and the rest was not
	// recorded. Compacted: the log's size bound dropped the recorded output.
	Truncated bool `json:"output_truncated,omitempty"`
	Compacted bool `json:"output_compacted,omitempty"`
}

func (c *Call) clone() *Call {
	d := *c
	d.Output = slices.Clone(c.Output)
	return &d
}

// outputSize is the bytes of output c holds.
func (c *Call) outputSize() int64 {
	var n int64
	for _, ch := range c.Output {
		n += int64(len(ch.Data))
	}
	return n + int64(len(c.Body))
}

// Result is how a call ended.
type Result struct {
	End      bool
	Exited   bool
	ExitCode int32
	Status   string
	ExitErr  string
	ErrCode  string
	ErrMsg   string
	// Interrupted marks the result lost (see StateInterrupted).
	Interrupted bool
	// OutputLost: output the process wrote is missing from the record (a
	// node restarted while it ran: what came before is gone); the call is
	// marked Truncated so no replay passes it off as whole.
	OutputLost bool
	HTTPStatus int
	Body       []byte
	// SHA256 and Size (or Files) complete a file write's request once its
	// body was read.
	SHA256 string
	Size   int64
	Files  []FileRef
}

// Meta heads a log.
type Meta struct {
	SandboxID string `json:"sandbox_id"`
	// Owner and Project own the sandbox: the log of a stopped sandbox is
	// shown to them (and admins) only.
	Owner   string `json:"owner,omitempty"`
	Project string `json:"project,omitempty"`
	// ParentID is the sandbox this one was forked or restored from;
	// ForkSeq the last of the parent's calls the log starts with.
	ParentID string    `json:"parent_id,omitempty"`
	ForkSeq  uint64    `json:"fork_seq,omitempty"`
	Created  time.Time `json:"created"`
	// Closed is when the sandbox stopped (zero while it lives).
	Closed time.Time `json:"closed,omitzero"`
}

// Headers of the trajectory log on the agent proxy's process.Process/Start,
// POST /files and the code interpreter's POST /execute (docs/api.md
// "Trajectory log"). Any client of the node's agent path may send them:
// the apiserver, the E2B gateway, envd SDKs.
const (
	// CallIDHeader carries the caller's call ID: a call whose ID is in the
	// sandbox's log is answered from it (replayed) or joined, never run
	// again.
	CallIDHeader = "Opendsec-Call-Id"
	// OutputLimitHeader is the call's output cap per stream in bytes; the
	// log records at most this (and at most node.trajectory.max_output_kb).
	OutputLimitHeader = "Opendsec-Output-Limit"
	// The answer's headers: the call's sequence number in the log, and
	// "true" in ReplayedHeader or JoinedHeader when the call did not start
	// a process.
	CallSeqHeader  = "Opendsec-Call-Seq"
	ReplayedHeader = "Opendsec-Replayed"
	JoinedHeader   = "Opendsec-Joined"
	// FilePathHeader on a POST /files names the path a write is logged
	// under when the caller writes elsewhere first (the apiserver uploads
	// to a temporary file it then moves over this path).
	FilePathHeader = "Opendsec-File-Path"
	// OutputTruncatedHeader is "true" on a replayed code call whose
	// recorded output was cut at its cap (or dropped by compaction): the
	// replay ends at the last whole line recorded.
	OutputTruncatedHeader = "Opendsec-Output-Truncated"
)

// Path is the node's route under /agent/<id>/ that streams the
// sandbox's trajectory log as JSON lines: {"meta": Meta} then one
// {"call": Call} per call. ?output=0 leaves the output out.
const Path = "_opendsec/trajectory"

// Line is one line of Path's answer.
type Line struct {
	Meta *Meta `json:"meta,omitempty"`
	Call *Call `json:"call,omitempty"`
}
