package cli

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

// TestSnapshotCommands: sandbox snapshot, snapshot list/get/rm and sandbox
// create --snapshot, against the fake; bad input is a usage or API error
// naming the flag or field, and makes nothing.
func TestSnapshotCommands(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv)
	mustRun(t, srv, "saved", "files", "cp", "-", id+":/tmp/state.txt")

	r := mustRun(t, srv, "", "sandbox", "snapshot", id, "--name", "after-setup", "-o", "json")
	var snap struct {
		ID              string `json:"id"`
		Name            string `json:"name"`
		SourceSandboxID string `json:"sourceSandboxId"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &snap); err != nil || snap.Name != "after-setup" || snap.SourceSandboxID != id {
		t.Fatalf("snapshot -o json = %q (%v)", r.stdout, err)
	}
	if r := mustRun(t, srv, "", "snapshot", "list"); !strings.Contains(r.stdout, snap.ID) || !strings.Contains(r.stdout, "after-setup") || !strings.HasPrefix(r.stdout, "ID") {
		t.Fatalf("snapshot list = %q", r.stdout)
	}
	from := strings.Fields(mustRun(t, srv, "", "sandbox", "create", "--snapshot", snap.ID, "--count", "2", "-q").stdout)
	if len(from) != 2 {
		t.Fatalf("create --snapshot --count 2 printed %v", from)
	}
	for _, f := range from {
		if got, ok := srv.File(f, "/tmp/state.txt"); !ok || string(got) != "saved" {
			t.Fatalf("sandbox %s from the snapshot has /tmp/state.txt = %q (%v)", f, got, ok)
		}
	}
	n := len(srv.Sandboxes())
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"sandbox", "create", "--image", "root/busybox", "--snapshot", snap.ID}, "--snapshot: give either --image or --snapshot"},
		{[]string{"sandbox", "create", "--snapshot", "n001nope"}, "snapshot: snapshot n001nope not found"},
		{[]string{"sandbox", "snapshot", id, "--name", "a/b"}, "name:"},
		{[]string{"sandbox", "snapshot", id, "--name", "after-setup"}, "already have a snapshot"},
		{[]string{"sandbox", "snapshot"}, "ID"},
		{[]string{"snapshot", "rm"}, "give at least one snapshot ID"},
	} {
		r := run(t, srv, "", tc.args...)
		if r.code != 1 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 1 and %q", tc.args, r.code, r.stderr, tc.want)
		}
	}
	if len(srv.Sandboxes()) != n {
		t.Fatalf("bad input made sandboxes: %d → %d", n, len(srv.Sandboxes()))
	}
	if r := mustRun(t, srv, "", "snapshot", "rm", snap.ID); strings.TrimSpace(r.stdout) != snap.ID {
		t.Fatalf("snapshot rm printed %q", r.stdout)
	}
	if r := run(t, srv, "", "snapshot", "get", snap.ID); r.code != 1 || !strings.Contains(r.stderr, "not found") {
		t.Fatalf("get after rm: exit %d, %q", r.code, r.stderr)
	}
}
