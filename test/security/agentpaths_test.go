//go:build linux

package security

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// Finding 4: the file API could brick a sandbox — one upload to
// /run/opendsec/agent.sock replaced the node's socket with a file and every
// later call was 503 while the sandbox showed RUNNING. Writes, moves and
// removes under the agent's own paths are refused with permission_denied,
// through the native API and E2B's /files, and the sandbox keeps
// answering. Package tests: internal/agent TestSecurityAgentPaths*,
// internal/runtime/container TestSecurityAgentPathsSandbox.
func checkAgentPathsFileAPI(t *testing.T, e *env) {
	ctx := t.Context()
	id := e.create(t, nil)
	e.sh(t, id, "echo x > /tmp/src; mkdir -p /tmp/l && ln -s /run/opendsec /tmp/l/run")
	refused := func(what string, err error) {
		t.Helper()
		if opendsec.CodeOf(err) != opendsec.CodePermissionDenied {
			t.Errorf("native %s: %v, want permission_denied", what, err)
		}
	}
	for _, p := range []string{"/run/opendsec/agent.sock", "/run/opendsec/new", "/.opendsec/agent", "/.opendsec/init", "/tmp/l/run/agent.sock"} {
		_, err := e.c.WriteFile(ctx, id, p, strings.NewReader("x"), 1)
		refused("write "+p, err)
	}
	for _, p := range []string{"/run/opendsec/agent.sock", "/run/opendsec", "/.opendsec", "/.opendsec/agent", "/run"} {
		refused("remove "+p, e.c.Remove(ctx, id, p))
	}
	_, err := e.c.Move(ctx, id, "/tmp/src", "/run/opendsec/agent.sock")
	refused("move onto the socket", err)
	_, err = e.c.Move(ctx, id, "/run/opendsec/agent.sock", "/tmp/moved")
	refused("move the socket away", err)
	_, _, err = e.c.MakeDir(ctx, id, "/run/opendsec/d")
	refused("mkdir in /run/opendsec", err)

	// E2B's /files, on an E2B sandbox.
	sb := e.e2bCreate(t, true)
	for _, p := range []string{"/run/opendsec/agent.sock", "/.opendsec/agent"} {
		if st, body := e.envdUpload(t, sb, url.Values{"path": {p}}, sb.accessToken, "x"); st != http.StatusForbidden {
			t.Errorf("E2B upload to %s: %d %s, want 403", p, st, body)
		}
	}

	// Both sandboxes still answer, and the socket is still a socket.
	for _, s := range []string{id, sb.id} {
		if out := e.sh(t, s, "stat -c %F /run/opendsec/agent.sock"); out != "socket\n" {
			t.Errorf("sandbox %s: agent.sock is %q, want a socket", s, out)
		}
	}
}
