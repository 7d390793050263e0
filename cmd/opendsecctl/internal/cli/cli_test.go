package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

const token = "cli-token"

type result struct {
	code           int
	stdout, stderr string
}

// run runs opendsecctl against srv with the token from the environment.
func run(t *testing.T, srv *opendsectest.Server, stdin string, args ...string) result {
	t.Helper()
	t.Setenv("OPENDSEC_ENDPOINT", srv.Addr())
	t.Setenv("OPENDSEC_TOKEN", token)
	var out, errb bytes.Buffer
	code := Main(args, strings.NewReader(stdin), &out, &errb)
	return result{code: code, stdout: out.String(), stderr: errb.String()}
}

func mustRun(t *testing.T, srv *opendsectest.Server, stdin string, args ...string) result {
	t.Helper()
	r := run(t, srv, stdin, args...)
	if r.code != 0 {
		t.Fatalf("opendsecctl %s: exit %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	}
	return r
}

func createOne(t *testing.T, srv *opendsectest.Server, extra ...string) string {
	t.Helper()
	r := mustRun(t, srv, "", append([]string{"sandbox", "create", "--image", "root/busybox", "-q"}, extra...)...)
	return strings.TrimSpace(r.stdout)
}

func TestCreateOutputs(t *testing.T) {
	srv := opendsectest.New(t, token)
	r := mustRun(t, srv, "", "sandbox", "create", "--image", "root/py:3.11", "--cpu", "0.5", "--memory-mb", "256",
		"--timeout", "10m", "--idle-timeout", "30", "--env", "A=1", "--env", "B=x=y", "--label", "team=rl", "--task-id", "t1", "--user", "app")
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[0], "STATE") {
		t.Fatalf("table = %q", r.stdout)
	}
	for _, want := range []string{"n001sb0001", "running", "root/py:3.11", "0.5", "256MiB", "team=rl"} {
		if !strings.Contains(lines[1], want) {
			t.Errorf("row %q lacks %q", lines[1], want)
		}
	}
	sp := srv.Sandboxes()[0].Spec
	if sp.TimeoutSeconds != 600 || sp.IdleTimeoutSeconds != 30 || sp.Env["B"] != "x=y" || sp.TaskId != "t1" || sp.User != "app" || sp.Cpu != 0.5 {
		t.Fatalf("spec sent = %v", sp)
	}

	r = mustRun(t, srv, "", "sandbox", "create", "--image", "root/busybox", "-o", "json")
	var sb opendsecv1.Sandbox
	if err := protojson.Unmarshal([]byte(r.stdout), &sb); err != nil {
		t.Fatalf("json output %q: %v", r.stdout, err)
	}
	if sb.Id != "n001sb0002" || sb.State != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("json sandbox = %v", &sb)
	}
}

func TestCreateBadInput(t *testing.T) {
	srv := opendsectest.New(t, token)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"sandbox", "create"}, "error: --image: required"},
		{[]string{"sandbox", "create", "--image", "root/busybox", "--env", "NOEQUALS"}, `--env: "NOEQUALS" is not KEY=VALUE`},
		{[]string{"sandbox", "create", "--image", "root/busybox", "--timeout", "soon"}, `--timeout: "soon" is not a duration`},
		{[]string{"sandbox", "create", "--image", "root/busybox", "--count", "0"}, "--count: must be between 1 and 32768"},
		{[]string{"sandbox", "create", "--image", "root/busybox", "--bogus"}, "unknown flag: --bogus"},
		{[]string{"sandbox", "create", "--image", "nope/image"}, `error: image "nope/image" not found`},
		{[]string{"sandbox", "list", "-o", "yaml"}, `--output: "yaml" is not a format`},
	} {
		r := run(t, srv, "", tc.args...)
		if r.code != 1 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 1 and %q", tc.args, r.code, r.stderr, tc.want)
		}
		if r.stdout != "" {
			t.Errorf("%v: printed %q on stdout", tc.args, r.stdout)
		}
	}
	if n := len(srv.Sandboxes()); n != 0 {
		t.Fatalf("bad input made %d sandboxes", n)
	}
}

