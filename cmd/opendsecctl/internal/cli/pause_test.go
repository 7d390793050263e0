package cli

import (
	"strings"
	"testing"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestPauseResumeMetrics(t *testing.T) {
	srv := opendsectest.New(t, token)
	a := createOne(t, srv, "--task-id", "job", "--auto-pause")
	b := createOne(t, srv, "--task-id", "job")
	other := createOne(t, srv, "--task-id", "other")
	if !srv.Sandboxes()[0].GetSpec().GetAutoPause() {
		t.Fatalf("--auto-pause not sent")
	}
	c := createOne(t, srv, "--task-id", "other", "--on-timeout", "pause")
	for _, sb := range srv.Sandboxes() {
		if sb.GetId() == c && sb.GetSpec().GetOnTimeout() != "pause" {
			t.Fatalf("--on-timeout pause sent as %q", sb.GetSpec().GetOnTimeout())
		}
	}
	state := func(id string) opendsecv1.SandboxState {
		for _, sb := range srv.Sandboxes() {
			if sb.GetId() == id {
				return sb.GetState()
			}
		}
		t.Fatalf("no sandbox %s", id)
		return 0
	}
	r := mustRun(t, srv, "", "sandbox", "pause", a)
	if strings.TrimSpace(r.stdout) != a || state(a) != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("pause: %q, state %s", r.stdout, state(a))
	}
	r = mustRun(t, srv, "", "sandbox", "set-timeout", a, "10m")
	if want := a + " is paused; it expires 10m0s after it resumes\n"; r.stdout != want || state(a) != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("set-timeout of a paused sandbox: %q (state %s), want %q", r.stdout, state(a), want)
	}
	r = mustRun(t, srv, "", "sandbox", "metrics", a)
	for _, want := range []string{"paused", "10.0% of 1 cores", "1.0MiB of 512.0MiB", "PIDS"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("metrics output lacks %q:\n%s", want, r.stdout)
		}
	}
	mustRun(t, srv, "", "sandbox", "resume", a, "--timeout", "10m")
	if state(a) != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("resume: state %s", state(a))
	}
	mustRun(t, srv, "", "sandbox", "pause", "--filesystem-only", a)
	for _, sb := range srv.Sandboxes() {
		if sb.GetId() == a && (sb.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED || !sb.GetPausedFilesystem()) {
			t.Fatalf("pause --filesystem-only: %v, want paused keeping files", sb)
		}
	}
	if r := run(t, srv, "", "sandbox", "pause", "--filesystem-only", "--task", "job"); r.code == 0 || !strings.Contains(r.stderr, "--filesystem-only") {
		t.Fatalf("batch pause --filesystem-only: exit %d %q, want a usage error naming the flag", r.code, r.stderr)
	}
	mustRun(t, srv, "", "sandbox", "resume", a)
	r = mustRun(t, srv, "", "sandbox", "pause", "--task", "job")
	if got := strings.Fields(r.stdout); len(got) != 2 || !strings.Contains(r.stderr, "2 sandboxes paused, 0 failed") {
		t.Fatalf("batch pause: %q %q", r.stdout, r.stderr)
	}
	if state(a) != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED || state(b) != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED || state(other) != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after batch pause: %s %s %s", state(a), state(b), state(other))
	}
	mustRun(t, srv, "", "sandbox", "resume", "--task", "job")
	if state(b) != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("batch resume: %s", state(b))
	}

	if r := run(t, srv, "", "sandbox", "pause"); r.code == 0 || !strings.Contains(r.stderr, "give sandbox IDs, --task or --label") {
		t.Fatalf("pause without target: %d %q", r.code, r.stderr)
	}
	if r := run(t, srv, "", "sandbox", "pause", "nosuch"); r.code == 0 || !strings.Contains(r.stderr, "not found") {
		t.Fatalf("pause of unknown sandbox: %d %q", r.code, r.stderr)
	}
	if r := run(t, srv, "", "sandbox", "resume", a, "--timeout", "soon"); r.code == 0 || !strings.Contains(r.stderr, "--timeout") {
		t.Fatalf("bad timeout: %d %q", r.code, r.stderr)
	}
}

func TestCreateCPUClass(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv, "--cpu-class", "best_effort")
	for _, sb := range srv.Sandboxes() {
		if sb.GetId() == id && sb.GetSpec().GetCpuClass() != "best_effort" {
			t.Fatalf("--cpu-class best_effort sent as %q", sb.GetSpec().GetCpuClass())
		}
	}
}
