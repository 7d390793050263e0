//go:build linux

package security

import (
	"strings"
	"testing"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// The paper's incident: an agent overwrote /bin/bash, which the platform
// itself called. Here overwriting the shell (and busybox, every tool of
// the image) in one sandbox changes only that sandbox's writable layer:
// another sandbox and a new one from the same image are untouched, and the
// agent — which runs its own binary, not the image's — keeps answering
// exec, files and process calls in the damaged sandbox. Running the broken
// shell is invalid_argument (exec format error), not an internal error:
// internal/agent TestStartRejectsBadInput/not_a_program.
func checkBinaryOverwrite(t *testing.T, e *env) {
	ctx := t.Context()
	a, b := e.create(t, nil), e.create(t, nil)
	sum := func(id string) string {
		t.Helper()
		return strings.Fields(e.sh(t, id, "sha256sum /bin/busybox"))[0]
	}
	before := sum(b)
	// Keep a copy to run with, then break every tool of the image in a.
	// (No /bin/busybox process may run while it is overwritten: ETXTBSY.)
	e.sh(t, a, "cp /bin/busybox /tmp/busybox")
	w, err := e.Exec(ctx, &opendsecv1.ExecStart{SandboxId: a, Command: []string{"/tmp/busybox", "sh", "-c",
		"/tmp/busybox echo '#!/tmp/busybox sh' > /bin/bash && /tmp/busybox echo pwned > /bin/busybox"}})
	if err != nil || w.Exit.GetExitCode() != 0 {
		t.Fatalf("overwrite busybox: %+v %v", w, err)
	}
	// The overwritten shell cannot run: the agent answers with a clear
	// invalid_argument (it was an internal error), and keeps working.
	if _, err := e.c.RunShell(ctx, a, "true"); opendsec.CodeOf(err) != opendsec.CodeInvalidArgument || !strings.Contains(err.Error(), "exec format error") {
		t.Errorf("exec of the overwritten /bin/sh: %v; want invalid_argument saying exec format error", err)
	}
	if r, err := e.Exec(ctx, &opendsecv1.ExecStart{SandboxId: a, Command: []string{"/tmp/busybox", "echo", "alive"}}); err != nil || r.Stdout != "alive\n" {
		t.Errorf("exec by path in the damaged sandbox: %+v %v", r, err)
	}
	var buf strings.Builder
	if _, err := e.c.ReadFile(ctx, a, "/bin/busybox", &buf); err != nil || buf.String() != "pwned\n" {
		t.Errorf("file read in the damaged sandbox: %q %v", buf.String(), err)
	}
	// The other sandbox and a new one see the image's binaries.
	for _, id := range []string{b, e.create(t, nil)} {
		if got := sum(id); got != before {
			t.Errorf("sandbox %s: /bin/busybox changed (%s, was %s)", id, got, before)
		}
		if out := e.sh(t, id, "ls /bin/bash 2>/dev/null; echo ok"); out != "ok\n" {
			t.Errorf("sandbox %s sees the other sandbox's /bin/bash: %q", id, out)
		}
	}
}
