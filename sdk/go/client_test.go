package opendsec_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

const token = "tok-123"

func newClient(t *testing.T, srv *opendsectest.Server, opts ...opendsec.Option) *opendsec.Client {
	t.Helper()
	opts = append([]opendsec.Option{opendsec.WithToken(token),
		opendsec.WithRetryPolicy(opendsec.RetryPolicy{Attempts: 4, Backoff: time.Millisecond})}, opts...)
	c, err := opendsec.New(srv.Addr(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func create(t *testing.T, c *opendsec.Client) *opendsec.Sandbox {
	t.Helper()
	sb, err := c.CreateSandbox(t.Context(), &opendsec.SandboxSpec{Image: "root/busybox"})
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	return sb
}

func TestNewEndpoint(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"127.0.0.1:7070", "http://127.0.0.1:7070"},
		{"http://h:1/", "http://h:1"},
		{"https://api.example:443", "https://api.example:443"},
	} {
		c, err := opendsec.New(tc.in)
		if err != nil {
			t.Fatalf("New(%q): %v", tc.in, err)
		}
		if c.Endpoint() != tc.want {
			t.Errorf("New(%q).Endpoint() = %q, want %q", tc.in, c.Endpoint(), tc.want)
		}
	}
	for _, bad := range []string{"ftp://h:1", "http://"} {
		_, err := opendsec.New(bad)
		if !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "endpoint") {
			t.Errorf("New(%q) = %v, want invalid argument naming endpoint", bad, err)
		}
	}
}

func TestEnvDefaults(t *testing.T) {
	srv := opendsectest.New(t, token)
	t.Setenv(opendsec.EnvEndpoint, srv.URL)
	t.Setenv(opendsec.EnvToken, token)
	c, err := opendsec.New("")
	if err != nil {
		t.Fatal(err)
	}
	if c.Endpoint() != srv.URL {
		t.Fatalf("endpoint = %q, want %q", c.Endpoint(), srv.URL)
	}
	if _, err := c.ListSandboxes(t.Context(), opendsec.ListFilter{}); err != nil {
		t.Fatalf("list with env token: %v", err)
	}
}