func TestCreateCount(t *testing.T) {
	srv := opendsectest.New(t, token)
	r := mustRun(t, srv, "", "sandbox", "create", "--image", "root/busybox", "--count", "3", "-q")
	if ids := strings.Fields(r.stdout); len(ids) != 3 {
		t.Fatalf("ids = %q", r.stdout)
	}
	if !strings.Contains(r.stderr, "creating") || !strings.Contains(r.stderr, "3/3") {
		t.Fatalf("no progress bar on stderr: %q", r.stderr)
	}

	srv.BatchItemError = func(i int) error {
		if i == 1 {
			return connect.NewError(connect.CodeResourceExhausted, errors.New("quota exceeded: sandboxes"))
		}
		return nil
	}
	r = run(t, srv, "", "sandbox", "create", "--image", "root/busybox", "--count", "3", "-q")
	if r.code != 1 || len(strings.Fields(r.stdout)) != 2 {
		t.Fatalf("partial batch: exit %d stdout %q", r.code, r.stdout)
	}
	if !strings.Contains(r.stderr, "error: sandbox 1: quota exceeded: sandboxes") || !strings.Contains(r.stderr, "2 of 3 sandboxes created, 1 failed") {
		t.Fatalf("partial batch stderr = %q", r.stderr)
	}
}

func TestListGetStopSetTimeout(t *testing.T) {
	srv := opendsectest.New(t, token)
	a := createOne(t, srv, "--label", "team=rl", "--task-id", "t1")
	b := createOne(t, srv)

	r := mustRun(t, srv, "", "sandbox", "list", "--label", "team=rl")
	if !strings.Contains(r.stdout, a) || strings.Contains(r.stdout, b) {
		t.Fatalf("list --label = %q", r.stdout)
	}
	r = mustRun(t, srv, "", "sandbox", "list", "-o", "json")
	var list opendsecv1.ListSandboxesResponse
	if err := protojson.Unmarshal([]byte(r.stdout), &list); err != nil || len(list.Sandboxes) != 2 {
		t.Fatalf("list json = %q (%v)", r.stdout, err)
	}
	r = mustRun(t, srv, "", "sandbox", "list", "--task-id", "t1", "-q")
	if strings.TrimSpace(r.stdout) != a {
		t.Fatalf("list --task-id -q = %q", r.stdout)
	}

	r = mustRun(t, srv, "", "sandbox", "get", a)
	if !strings.Contains(r.stdout, "ID:") || !strings.Contains(r.stdout, a) || !strings.Contains(r.stdout, "team=rl") {
		t.Fatalf("get = %q", r.stdout)
	}
	r = run(t, srv, "", "sandbox", "get", "missing1")
	if r.code != 1 || r.stderr != "error: sandbox \"missing1\" not found\n" {
		t.Fatalf("get missing: exit %d stderr %q", r.code, r.stderr)
	}

	r = mustRun(t, srv, "", "sandbox", "set-timeout", a, "2h")
	if !strings.Contains(r.stdout, a+" expires at ") {
		t.Fatalf("set-timeout = %q", r.stdout)
	}
	if r := run(t, srv, "", "sandbox", "set-timeout", a, "0s"); r.code != 1 || !strings.Contains(r.stderr, "DURATION") {
		t.Fatalf("set-timeout 0: %+v", r)
	}

	r = run(t, srv, "", "sandbox", "stop", a, "missing1", b)
	if r.code != 1 || r.stdout != a+"\n"+b+"\n" || !strings.Contains(r.stderr, `error: stop missing1: sandbox "missing1" not found`) {
		t.Fatalf("stop: %+v", r)
	}
	if n := len(srv.Sandboxes()); n != 0 {
		t.Fatalf("%d sandboxes left after stop", n)
	}
}

