package container

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
	"github.com/kernflux/opendsec/api/gen/filesystem/filesystemconnect"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestSecurityAgentPathsSandbox (issue 11, findings 4 and 8): through the
// real agent of a real sandbox, the file API (POST /files, which the E2B
// /files route reaches, and the filesystem service) refuses to replace the
// agent's socket or binary, directly, through a symlink, or by removing a
// directory that holds them, with 403 / permission_denied naming the path;
// the sandbox keeps answering afterwards.
func TestSecurityAgentPathsSandbox(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	ctx := t.Context()
	if res := sh(t, rt, spec.ID, "ln -s /run/opendsec /tmp/l && ln -s / /tmp/top"); res.ExitCode != 0 {
		t.Fatalf("make symlinks: %+v", res)
	}
	for _, p := range []string{"/run/opendsec/agent.sock", "/.opendsec/agent", "/.opendsec/init", "/tmp/l/agent.sock", "/tmp/top/run/opendsec/agent.sock"} {
		err := runtimetest.WriteFile(ctx, rt, spec.ID, p, []byte("pwned"))
		if err == nil || !strings.Contains(err.Error(), "status 403") || !strings.Contains(err.Error(), "'"+p+"'") || !strings.Contains(err.Error(), "belongs to the sandbox's agent") {
			t.Errorf("POST /files %s: %v, want 403 naming the path as the agent's", p, err)
		}
	}
	fs := filesystemconnect.NewFilesystemClient(runtimetest.AgentHTTPClient(rt, spec.ID), "http://agent")
	for _, p := range []string{"/run/opendsec/agent.sock", "/run", "/tmp/top/run", "/.opendsec"} {
		if _, err := fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: p})); connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "belongs to the sandbox's agent") {
			t.Errorf("Remove %s: %v, want permission_denied", p, err)
		}
	}
	if _, err := fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: "/etc/hostname", Destination: "/tmp/l/agent.sock"})); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("Move onto the socket through a symlink: %v, want permission_denied", err)
	}
	if _, err := fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: "/run/opendsec/d"})); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("MakeDir in the run dir: %v, want permission_denied", err)
	}

	if st, err := os.Lstat(filepath.Join(spec.StateDir, tmpDir, runDir, agentSocketName)); err != nil || st.Mode()&os.ModeSocket == 0 {
		t.Fatalf("agent socket on the node after the refused calls: %v %v", st, err)
	}
	if code, err := runtimetest.Health(ctx, rt, spec.ID); err != nil || code != http.StatusNoContent {
		t.Fatalf("health after the refused calls: %d %v", code, err)
	}
	if res := sh(t, rt, spec.ID, "echo alive"); res.ExitCode != 0 || res.Stdout != "alive\n" {
		t.Fatalf("run after the refused calls: %+v", res)
	}
	// Reads stay allowed.
	if b, err := runtimetest.ReadFile(ctx, rt, spec.ID, "/.opendsec/agent"); err != nil || len(b) == 0 {
		t.Fatalf("read the agent binary: %d bytes, %v", len(b), err)
	}
}
