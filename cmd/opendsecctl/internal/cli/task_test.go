package cli

import (
	"strings"
	"testing"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestTaskPauseReclaimResumeList(t *testing.T) {
	srv := opendsectest.New(t, token)
	a := createOne(t, srv, "--task-id", "job", "--label", "shard=1")
	b := createOne(t, srv, "--task-id", "job", "--label", "shard=2")
	createOne(t, srv, "--task-id", "other")
	r := mustRun(t, srv, "", "task", "pause", "job", "--reclaim")
	for _, want := range []string{a, b, "0.9MiB", "FREED"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("task pause --reclaim output lacks %q:\n%s", want, r.stdout)
		}
	}
	if !strings.Contains(r.stderr, "2 sandboxes paused, 0 failed, 1.9MiB freed") {
		t.Fatalf("task pause summary: %q", r.stderr)
	}
	r = mustRun(t, srv, "", "task", "list")
	if !strings.Contains(r.stdout, "TASK") || !hasRow(r.stdout, "job", "2", "0", "2", "0") || !hasRow(r.stdout, "other", "1", "1", "0", "0") {
		t.Fatalf("task list:\n%s", r.stdout)
	}
	mustRun(t, srv, "", "task", "resume", "job")
	for _, sb := range srv.Sandboxes() {
		if sb.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
			t.Fatalf("after task resume %s is %s", sb.GetId(), sb.GetState())
		}
	}
	r = mustRun(t, srv, "", "task", "pause", "job", "--label", "shard=2")
	if strings.TrimSpace(r.stdout) != b {
		t.Fatalf("task pause by label: %q, want %s", r.stdout, b)
	}
	if r := run(t, srv, "", "task", "pause", "nosuch", "--reclaim"); r.code == 0 || !strings.Contains(r.stderr, "nosuch") {
		t.Fatalf("pause of an unknown task: %d %q", r.code, r.stderr)
	}
	if r := run(t, srv, "", "task", "pause"); r.code == 0 || !strings.Contains(r.stderr, "TASK") {
		t.Fatalf("pause without a task: %d %q", r.code, r.stderr)
	}
}

// hasRow reports whether out has a line with exactly these fields.
func hasRow(out string, fields ...string) bool {
	for _, line := range strings.Split(out, "\n") {
		if strings.Join(strings.Fields(line), " ") == strings.Join(fields, " ") {
			return true
		}
	}
	return false
}