func TestExec(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv)

	r := run(t, srv, "", "sandbox", "exec", id, "--env", "X=1", "--cwd", "/tmp", "--", "sh", "-c", "echo 42; echo warn >&2; exit 7")
	if r.code != 7 || r.stdout != "42\n" || r.stderr != "warn\n" {
		t.Fatalf("exec: %+v", r)
	}
	st := srv.ExecStarts()[0]
	if st.Env["X"] != "1" || st.Cwd != "/tmp" || st.Pty != nil || st.Stdin {
		t.Fatalf("start = %v", st)
	}

	r = mustRun(t, srv, "line one\nline two\n", "sandbox", "exec", id, "-i", "--", "cat")
	if r.stdout != "line one\nline two\n" {
		t.Fatalf("exec -i cat = %q", r.stdout)
	}

	// Not a terminal: the PTY gets a default size and nothing breaks.
	mustRun(t, srv, "", "sandbox", "exec", id, "--tty", "--", "true")
	if st := srv.ExecStarts()[2]; st.GetPty().GetCols() != 80 || st.GetPty().GetRows() != 24 {
		t.Fatalf("tty start = %v", st)
	}

	if r := run(t, srv, "", "sandbox", "exec", id, "--", "nosuchcmd"); r.code != 127 || !strings.Contains(r.stderr, "nosuchcmd: not found") {
		t.Fatalf("missing command: %+v", r)
	}
	if r := run(t, srv, "", "sandbox", "exec", id); r.code != 1 || !strings.Contains(r.stderr, "give the sandbox ID and the command") {
		t.Fatalf("no command: %+v", r)
	}
	if r := run(t, srv, "", "sandbox", "exec", "gone1", "--", "true"); r.code != 1 || !strings.Contains(r.stderr, `sandbox "gone1" not found`) {
		t.Fatalf("missing sandbox: %+v", r)
	}
}

func TestSecurityExecOutputLimit(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.Exec = func(ctx context.Context, start *opendsecv1.ExecStart, eio opendsectest.ExecIO) (int32, string) {
		chunk := bytes.Repeat([]byte("y\n"), 512<<10)
		for range 8 {
			eio.Stdout(chunk)
		}
		eio.Stderr([]byte("small\n"))
		return 3, "exit status 3"
	}
	id := createOne(t, srv)
	r := run(t, srv, "", "sandbox", "exec", id, "--output-limit", "1MiB", "--", "yes")
	if r.code != 3 || len(r.stdout) != 1<<20 || !strings.HasPrefix(r.stderr, "small\n") ||
		!strings.Contains(r.stderr, "output truncated at --output-limit 1048576: stdout 8388608 bytes, stderr 6 bytes produced") {
		t.Fatalf("exec --output-limit 1MiB: exit %d, %d bytes of stdout, stderr %q", r.code, len(r.stdout), r.stderr)
	}
	if got := srv.ExecStarts()[0].GetOutputLimitBytes(); got != 1<<20 {
		t.Fatalf("output_limit_bytes sent = %d, want 1 MiB (the server enforces it)", got)
	}
	// Without the flag everything streams through.
	if r := run(t, srv, "", "sandbox", "exec", id, "--", "yes"); r.code != 3 || len(r.stdout) != 8<<20 || strings.Contains(r.stderr, "truncated") {
		t.Fatalf("exec without a limit: exit %d, %d bytes of stdout, stderr %q", r.code, len(r.stdout), r.stderr)
	}
	if r := run(t, srv, "", "sandbox", "exec", id, "--output-limit", "lots", "--", "yes"); r.code != 1 || !strings.Contains(r.stderr, "is not a byte count") {
		t.Fatalf("bad --output-limit: %+v", r)
	}
}

func TestExecSignalExitCode(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.Exec = func(ctx context.Context, start *opendsecv1.ExecStart, eio opendsectest.ExecIO) (int32, string) {
		return -1, "signal: killed"
	}
	id := createOne(t, srv)
	if r := run(t, srv, "", "sandbox", "exec", id, "--", "x"); r.code != 137 {
		t.Fatalf("killed process: exit %d, want 137", r.code)
	}
}

