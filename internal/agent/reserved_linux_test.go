package agent

import (
	"bytes"
	"mime/multipart"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
)

// TestSecurityAgentPathsFileAPI: the file API (HTTP /files and the
// filesystem.Filesystem service) refuses to write, move, remove or make
// anything at or inside the agent's own paths, named directly, through a
// symlink in the parents or as a directory that holds them, with
// permission denied naming the path; the socket stays a socket, reads of
// the agent's files still work and neighbouring paths stay writable.
func TestSecurityAgentPathsFileAPI(t *testing.T) {
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	meta := filepath.Join(dir, ".opendsec")
	run := filepath.Join(dir, "run", "opendsec")
	home := filepath.Join(dir, "home")
	for _, d := range []string{meta, run, home} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	agentBin := filepath.Join(meta, "agent")
	if err := os.WriteFile(agentBin, []byte("agent binary"), 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(run, "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for name, target := range map[string]string{"link": run, "rel": "../run/opendsec", "top": dir, "dang": filepath.Join(run, "missing")} {
		if err := os.Symlink(target, filepath.Join(home, name)); err != nil {
			t.Fatal(err)
		}
	}
	plain := filepath.Join(home, "plain.txt")
	if err := os.WriteFile(plain, []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}

	e := newEnv(t, Config{ReservedPaths: []string{meta, run}})
	ctx := t.Context()

	denied := func(what, p string, code int, body string) {
		t.Helper()
		if code != 403 || !strings.Contains(body, "permission") || !strings.Contains(body, p) || !strings.Contains(body, "belongs to the sandbox's agent") {
			t.Errorf("%s %s: %d %s, want 403 naming the path as the agent's", what, p, code, body)
		}
	}
	deniedRPC := func(what, p string, err error) {
		t.Helper()
		if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "belongs to the sandbox's agent") {
			t.Errorf("%s %s: %v, want permission_denied naming the path as the agent's", what, p, err)
		}
	}

	writes := []string{
		sock,
		filepath.Join(run, "agent.env"),
		filepath.Join(run, "new", "deep.txt"),
		agentBin,
		filepath.Join(meta, "init"),
		filepath.Join(home, "link", "agent.sock"),
		filepath.Join(home, "rel", "agent.sock"),
		filepath.Join(home, "top", "run", "opendsec", "agent.sock"),
		filepath.Join(home, "top", ".opendsec", "agent"),
		filepath.Join(home, "dang", "x.txt"),
	}
	for _, p := range writes {
		r, b := e.do(t, "POST", filesURL(p), strings.NewReader("pwned"), nil)
		denied("POST /files", p, r.StatusCode, string(b))
		// Multipart, the target in the part's filename (E2B's write_files).
		var buf bytes.Buffer
		mw := multipart.NewWriter(&buf)
		fw, _ := mw.CreateFormFile("file", p)
		fw.Write([]byte("pwned"))
		mw.Close()
		r, b = e.do(t, "POST", base+"/files", &buf, map[string]string{"Content-Type": mw.FormDataContentType()})
		denied("POST /files multipart", p, r.StatusCode, string(b))
	}
	for _, p := range []string{filepath.Join(run, "d"), filepath.Join(home, "link", "d"), filepath.Join(meta, "x", "y"), run} {
		_, err := e.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: p}))
		deniedRPC("MakeDir", p, err)
	}
	for _, p := range []string{sock, filepath.Join(home, "link", "agent.sock"), run, meta, filepath.Join(dir, "run"), dir, filepath.Join(home, "top", "run")} {
		_, err := e.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: p}))
		deniedRPC("Remove", p, err)
		_, err = e.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: p, Destination: filepath.Join(home, "moved")}))
		deniedRPC("Move from", p, err)
	}
	for _, p := range []string{sock, agentBin, filepath.Join(home, "link", "agent.sock"), filepath.Join(run, "new")} {
		_, err := e.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: plain, Destination: p}))
		deniedRPC("Move to", p, err)
	}

	if st, err := os.Lstat(sock); err != nil || st.Mode()&os.ModeSocket == 0 {
		t.Fatalf("agent socket after the refused calls: %v %v, want a socket", st, err)
	}
	if b, err := os.ReadFile(agentBin); err != nil || string(b) != "agent binary" {
		t.Fatalf("agent binary after the refused calls: %q %v", b, err)
	}
	if ents, _ := os.ReadDir(run); len(ents) != 1 {
		t.Fatalf("run dir after the refused calls holds %v, want only the socket", ents)
	}
	if _, err := os.Stat(plain); err != nil {
		t.Fatalf("moved source after the refused moves: %v", err)
	}

	// Reads stay allowed; so do changes beside the reserved paths and of a
	// symlink itself (removing it leaves its target alone).
	if r, b := e.do(t, "GET", filesURL(agentBin), nil, nil); r.StatusCode != 200 || string(b) != "agent binary" {
		t.Fatalf("GET /files of the agent binary: %d %s", r.StatusCode, b)
	}
	if r, b := e.do(t, "POST", filesURL(filepath.Join(dir, "run", "opendsecx")), strings.NewReader("ok"), nil); r.StatusCode != 200 {
		t.Fatalf("POST /files beside the run dir: %d %s", r.StatusCode, b)
	}
	if _, err := e.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: filepath.Join(home, "link")})); err != nil {
		t.Fatalf("Remove of a symlink to the run dir: %v", err)
	}
	if st, err := os.Lstat(sock); err != nil || st.Mode()&os.ModeSocket == 0 {
		t.Fatalf("agent socket after removing a symlink to its dir: %v %v", st, err)
	}
}
