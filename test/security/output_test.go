//go:build linux

package security

import (
	"strings"
	"testing"
	"time"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// Finding 1 and the paper's `yes` incident: a process's output reaches the
// caller only up to the cap, the rest is counted and dropped, and the
// caller is told. `run_shell("timeout 60 yes")` once delivered 3.16 GB.
// Package tests: internal/apiserver TestSecurityExecOutputLimit,
// cmd/opendsecctl/internal/cli TestSecurityExecOutputLimit, the SDKs' own.
func checkExecOutputCap(t *testing.T, e *env) {
	id := e.create(t, nil)
	const limit, total = 1 << 20, 32 << 20

	// Native API, both streams.
	for _, stream := range []string{"stdout", "stderr"} {
		redir := ""
		if stream == "stderr" {
			redir = " >&2"
		}
		r, err := e.Exec(t.Context(), &opendsecv1.ExecStart{SandboxId: id, OutputLimitBytes: limit,
			Command: []string{"/bin/sh", "-c", "yes | head -c 33554432" + redir}})
		if err != nil {
			t.Fatalf("exec %s: %v", stream, err)
		}
		got, n := r.Stdout, r.Exit.GetStdoutTotalBytes()
		if stream == "stderr" {
			got, n = r.Stderr, r.Exit.GetStderrTotalBytes()
		}
		if len(got) != limit || !strings.HasPrefix(got, "y\ny\n") {
			t.Errorf("%s: got %d bytes, want the first %d", stream, len(got), limit)
		}
		if !r.Exit.GetOutputTruncated() || n != total || r.Exit.GetExitCode() != 0 {
			t.Errorf("%s: exit %+v; want output_truncated, %s_total_bytes %d, exit 0", stream, r.Exit, stream, total)
		}
	}

	// Under the cap nothing is truncated.
	r, err := e.Exec(t.Context(), &opendsecv1.ExecStart{SandboxId: id, OutputLimitBytes: limit, Command: []string{"echo", "hi"}})
	if err != nil || r.Stdout != "hi\n" || r.Exit.GetOutputTruncated() || r.Exit.GetStdoutTotalBytes() != 3 {
		t.Errorf("echo hi under the cap: %+v %v", r, err)
	}

	// The incident itself: `yes` without end, bounded by a timeout. The
	// call returns when the process ends, with the cap's worth of output.
	start := time.Now()
	r, err = e.Exec(t.Context(), &opendsecv1.ExecStart{SandboxId: id, OutputLimitBytes: limit, TimeoutSeconds: 2, Command: []string{"yes"}})
	if err != nil {
		t.Fatalf("timeout yes: %v", err)
	}
	if len(r.Stdout) != limit || !r.Exit.GetOutputTruncated() || r.Exit.GetStdoutTotalBytes() <= limit || !r.Exit.GetTimedOut() {
		t.Errorf("yes for 2 s: %d bytes kept, exit %+v; want %d kept, truncated, more produced, timed out", len(r.Stdout), r.Exit, limit)
	}
	if d := time.Since(start); d > 60*time.Second {
		t.Errorf("yes for 2 s took %s to return", d)
	}

	// The Go SDK's RunShell caps at 16 MiB by default.
	res, err := e.c.RunShell(t.Context(), id, "yes | head -c 25165824")
	if err != nil {
		t.Fatalf("RunShell: %v", err)
	}
	if len(res.Stdout) != opendsec.DefaultOutputLimit || !res.OutputTruncated || res.StdoutBytes != 24<<20 {
		t.Errorf("RunShell 24 MiB: kept %d, truncated %v, counted %d; want %d, true, %d",
			len(res.Stdout), res.OutputTruncated, res.StdoutBytes, opendsec.DefaultOutputLimit, 24<<20)
	}
}