func TestFilesCp(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv)
	dir := t.TempDir()
	data := make([]byte, 3<<20)
	rand.Read(data)
	src := filepath.Join(dir, "big.bin")
	if err := os.WriteFile(src, data, 0o644); err != nil {
		t.Fatal(err)
	}

	mustRun(t, srv, "", "files", "cp", src, id+":/tmp/")
	if got, ok := srv.File(id, "/tmp/big.bin"); !ok || !bytes.Equal(got, data) {
		t.Fatalf("upload: stored %d bytes, ok=%v", len(got), ok)
	}
	if chunks := srv.WriteChunks(); len(chunks) != 3 || chunks[0] != 1<<20 {
		t.Fatalf("upload chunks = %v, want 3 x 1 MiB", chunks)
	}

	mustRun(t, srv, "", "files", "cp", id+":/tmp/big.bin", dir+"/back.bin")
	back, err := os.ReadFile(filepath.Join(dir, "back.bin"))
	if err != nil || !bytes.Equal(back, data) {
		t.Fatalf("download: %d bytes, err %v", len(back), err)
	}

	// Into a directory, keeping the name.
	sub := filepath.Join(dir, "sub")
	os.Mkdir(sub, 0o755)
	mustRun(t, srv, "", "files", "cp", id+":/tmp/big.bin", sub)
	if st, err := os.Stat(filepath.Join(sub, "big.bin")); err != nil || st.Size() != int64(len(data)) {
		t.Fatalf("download into dir: %v %v", st, err)
	}

	mustRun(t, srv, "hello from stdin", "files", "cp", "-", id+":/tmp/s.txt")
	r := mustRun(t, srv, "", "files", "cp", id+":/tmp/s.txt", "-")
	if r.stdout != "hello from stdin" {
		t.Fatalf("cp to stdout = %q", r.stdout)
	}

	// A failed download leaves no file behind.
	r = run(t, srv, "", "files", "cp", id+":/tmp/missing", dir+"/missing")
	if r.code != 1 || !strings.Contains(r.stderr, "no such file") {
		t.Fatalf("missing download: %+v", r)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.Name() != "big.bin" && e.Name() != "back.bin" && e.Name() != "sub" {
			t.Errorf("left behind %s", e.Name())
		}
	}

	r = run(t, srv, "", "files", "cp", src, dir+"/other")
	if r.code != 1 || !strings.Contains(r.stderr, "exactly one of SRC and DST") {
		t.Fatalf("local to local: %+v", r)
	}
}

func TestFilesLs(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv)
	srv.PutFile(id, "/tmp/a.txt", []byte("hello"))
	r := mustRun(t, srv, "", "files", "ls", id+":/tmp")
	if !strings.HasPrefix(r.stdout, "MODE") || !strings.Contains(r.stdout, "a.txt") || !strings.Contains(r.stdout, "0644") {
		t.Fatalf("ls = %q", r.stdout)
	}
	r = mustRun(t, srv, "", "files", "ls", id+":/tmp", "-o", "json")
	var resp opendsecv1.ListDirResponse
	if err := protojson.Unmarshal([]byte(r.stdout), &resp); err != nil || len(resp.Entries) != 1 || resp.Entries[0].Size != 5 {
		t.Fatalf("ls json = %q (%v)", r.stdout, err)
	}
	if r := run(t, srv, "", "files", "ls", "/tmp"); r.code != 1 || !strings.Contains(r.stderr, "is not ID:/path") {
		t.Fatalf("ls without id: %+v", r)
	}
}

func TestHints(t *testing.T) {
	srv := opendsectest.New(t, token)
	r := run(t, srv, "", "--token", "wrong", "sandbox", "list")
	if r.code != 1 || r.stderr != "error: token is unknown or expired\nhint: set OPENDSEC_TOKEN (see /root/opendsec-ops/demo.env)\n" {
		t.Fatalf("bad token: %+v", r)
	}
	// The --token flag wins over the environment.
	if r := run(t, srv, "", "--token", token, "sandbox", "list"); r.code != 0 {
		t.Fatalf("good token flag: %+v", r)
	}

	srv.Close()
	r = run(t, srv, "", "sandbox", "list")
	want := "hint: is `opendsec up` running at " + srv.URL + "?"
	if r.code != 1 || !strings.HasPrefix(r.stderr, "error: ") || !strings.Contains(r.stderr, want) {
		t.Fatalf("server down: %+v, want %q", r, want)
	}
}

func TestVersion(t *testing.T) {
	srv := opendsectest.New(t, token)
	r := mustRun(t, srv, "", "version")
	if !strings.HasPrefix(r.stdout, "opendsecctl dev") {
		t.Fatalf("version = %q", r.stdout)
	}
	r = mustRun(t, srv, "", "version", "-o", "json")
	if !strings.Contains(r.stdout, `"client": "dev"`) {
		t.Fatalf("version json = %q", r.stdout)
	}
}
