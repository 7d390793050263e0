package cli

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestForkPrintsTheNewIDs(t *testing.T) {
	srv := opendsectest.New(t, token)
	src := createOne(t, srv, "--task-id", "job")
	r := mustRun(t, srv, "", "sandbox", "fork", src, "--count", "3")
	ids := strings.Fields(r.stdout)
	if len(ids) != 3 || !strings.Contains(r.stderr, "3 forks of "+src) || !strings.Contains(r.stderr, "memory preserved: no") {
		t.Fatalf("fork: stdout %q stderr %q", r.stdout, r.stderr)
	}
	for _, id := range ids {
		if id == src {
			t.Fatalf("fork printed the source's ID")
		}
		if g := mustRun(t, srv, "", "sandbox", "get", id); !strings.Contains(g.stdout, src) {
			t.Errorf("get %s does not show its parent %s:\n%s", id, src, g.stdout)
		}
	}
	if n := len(srv.Sandboxes()); n != 4 {
		t.Fatalf("%d sandboxes, want 4", n)
	}
	r = mustRun(t, srv, "", "sandbox", "fork", src, "-o", "json")
	var out struct {
		Forks []struct {
			Sandbox struct {
				ID       string `json:"id"`
				ParentID string `json:"parentId"`
			} `json:"sandbox"`
		} `json:"forks"`
		SourceFrozenUs string `json:"sourceFrozenUs"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &out); err != nil || len(out.Forks) != 1 || out.Forks[0].Sandbox.ParentID != src || out.SourceFrozenUs == "" {
		t.Fatalf("fork -o json: %v %s", err, r.stdout)
	}
	for _, bad := range []string{"0", "65"} {
		if r := run(t, srv, "", "sandbox", "fork", src, "--count", bad); r.code == 0 || !strings.Contains(r.stderr, "--count") {
			t.Errorf("--count %s: %d %q", bad, r.code, r.stderr)
		}
	}
	if r := run(t, srv, "", "sandbox", "fork", "nosuch"); r.code == 0 || !strings.Contains(r.stderr, "not found") {
		t.Errorf("fork of unknown sandbox: %d %q", r.code, r.stderr)
	}
	if n := len(srv.Sandboxes()); n != 5 {
		t.Fatalf("%d sandboxes after the refused forks, want 5", n)
	}
}