// TestTokenOnEveryCall checks the bearer token reaches the server on unary,
// server-streaming, client-streaming and bidi calls.
func TestTokenOnEveryCall(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	ctx := t.Context()
	sb := create(t, c)
	if err := c.BatchCreate(ctx, &opendsec.SandboxSpec{Image: "root/busybox"}, 2, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile(ctx, sb.Id, "/tmp/a", strings.NewReader("x"), 1); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ReadFile(ctx, sb.Id, "/tmp/a", &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RunShell(ctx, sb.Id, "echo hi"); err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{
		"/opendsec.v1.SandboxService/CreateSandbox":        false,
		"/opendsec.v1.SandboxService/BatchCreateSandboxes": false,
		"/opendsec.v1.FileService/WriteFile":               false,
		"/opendsec.v1.FileService/ReadFile":                false,
		"/opendsec.v1.ProcessService/Exec":                 false,
	}
	for _, call := range srv.Calls() {
		if call.Authorization != "Bearer "+token {
			t.Errorf("%s: Authorization = %q", call.Procedure, call.Authorization)
		}
		want[call.Procedure] = true
	}
	for p, seen := range want {
		if !seen {
			t.Errorf("no call to %s recorded", p)
		}
	}
}

func TestErrors(t *testing.T) {
	srv := opendsectest.New(t, token)
	ctx := t.Context()

	bad, err := opendsec.New(srv.Addr(), opendsec.WithToken("wrong"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = bad.ListSandboxes(ctx, opendsec.ListFilter{})
	var e *opendsec.Error
	if !errors.As(err, &e) || e.Code != opendsec.CodeUnauthenticated || e.Message != "token is unknown or expired" {
		t.Fatalf("wrong token: got %#v", err)
	}
	if !opendsec.IsUnauthenticated(err) {
		t.Fatal("IsUnauthenticated = false")
	}

	c := newClient(t, srv)
	_, err = c.GetSandbox(ctx, "nope")
	if !opendsec.IsNotFound(err) || !strings.Contains(err.Error(), `sandbox "nope" not found`) {
		t.Fatalf("get missing: %v", err)
	}
	_, err = c.CreateSandbox(ctx, &opendsec.SandboxSpec{})
	if !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "spec.image") {
		t.Fatalf("create without image: %v", err)
	}
	_, err = c.Exec(ctx, "x", opendsec.ExecOptions{})
	if !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "command") {
		t.Fatalf("exec without command: %v", err)
	}
	_, err = c.RunShell(ctx, "missing", "true")
	if !opendsec.IsNotFound(err) {
		t.Fatalf("exec in missing sandbox: %v", err)
	}
	if len(srv.Sandboxes()) != 0 {
		t.Fatalf("bad creates left %d sandboxes", len(srv.Sandboxes()))
	}

	// Nothing listening: Unavailable, after the retries.
	srv.Close()
	_, err = c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox"})
	if !opendsec.IsUnavailable(err) {
		t.Fatalf("create with server down: %v (code %v)", err, opendsec.CodeOf(err))
	}
}

func TestCreateRetriesWithSameRequestID(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	// The first two answers are lost after the sandbox was made.
	srv.FailCreates(2, connect.CodeUnavailable, true)
	sb := create(t, c)
	ids := srv.CreateRequestIDs()
	if len(ids) != 3 {
		t.Fatalf("server saw %d creates, want 3", len(ids))
	}
	if ids[0] == "" || ids[0] != ids[1] || ids[1] != ids[2] {
		t.Fatalf("request IDs differ across retries: %q", ids)
	}
	if all := srv.Sandboxes(); len(all) != 1 || all[0].Id != sb.Id {
		t.Fatalf("sandboxes after retries = %v, want just %s", all, sb.Id)
	}
	// A second create is a new request.
	create(t, c)
	ids = srv.CreateRequestIDs()
	if ids[3] == ids[0] {
		t.Fatal("second create reused the first request ID")
	}
}

func TestCreateDoesNotRetryOtherCodes(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	srv.FailCreates(1, connect.CodeResourceExhausted, false)
	_, err := c.CreateSandbox(t.Context(), &opendsec.SandboxSpec{Image: "root/busybox"})
	if !opendsec.IsResourceExhausted(err) {
		t.Fatalf("got %v", err)
	}
	if n := len(srv.CreateRequestIDs()); n != 1 {
		t.Fatalf("server saw %d creates, want 1", n)
	}
}

func TestBatchCreate(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.BatchItemError = func(i int) error {
		if i == 3 {
			return connect.NewError(connect.CodeResourceExhausted, errors.New("quota: 4 sandboxes max"))
		}
		return nil
	}
	c := newClient(t, srv)
	got := map[int]opendsec.BatchResult{}
	err := c.BatchCreate(t.Context(), &opendsec.SandboxSpec{Image: "root/busybox"}, 5, func(r opendsec.BatchResult) {
		got[r.Index] = r
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 5 {
		t.Fatalf("got %d results", len(got))
	}
	for i, r := range got {
		if i == 3 {
			if !opendsec.IsResourceExhausted(r.Err) || r.Sandbox != nil || !strings.Contains(r.Err.Error(), "quota") {
				t.Errorf("item 3 = %+v, want resource exhausted", r)
			}
			continue
		}
		if r.Err != nil || r.Sandbox.GetId() == "" {
			t.Errorf("item %d = %+v", i, r)
		}
	}
	if n := len(srv.Sandboxes()); n != 4 {
		t.Fatalf("server has %d sandboxes, want 4", n)
	}
	if err := c.BatchCreate(t.Context(), &opendsec.SandboxSpec{Image: "root/busybox"}, 0, nil); !opendsec.IsInvalidArgument(err) {
		t.Fatalf("count 0: %v", err)
	}
}

func TestBatchCreateWith(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.WarmPool = true
	c := newClient(t, srv)
	ctx := t.Context()
	spec := &opendsec.SandboxSpec{Image: "root/busybox"}
	batch := func(n int, opts opendsec.CreateOptions) []opendsec.BatchResult {
		t.Helper()
		got := make([]opendsec.BatchResult, n)
		err := c.BatchCreateWith(ctx, spec, n, opts, func(r opendsec.BatchResult) { got[r.Index] = r })
		if err != nil {
			t.Fatalf("batch create with %+v: %v", opts, err)
		}
		for i, r := range got {
			if r.Err != nil || r.Sandbox.GetId() == "" {
				t.Fatalf("batch create with %+v: item %d = %+v", opts, i, r)
			}
		}
		return got
	}

	for i, r := range batch(3, opendsec.CreateOptions{}) {
		if !r.Sandbox.GetFromWarmPool() {
			t.Errorf("default batch: item %d FromWarmPool = false, want true from a node with a warm pool", i)
		}
	}
	cold := batch(3, opendsec.CreateOptions{SkipWarmPool: true, RequestID: "bench-batch-1"})
	for i, r := range cold {
		if r.Sandbox.GetFromWarmPool() {
			t.Errorf("SkipWarmPool batch: item %d FromWarmPool = true, want false", i)
		}
	}
	// The same RequestID is the same batch.
	for i, r := range batch(3, opendsec.CreateOptions{SkipWarmPool: true, RequestID: "bench-batch-1"}) {
		if r.Sandbox.GetId() != cold[i].Sandbox.GetId() {
			t.Errorf("repeat of request ID bench-batch-1: item %d = %s, want %s again", i, r.Sandbox.GetId(), cold[i].Sandbox.GetId())
		}
	}
	if err := c.BatchCreate(ctx, spec, 2, nil); err != nil {
		t.Fatalf("batch create: %v", err)
	}

	if got, want := srv.BatchSkipWarmPool(), []bool{false, true, true, false}; !slices.Equal(got, want) {
		t.Errorf("skip_warm_pool on the wire = %v, want %v", got, want)
	}
	ids := srv.BatchRequestIDs()
	if ids[0] == "" || ids[0] == ids[3] || ids[1] != "bench-batch-1" {
		t.Errorf("request IDs = %q: want a fresh one for an empty RequestID and the caller's otherwise", ids)
	}
	if n := len(srv.CreateSkipWarmPool()); n != 0 {
		t.Errorf("server saw %d single creates, want batches only", n)
	}

	if err := c.BatchCreateWith(ctx, nil, 2, opendsec.CreateOptions{SkipWarmPool: true}, nil); !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "spec") {
		t.Errorf("nil spec: %v, want invalid argument naming spec", err)
	}
	if err := c.BatchCreateWith(ctx, spec, 0, opendsec.CreateOptions{SkipWarmPool: true}, nil); !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "count") {
		t.Errorf("count 0: %v, want invalid argument naming count", err)
	}
	if n := len(srv.Sandboxes()); n != 8 {
		t.Errorf("fake holds %d sandboxes, want 8 (bad input must make none)", n)
	}
}

func TestLifecycle(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	ctx := t.Context()
	a, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox", Labels: map[string]string{"team": "rl"}, TaskId: "t1"})
	if err != nil {
		t.Fatal(err)
	}
	create(t, c)
	list, err := c.ListSandboxes(ctx, opendsec.ListFilter{Labels: map[string]string{"team": "rl"}})
	if err != nil || len(list) != 1 || list[0].Id != a.Id {
		t.Fatalf("list by label = %v, %v", list, err)
	}
	list, err = c.ListSandboxes(ctx, opendsec.ListFilter{TaskID: "t1"})
	if err != nil || len(list) != 1 {
		t.Fatalf("list by task = %v, %v", list, err)
	}
	before := a.ExpiresAt.AsTime()
	upd, err := c.SetTimeout(ctx, a.Id, time.Hour)
	if err != nil || !upd.ExpiresAt.AsTime().After(before.Add(50*time.Minute)) {
		t.Fatalf("set timeout = %v, %v", upd, err)
	}
	if _, err := c.SetTimeout(ctx, a.Id, -time.Second); !opendsec.IsInvalidArgument(err) {
		t.Fatalf("negative timeout: %v", err)
	}
	if err := c.StopSandbox(ctx, a.Id); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetSandbox(ctx, a.Id); !opendsec.IsNotFound(err) {
		t.Fatalf("get after stop: %v", err)
	}
}

// TestExecStreaming checks output arrives in order across stdout and stderr,
// stdin reaches the process and the exit code comes back.
func TestExecStreaming(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.Exec = func(ctx context.Context, start *opendsecv1.ExecStart, eio opendsectest.ExecIO) (int32, string) {
		eio.Stdout([]byte("out1\n"))
		eio.Stderr([]byte("err1\n"))
		eio.Stdout([]byte("out2\n"))
		buf := make([]byte, 64)
		var in []byte
		for {
			n, err := eio.Stdin.Read(buf)
			in = append(in, buf[:n]...)
			if err != nil {
				break
			}
		}
		eio.Stderr([]byte("stdin=" + string(in)))
		return 3, "exit status 3"
	}
	c := newClient(t, srv)
	sb := create(t, c)

	var mu sync.Mutex
	var events []string
	var stdout bytes.Buffer
	p, err := c.Exec(t.Context(), sb.Id, opendsec.ExecOptions{
		Command: []string{"prog", "arg"},
		Env:     map[string]string{"A": "1"},
		Cwd:     "/work",
		Stdin:   true,
		Stdout:  &stdout,
		OnStdout: func(b []byte) {
			mu.Lock()
			events = append(events, "out:"+string(b))
			mu.Unlock()
		},
		OnStderr: func(b []byte) {
			mu.Lock()
			events = append(events, "err:"+string(b))
			mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if p.PID() != 42 {
		t.Errorf("pid = %d", p.PID())
	}
	if err := p.SendStdin([]byte("hello ")); err != nil {
		t.Fatal(err)
	}
	if err := p.SendStdin([]byte("world")); err != nil {
		t.Fatal(err)
	}
	if err := p.CloseStdin(); err != nil {
		t.Fatal(err)
	}
	st, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if st.ExitCode != 3 || st.Status != "exit status 3" {
		t.Fatalf("exit = %+v", st)
	}
	want := []string{"out:out1\n", "err:err1\n", "out:out2\n", "err:stdin=hello world"}
	if strings.Join(events, "|") != strings.Join(want, "|") {
		t.Fatalf("events = %q, want %q", events, want)
	}
	if stdout.String() != "out1\nout2\n" {
		t.Fatalf("stdout writer = %q", stdout.String())
	}
	starts := srv.ExecStarts()
	if s := starts[len(starts)-1]; s.Env["A"] != "1" || s.Cwd != "/work" || !s.Stdin {
		t.Fatalf("start sent = %v", s)
	}
	if err := p.SendStdin([]byte("late")); !opendsec.IsFailedPrecondition(err) {
		t.Fatalf("stdin after exit: %v", err)
	}
}

func TestExecSignalAndResize(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	sb := create(t, c)
	p, err := c.Exec(t.Context(), sb.Id, opendsec.ExecOptions{Command: []string{"sleep", "100"}, PTY: &opendsec.PtySize{Cols: 80, Rows: 24}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Resize(100, 40); err != nil {
		t.Fatal(err)
	}
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	st, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if st.ExitCode != -1 || st.Status != "signal: 15" {
		t.Fatalf("exit = %+v", st)
	}
	// The resize was sent before the signal on the same ordered stream.
	rs := srv.Resizes()
	if len(rs) != 1 || rs[0].Cols != 100 || rs[0].Rows != 40 {
		t.Fatalf("resizes = %v", rs)
	}
	if s := srv.ExecStarts()[0]; s.GetPty().GetCols() != 80 {
		t.Fatalf("pty not sent: %v", s)
	}
}

func TestRunShell(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	sb := create(t, c)
	res, err := c.RunShell(t.Context(), sb.Id, "echo 42; echo oops >&2; exit 7")
	if err != nil {
		t.Fatal(err)
	}
	if res.Stdout != "42\n" || res.Stderr != "oops\n" || res.ExitCode != 7 {
		t.Fatalf("result = %+v", res)
	}
}

// flood is a fake process writing outMiB MiB to stdout and errMiB MiB to
// stderr in 1 MiB chunks.
func flood(outMiB, errMiB int) opendsectest.ExecFunc {
	return func(ctx context.Context, start *opendsecv1.ExecStart, eio opendsectest.ExecIO) (int32, string) {
		chunk := bytes.Repeat([]byte("y\n"), 512<<10)
		for i := range max(outMiB, errMiB) {
			if i < outMiB {
				eio.Stdout(chunk)
			}
			if i < errMiB {
				eio.Stderr(chunk)
			}
		}
		return 0, "exit status 0"
	}
}

func TestSecurityExecOutputRunShellKeepsTheDefaultLimit(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.Exec = flood(20, 2)
	c := newClient(t, srv)
	sb := create(t, c)
	res, err := c.RunShell(t.Context(), sb.Id, "yes")
	if err != nil {
		t.Fatal(err)
	}
	if opendsec.DefaultOutputLimit != 16<<20 {
		t.Fatalf("DefaultOutputLimit = %d, want 16 MiB", opendsec.DefaultOutputLimit)
	}
	if !res.OutputTruncated || len(res.Stdout) != 16<<20 || res.StdoutBytes != 20<<20 ||
		len(res.Stderr) != 2<<20 || res.StderrBytes != 2<<20 || res.ExitCode != 0 {
		t.Fatalf("truncated=%v stdout %d/%d stderr %d/%d exit %d", res.OutputTruncated,
			len(res.Stdout), res.StdoutBytes, len(res.Stderr), res.StderrBytes, res.ExitCode)
	}
	if got := srv.ExecStarts()[0].GetOutputLimitBytes(); got != 16<<20 {
		t.Fatalf("output_limit_bytes sent = %d, want 16 MiB (the server enforces it too)", got)
	}

	res, err = c.RunShell(t.Context(), sb.Id, "yes", opendsec.WithOutputLimit(1<<20+3))
	if err != nil {
		t.Fatal(err)
	}
	if !res.OutputTruncated || len(res.Stdout) != 1<<20+3 || len(res.Stderr) != 1<<20+3 {
		t.Fatalf("limit 1 MiB+3: truncated=%v stdout %d stderr %d", res.OutputTruncated, len(res.Stdout), len(res.Stderr))
	}
	res, err = c.RunShell(t.Context(), sb.Id, "yes", opendsec.WithOutputLimit(-1))
	if err != nil {
		t.Fatal(err)
	}
	if res.OutputTruncated || len(res.Stdout) != 20<<20 {
		t.Fatalf("no limit: truncated=%v stdout %d", res.OutputTruncated, len(res.Stdout))
	}
}

func TestSecurityExecOutputRunShellMemoryIsBounded(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.Exec = flood(256, 0)
	c := newClient(t, srv)
	sb := create(t, c)
	res, err := c.RunShell(t.Context(), sb.Id, "yes")
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	if res.StdoutBytes != 256<<20 || ms.HeapAlloc > 64<<20 {
		t.Fatalf("after 256 MiB of output: counted %d bytes, heap holds %d MiB (want < 64)", res.StdoutBytes, ms.HeapAlloc>>20)
	}
	runtime.KeepAlive(res)
}

func TestExecContextCancel(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	sb := create(t, c)
	ctx, cancel := context.WithCancel(t.Context())
	p, err := c.Exec(ctx, sb.Id, opendsec.ExecOptions{Command: []string{"sleep", "100"}})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	_, err = p.Wait()
	if opendsec.CodeOf(err) != opendsec.CodeCanceled || !errors.Is(err, context.Canceled) {
		t.Fatalf("wait after cancel: %v", err)
	}
}

func TestFilesRoundTrip(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	sb := create(t, c)
	ctx := t.Context()
	data := make([]byte, 3<<20+123)
	rand.Read(data)
	info, err := c.WriteFile(ctx, sb.Id, "/tmp/big.bin", bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	if info.Size != int64(len(data)) {
		t.Fatalf("written size = %d", info.Size)
	}
	if got := srv.WriteChunks(); len(got) != 4 || got[0] != opendsec.ChunkSize || got[3] != 123 {
		t.Fatalf("chunks = %v, want 3 x 1 MiB + 123", got)
	}
	var back bytes.Buffer
	n, err := c.ReadFile(ctx, sb.Id, "/tmp/big.bin", &back)
	if err != nil || n != int64(len(data)) || !bytes.Equal(back.Bytes(), data) {
		t.Fatalf("read back %d bytes, equal=%v, err=%v", n, bytes.Equal(back.Bytes(), data), err)
	}
	if _, err := c.ReadFile(ctx, sb.Id, "/nope", &back); !opendsec.IsNotFound(err) {
		t.Fatalf("read missing: %v", err)
	}

	if _, created, err := c.MakeDir(ctx, sb.Id, "/tmp/d"); err != nil || !created {
		t.Fatalf("mkdir = %v, %v", created, err)
	}
	if _, created, _ := c.MakeDir(ctx, sb.Id, "/tmp/d"); created {
		t.Fatal("second mkdir reported created")
	}
	if _, err := c.Move(ctx, sb.Id, "/tmp/big.bin", "/tmp/d/moved.bin"); err != nil {
		t.Fatal(err)
	}
	entries, err := c.ListDir(ctx, sb.Id, "/tmp", 0)
	if err != nil || len(entries) != 1 || entries[0].Name != "d" || entries[0].Type != opendsec.FileTypeDirectory {
		t.Fatalf("ls /tmp = %v, %v", entries, err)
	}
	st, err := c.Stat(ctx, sb.Id, "/tmp/d/moved.bin")
	if err != nil || st.Size != int64(len(data)) {
		t.Fatalf("stat = %v, %v", st, err)
	}
	if err := c.Remove(ctx, sb.Id, "/tmp/d/moved.bin"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Stat(ctx, sb.Id, "/tmp/d/moved.bin"); !opendsec.IsNotFound(err) {
		t.Fatalf("stat after remove: %v", err)
	}
}

func TestWriteFileRejectedUpFront(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.MaxUploadBytes = 1 << 20
	c := newClient(t, srv)
	sb := create(t, c)
	data := make([]byte, 3<<20)
	_, err := c.WriteFile(t.Context(), sb.Id, "/tmp/x", bytes.NewReader(data), int64(len(data)))
	if !opendsec.IsResourceExhausted(err) || !strings.Contains(err.Error(), "size") || !strings.Contains(err.Error(), "upload limit") {
		t.Fatalf("oversize upload: %v, want resource_exhausted naming size and the limit", err)
	}
	if _, ok := srv.File(sb.Id, "/tmp/x"); ok {
		t.Fatal("rejected upload left a file")
	}
}

func TestHTTPRequest(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	sb := create(t, c)
	resp, err := c.HTTPRequest(t.Context(), sb.Id, opendsec.HTTPRequest{
		Port: 8080, Method: http.MethodPost, Path: "/api?x=1",
		Header: http.Header{"X-A": {"b"}}, Body: []byte("payload"),
	})
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || string(resp.Body) != "POST /api?x=1\npayload" || resp.Header.Get("Echo-X-A") != "b" {
		t.Fatalf("response = %+v", resp)
	}
	if _, err := c.HTTPRequest(t.Context(), sb.Id, opendsec.HTTPRequest{Port: 0}); !opendsec.IsInvalidArgument(err) {
		t.Fatalf("port 0: %v", err)
	}
}

func TestCreateSandboxWith(t *testing.T) {
	srv := opendsectest.New(t, token)
	srv.WarmPool = true
	c := newClient(t, srv)
	ctx := t.Context()
	spec := &opendsec.SandboxSpec{Image: "root/busybox"}

	warm, err := c.CreateSandboxWith(ctx, spec, opendsec.CreateOptions{})
	if err != nil {
		t.Fatalf("create through the pool: %v", err)
	}
	if !warm.GetFromWarmPool() {
		t.Error("default create: FromWarmPool = false, want true from a node with a warm pool")
	}
	cold, err := c.CreateSandboxWith(ctx, spec, opendsec.CreateOptions{SkipWarmPool: true, RequestID: "bench-1"})
	if err != nil {
		t.Fatalf("create with SkipWarmPool: %v", err)
	}
	if cold.GetFromWarmPool() {
		t.Error("SkipWarmPool create: FromWarmPool = true, want false")
	}
	// The same RequestID is the same create.
	again, err := c.CreateSandboxWith(ctx, spec, opendsec.CreateOptions{SkipWarmPool: true, RequestID: "bench-1"})
	if err != nil || again.GetId() != cold.GetId() {
		t.Fatalf("repeat of request ID bench-1 = %v, %v; want sandbox %s again", again.GetId(), err, cold.GetId())
	}
	plain := create(t, c)
	if !plain.GetFromWarmPool() {
		t.Error("CreateSandbox: FromWarmPool = false, want true (it must not skip the pool)")
	}

	if got, want := srv.CreateSkipWarmPool(), []bool{false, true, true, false}; !slices.Equal(got, want) {
		t.Errorf("skip_warm_pool on the wire = %v, want %v", got, want)
	}
	ids := srv.CreateRequestIDs()
	if ids[0] == "" || ids[0] == ids[3] || ids[1] != "bench-1" {
		t.Errorf("request IDs = %q: want a fresh one for an empty RequestID and the caller's otherwise", ids)
	}

	if _, err := c.CreateSandboxWith(ctx, nil, opendsec.CreateOptions{}); !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "spec") {
		t.Errorf("nil spec: %v, want invalid argument naming spec", err)
	}
	if _, err := c.CreateSandboxWithRequestID(ctx, spec, ""); !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "request_id") {
		t.Errorf("empty request ID: %v, want invalid argument naming request_id", err)
	}
	if n := len(srv.Sandboxes()); n != 3 {
		t.Errorf("fake holds %d sandboxes, want 3 (bad input must make none)", n)
	}
}
