package agent

import (
	"encoding/base64"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"connectrpc.com/connect"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/internal/testutil"
)

// sandboxEtc writes passwd and group files with a user "user" (uid 1000,
// gid 1000, also in group "extra" 1001) whose home is in a temp dir.
func sandboxEtc(t *testing.T) (etc, home string) {
	t.Helper()
	root, err := os.MkdirTemp("", "agu") // t.TempDir's parent is 0700
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	os.Chmod(root, 0o755)
	etc = filepath.Join(root, "etc")
	home = filepath.Join(root, "home", "user")
	os.MkdirAll(etc, 0o755)
	os.MkdirAll(home, 0o755)
	os.Chown(home, 1000, 1000)
	os.WriteFile(filepath.Join(etc, "passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::"+home+":/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(etc, "group"), []byte("root:x:0:\nuser:x:1000:\nextra:x:1001:user\n"), 0o644)
	return etc, home
}

func TestRunsAsSelectedUser(t *testing.T) {
	testutil.RequiresRoot(t)
	etc, home := sandboxEtc(t)
	e := newEnv(t, Config{EtcDir: etc, DefaultUser: "user"})
	ctx := t.Context()

	// Default user (no Authorization header): user, in its home.
	r := e.run(t, `echo "$(id -u) $(id -g) $(id -G) $HOME $USER $LOGNAME"; pwd`)
	if want := "1000 1000 1000 1001 " + home + " user user\n" + home + "\n"; r.stdout.String() != want {
		t.Fatalf("default user: %q, want %q", r.stdout.String(), want)
	}
	// Basic auth selects root.
	req := startReq("/bin/sh", "-c", "id -u")
	req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte("root:")))
	s, err := e.proc.Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, s); r.stdout.String() != "0\n" {
		t.Fatalf("root: %q", r.stdout.String())
	}
	// Relative cwd resolves under the user's home.
	os.Mkdir(filepath.Join(home, "work"), 0o755)
	cwd := "work"
	req = startReq("/bin/pwd")
	req.Msg.Process.Cwd = &cwd
	s, err = e.proc.Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, s); r.stdout.String() != filepath.Join(home, "work")+"\n" {
		t.Fatalf("relative cwd: %q", r.stdout.String())
	}

	// Files written for the user are owned by it; relative paths are in home.
	resp, b := e.do(t, "POST", base+"/files?"+url.Values{"path": {"sub/out.txt"}, "username": {"user"}}.Encode(), strings.NewReader("hi"), map[string]string{"Content-Type": "application/octet-stream"})
	if resp.StatusCode != 200 || !strings.Contains(string(b), filepath.Join(home, "sub", "out.txt")) {
		t.Fatalf("upload: %s %s", resp.Status, b)
	}
	for _, p := range []string{filepath.Join(home, "sub"), filepath.Join(home, "sub", "out.txt")} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if sys := st.Sys().(*syscall.Stat_t); sys.Uid != 1000 || sys.Gid != 1000 {
			t.Fatalf("%s owned by %d:%d", p, sys.Uid, sys.Gid)
		}
	}
	stat, err := e.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: "sub/out.txt"}))
	if err != nil {
		t.Fatal(err)
	}
	if en := stat.Msg.Entry; en.Owner != "user" || en.Group != "user" || en.Path != filepath.Join(home, "sub", "out.txt") {
		t.Fatalf("stat: %v", en)
	}
	// MakeDir as the user makes user-owned directories.
	md, err := e.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: "~/a/b"}))
	if err != nil {
		t.Fatal(err)
	}
	if md.Msg.Entry.Owner != "user" || md.Msg.Entry.Path != filepath.Join(home, "a", "b") {
		t.Fatalf("makedir: %v", md.Msg.Entry)
	}
	// The user cannot read root-only files through a process.
	os.WriteFile(filepath.Join(etc, "secret"), []byte("s"), 0o600)
	r = e.run(t, "cat "+filepath.Join(etc, "secret"))
	if r.end.ExitCode == 0 {
		t.Fatalf("user read a root-only file: %v", r.end)
	}
	_ = process.Signal_SIGNAL_SIGKILL
}
