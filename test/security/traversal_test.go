//go:build linux

package security

import (
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Held in the red-team pass: paths in the file API cannot leave the
// sandbox. `..` climbs stop at the sandbox's root (the agent resolves
// paths inside the sandbox's mount namespace), symlinks resolve inside it,
// a write meant for the host lands in the sandbox, and sandbox IDs that are
// paths are refused. Package tests: internal/agent (files tests),
// internal/node and internal/apiserver ID validation.
func checkFilePathTraversal(t *testing.T, e *env) {
	ctx := t.Context()
	id := e.create(t, nil)
	// A host file the sandbox must never read.
	hostDir := t.TempDir()
	hostFile := filepath.Join(hostDir, "host-secret")
	const content = "HOST-CONTENT-not-for-sandboxes"
	if err := os.WriteFile(hostFile, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	e.sh(t, id, "ln -s / /tmp/rootlink && ln -s ../../../../../.. /tmp/uplink")
	for _, p := range []string{
		"/../../../../../.." + hostFile,
		"../../../../../../.." + hostFile,
		"/tmp/uplink" + hostFile,
		"/tmp/rootlink/.." + hostFile,
		"/proc/1/root/../../.." + hostFile,
		"/proc/self/cwd/../../../.." + hostFile,
	} {
		var buf strings.Builder
		_, err := e.c.ReadFile(ctx, id, p, &buf)
		if err == nil || strings.Contains(buf.String(), content) {
			t.Errorf("read %s: %q %v; want not_found inside the sandbox", p, buf.String(), err)
		}
	}
	// A write aimed at the host lands in the sandbox (or is refused).
	name := "written-" + filepath.Base(hostDir)
	e.c.WriteFile(ctx, id, "/../../../../../../tmp/"+name, strings.NewReader("x"), 1)
	if _, err := os.Stat(filepath.Join("/tmp", name)); err == nil {
		os.Remove(filepath.Join("/tmp", name))
		t.Errorf("a file API write with ../ created /tmp/%s on the host", name)
	}
	// Reading /etc/passwd through ../ gives the sandbox's own.
	var buf strings.Builder
	if _, err := e.c.ReadFile(ctx, id, "/../../../etc/passwd", &buf); err != nil || !strings.Contains(buf.String(), "user:x:1000:1000") {
		t.Errorf("read /../../../etc/passwd: %v; want the sandbox's passwd, got %q", err, buf.String())
	}

	// Sandbox IDs that are paths.
	for _, bad := range []string{"../" + id, id + "/../x", "..", "%2e%2e"} {
		if _, err := e.c.GetSandbox(ctx, bad); err == nil {
			t.Errorf("get sandbox %q succeeded", bad)
		}
		var b strings.Builder
		if _, err := e.c.ReadFile(ctx, bad, "/etc/passwd", &b); err == nil {
			t.Errorf("read a file of sandbox %q succeeded: %q", bad, b.String())
		}
	}

	// E2B /files with ../ in the path and in the sandbox ID.
	sb := e.e2bCreate(t, true)
	st, body := e.envd(t, sb, http.MethodGet, "/files?"+url.Values{"path": {"/../../../../.." + hostFile}}.Encode(), sb.accessToken, "", nil)
	if st == http.StatusOK || strings.Contains(body, content) {
		t.Errorf("E2B read of a host file through ../: %d %q", st, body)
	}
	bad := e2bSandbox{id: "../" + sb.id, accessToken: sb.accessToken}
	if st, body := e.envd(t, bad, http.MethodGet, "/files?path=/etc/passwd", sb.accessToken, "", nil); st == http.StatusOK {
		t.Errorf("E2B with sandbox ID %q: %d %q", bad.id, st, body)
	}
}
