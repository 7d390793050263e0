//go:build linux

package security

import (
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/test/harness"
)

// deadBound is how soon after its init is killed a sandbox must be
// reported failed (the node sees it at once through the backend's Wait;
// the bound leaves room for a loaded machine).
const deadBound = 3 * time.Second

// Finding 5: after `kill -9` of a sandbox's init from the host, the API said
// RUNNING 14 s later and every exec got 503. Now the sandbox is reported
// FAILED with a reason within deadBound, and exec answers failed_precondition
// saying it died. Package tests: internal/node (exit.go's tests),
// internal/runtime/container TestWaitInitKilled; e2e:
// test/e2e TestKilledInitReportedAtOnce.
func checkDeadSandboxReported(t *testing.T, e *env) {
	id := e.create(t, &opendsecv1.SandboxSpec{TimeoutSeconds: 3600})
	e.sh(t, id, "true")
	pid := harness.InitPid(t, id)
	killed := time.Now()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var got *opendsec.Sandbox
	for {
		sb, err := e.c.GetSandbox(t.Context(), id)
		if err != nil {
			t.Fatalf("get after the kill: %v", err)
		}
		if sb.GetState() == opendsecv1.SandboxState_SANDBOX_STATE_FAILED {
			got = sb
			break
		}
		if time.Since(killed) > deadBound {
			t.Fatalf("%s after kill -9 of its init the sandbox is %s, want FAILED", deadBound, sb.GetState())
		}
		time.Sleep(10 * time.Millisecond) // polling the API for the node's view, with a deadline
	}
	if !strings.Contains(got.GetReason(), "died") {
		t.Errorf("reason %q does not say it died", got.GetReason())
	}
	_, err := e.c.RunShell(t.Context(), id, "true")
	if opendsec.CodeOf(err) != opendsec.CodeFailedPrecondition || !strings.Contains(err.Error(), "died") {
		t.Errorf("exec in the dead sandbox: %v, want failed_precondition saying it died", err)
	}
	// The answer is marked: the SDKs' own error, with the node's reason.
	reason, ok := opendsec.SandboxDied(err)
	if !errors.Is(err, opendsec.ErrSandboxDied) || !ok || "died: "+reason != got.GetReason() {
		t.Errorf("exec in the dead sandbox: %v (reason %q), want ErrSandboxDied with the reason %q", err, reason, got.GetReason())
	}
}
