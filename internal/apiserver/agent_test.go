package apiserver_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/apiserver"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
)

type execResult struct {
	pid    uint32
	stdout string
	stderr string
	pty    string
	exit   *v1.ExecExit
}

// run execs start, then sends more, and collects events until the exit.
func (e *env) run(start *v1.ExecStart, more ...*v1.ExecRequest) (execResult, error) {
	e.t.Helper()
	stream := e.proc.Exec(e.t.Context())
	defer stream.CloseResponse()
	if err := stream.Send(&v1.ExecRequest{Msg: &v1.ExecRequest_Start{Start: start}}); err != nil {
		return execResult{}, err
	}
	var r execResult
	for {
		m, err := stream.Receive()
		if err != nil {
			return r, err
		}
		switch ev := m.GetEvent().(type) {
		case *v1.ExecResponse_Started:
			r.pid = ev.Started.GetPid()
			for _, req := range more {
				if err := stream.Send(req); err != nil {
					return r, err
				}
			}
		case *v1.ExecResponse_Stdout:
			r.stdout += string(ev.Stdout)
		case *v1.ExecResponse_Stderr:
			r.stderr += string(ev.Stderr)
		case *v1.ExecResponse_Pty:
			r.pty += string(ev.Pty)
		case *v1.ExecResponse_Exit:
			r.exit = ev.Exit
			stream.CloseRequest()
			return r, nil
		}
	}
}

func stdin(b string) *v1.ExecRequest {
	return &v1.ExecRequest{Msg: &v1.ExecRequest_Stdin{Stdin: []byte(b)}}
}

func closeStdin() *v1.ExecRequest {
	return &v1.ExecRequest{Msg: &v1.ExecRequest_CloseStdin{CloseStdin: true}}
}

func TestExec(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	agent := e.nodes[0].agent

	r, err := e.run(&v1.ExecStart{SandboxId: id, Command: []string{"echo", "hi", "there"}})
	if err != nil {
		t.Fatal(err)
	}
	if r.pid == 0 || r.stdout != "hi there\n" || r.exit.GetExitCode() != 0 || r.exit.GetTimedOut() {
		t.Fatalf("echo: %+v", r)
	}
	r, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"fail"}})
	if err != nil || r.stderr != "boom" || r.exit.GetExitCode() != 3 || r.exit.GetStatus() != "exit status 3" {
		t.Fatalf("fail: %+v %v", r, err)
	}
	r, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"whoami"}, User: "user"})
	if err != nil || r.stdout != "user\n" {
		t.Fatalf("user did not reach the agent as Basic auth: %+v %v", r, err)
	}
	// Stdin round trip, ended by close_stdin.
	r, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"cat"}, Stdin: true}, stdin("hello "), stdin("world"), closeStdin())
	if err != nil || r.stdout != "hello world" || r.exit.GetExitCode() != 0 {
		t.Fatalf("cat: %+v %v", r, err)
	}
	// Signals end the process.
	r, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"sleep"}}, &v1.ExecRequest{Msg: &v1.ExecRequest_Signal{Signal: 9}})
	if err != nil || r.exit.GetExitCode() != -1 || !strings.Contains(r.exit.GetStatus(), "SIGKILL") || r.exit.GetTimedOut() {
		t.Fatalf("signal: %+v %v", r, err)
	}
	// PTY: input goes to the PTY, resize reaches the agent.
	r, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"shell"}, Pty: &v1.PtySize{Cols: 80, Rows: 24}},
		stdin("ls"), &v1.ExecRequest{Msg: &v1.ExecRequest_Resize{Resize: &v1.PtySize{Cols: 100, Rows: 40}}}, &v1.ExecRequest{Msg: &v1.ExecRequest_Signal{Signal: 15}})
	if err != nil || r.stdout != "pty:ls" || r.pty != "100x40" {
		t.Fatalf("pty: %+v %v", r, err)
	}
	// The lifetime: the agent gets Connect-Timeout-Ms and kills the process.
	start := time.Now()
	r, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"sleep"}, TimeoutSeconds: 1})
	if err != nil || !r.exit.GetTimedOut() || r.exit.GetExitCode() != -1 {
		t.Fatalf("timeout: %+v %v", r, err)
	}
	if el := time.Since(start); el < 900*time.Millisecond || el > 5*time.Second {
		t.Fatalf("timeout took %s, want about 1s", el)
	}
	agent.mu.Lock()
	ms := agent.lastStart.Get("Connect-Timeout-Ms")
	agent.mu.Unlock()
	if ms != "1000" {
		t.Fatalf("Connect-Timeout-Ms = %q, want 1000", ms)
	}
}

func TestSecurityExecOutputLimit(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	// The server sends at most output_limit_bytes of each stream and counts
	// the rest; the process still runs to its end.
	r, err := e.run(&v1.ExecStart{SandboxId: id, Command: []string{"flood"}, OutputLimitBytes: 2500})
	if err != nil {
		t.Fatal(err)
	}
	x := r.exit
	if len(r.stdout) != 2500 || len(r.stderr) != 2500 || !x.GetOutputTruncated() ||
		x.GetStdoutTotalBytes() != 10000 || x.GetStderrTotalBytes() != 3000 || x.GetExitCode() != 0 {
		t.Fatalf("limit 2500: stdout %d stderr %d, exit %v", len(r.stdout), len(r.stderr), x)
	}
	// Without a limit all of it comes, with the counts.
	r, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"flood"}})
	if err != nil {
		t.Fatal(err)
	}
	if x := r.exit; len(r.stdout) != 10000 || len(r.stderr) != 3000 || x.GetOutputTruncated() || x.GetStdoutTotalBytes() != 10000 {
		t.Fatalf("no limit: stdout %d stderr %d, exit %v", len(r.stdout), len(r.stderr), x)
	}
	_, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"flood"}, OutputLimitBytes: -1})
	wantField(t, err, "output_limit_bytes")
}

func TestExecValidation(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	for _, tc := range []struct {
		field string
		start *v1.ExecStart
	}{
		{"command", &v1.ExecStart{SandboxId: id}},
		{"command", &v1.ExecStart{SandboxId: id, Command: []string{""}}},
		{"timeout_seconds", &v1.ExecStart{SandboxId: id, Command: []string{"echo"}, TimeoutSeconds: -1}},
		{"sandbox_id", &v1.ExecStart{Command: []string{"echo"}}},
		{"env", &v1.ExecStart{SandboxId: id, Command: []string{"echo"}, Env: map[string]string{"A=": "b"}}},
		{"user", &v1.ExecStart{SandboxId: id, Command: []string{"echo"}, User: "no such user"}},
		{"pty", &v1.ExecStart{SandboxId: id, Command: []string{"echo"}, Pty: &v1.PtySize{}}},
	} {
		_, err := e.run(tc.start)
		wantField(t, err, tc.field)
	}
	// The first message must be start.
	stream := e.proc.Exec(t.Context())
	stream.Send(stdin("x"))
	_, err := stream.Receive()
	wantField(t, err, "start")
	// A bad message later ends the exec with an error naming it.
	_, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"sleep"}}, &v1.ExecRequest{Msg: &v1.ExecRequest_Signal{Signal: 2}})
	wantField(t, err, "signal")
	_, err = e.run(&v1.ExecStart{SandboxId: id, Command: []string{"sleep"}}, stdin("x"))
	wantField(t, err, "stdin")
	// Unknown sandbox on a known node: the proxy's not found comes back.
	_, err = e.run(&v1.ExecStart{SandboxId: "n001zzzzzzzzzzzzzzzz", Command: []string{"echo"}})
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("unknown sandbox: %v, want not_found", err)
	}
}

func TestProcessRPCs(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	stream := e.proc.Exec(t.Context())
	stream.Send(&v1.ExecRequest{Msg: &v1.ExecRequest_Start{Start: &v1.ExecStart{SandboxId: id, Command: []string{"cat", "-"}, Stdin: true, Tag: "t"}}})
	m, err := stream.Receive()
	if err != nil {
		t.Fatal(err)
	}
	pid := m.GetStarted().GetPid()
	list, err := e.proc.ListProcesses(t.Context(), connect.NewRequest(&v1.ListProcessesRequest{SandboxId: id}))
	if err != nil || len(list.Msg.GetProcesses()) != 1 || list.Msg.GetProcesses()[0].GetPid() != pid ||
		strings.Join(list.Msg.GetProcesses()[0].GetCommand(), " ") != "cat -" || list.Msg.GetProcesses()[0].GetTag() != "t" {
		t.Fatalf("list: %v %v", list, err)
	}
	if _, err := e.proc.SendInput(t.Context(), connect.NewRequest(&v1.SendInputRequest{SandboxId: id, Pid: pid, Data: []byte("abc")})); err != nil {
		t.Fatal(err)
	}
	m, err = stream.Receive()
	if err != nil || string(m.GetStdout()) != "abc" {
		t.Fatalf("after SendInput: %v %v", m, err)
	}
	_, err = e.proc.SignalProcess(t.Context(), connect.NewRequest(&v1.SignalProcessRequest{SandboxId: id, Pid: pid, Signal: 3}))
	wantField(t, err, "signal")
	_, err = e.proc.SignalProcess(t.Context(), connect.NewRequest(&v1.SignalProcessRequest{SandboxId: id, Signal: 9}))
	wantField(t, err, "pid")
	_, err = e.proc.ResizePty(t.Context(), connect.NewRequest(&v1.ResizePtyRequest{SandboxId: id, Pid: pid}))
	wantField(t, err, "size")
	if _, err := e.proc.SignalProcess(t.Context(), connect.NewRequest(&v1.SignalProcessRequest{SandboxId: id, Pid: pid, Signal: 15})); err != nil {
		t.Fatal(err)
	}
	m, err = stream.Receive()
	if err != nil || m.GetExit() == nil || m.GetExit().GetExitCode() != -1 {
		t.Fatalf("after SIGTERM: %v %v", m, err)
	}
	_, err = e.proc.SignalProcess(t.Context(), connect.NewRequest(&v1.SignalProcessRequest{SandboxId: id, Pid: 4242, Signal: 9}))
	wantCode(t, err, connect.CodeNotFound, "4242")
}

func (e *env) write(id, path string, size int64, chunks ...[]byte) (*v1.WriteFileResponse, error) {
	s := e.files.WriteFile(e.t.Context())
	if err := s.Send(&v1.WriteFileRequest{Msg: &v1.WriteFileRequest_Header{Header: &v1.WriteFileHeader{SandboxId: id, Path: path, Size: size}}}); err != nil {
		return nil, err
	}
	for _, c := range chunks {
		if err := s.Send(&v1.WriteFileRequest{Msg: &v1.WriteFileRequest_Data{Data: c}}); err != nil {
			break // the server answered early; CloseAndReceive says why
		}
	}
	resp, err := s.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

func (e *env) read(id, path string) ([]byte, int, error) {
	s, err := e.files.ReadFile(e.t.Context(), connect.NewRequest(&v1.ReadFileRequest{SandboxId: id, Path: path}))
	if err != nil {
		return nil, 0, err
	}
	var buf bytes.Buffer
	n := 0
	for s.Receive() {
		if len(s.Msg().GetData()) > 1<<20 {
			return nil, n, fmt.Errorf("chunk of %d bytes exceeds 1 MiB", len(s.Msg().GetData()))
		}
		buf.Write(s.Msg().GetData())
		n++
	}
	return buf.Bytes(), n, s.Err()
}

func TestFiles(t *testing.T) {
	e := setup(t, func(c *apiserver.Config) { c.MaxUploadBytes = 3 << 20 }, "n001")
	id := e.create(busybox()).GetId()
	agent := e.nodes[0].agent

	data := bytes.Repeat([]byte("0123456789abcdef"), (5<<20)/32) // 2.5 MiB
	w, err := e.write(id, "/tmp/a.bin", int64(len(data)), data[:1<<20], data[1<<20:2<<20], data[2<<20:])
	if err != nil {
		t.Fatal(err)
	}
	if w.GetFile().GetPath() != "/tmp/a.bin" || w.GetFile().GetSize() != int64(len(data)) {
		t.Fatalf("write answered %v", w.GetFile())
	}
	got, chunks, err := e.read(id, "/tmp/a.bin")
	if err != nil || !bytes.Equal(got, data) || chunks != 3 {
		t.Fatalf("read back %d bytes in %d chunks (%v), want %d in 3", len(got), chunks, err, len(data))
	}
	_, _, err = e.read(id, "/nope")
	wantCode(t, err, connect.CodeNotFound, "path '/nope' does not exist")
	// A refused write names the caller's path, not the upload's temporary one.
	_, err = e.write(id, "/run/opendsec/agent.sock", 1, []byte("x"))
	wantCode(t, err, connect.CodePermissionDenied, "write '/run/opendsec/agent.sock': permission denied")
	if err != nil && strings.Contains(err.Error(), ".opendsec-upload-") {
		t.Errorf("refused write names the temporary file: %v", err)
	}
	_, _, err = e.read(id, "")
	wantField(t, err, "path")

	files := func() []string {
		agent.mu.Lock()
		defer agent.mu.Unlock()
		var out []string
		for p := range agent.files {
			out = append(out, p)
		}
		return out
	}
	// Declared too big: refused up front with the numbers
	// (TestSecurityBadInputUploadLimit).
	_, err = e.write(id, "/tmp/big", 2<<30)
	wantCode(t, err, connect.CodeResourceExhausted, fmt.Sprintf("size: 2147483648 bytes exceeds the upload limit of %d bytes (3 MiB, node.max_upload_mb)", 3<<20))
	// Undeclared and too big: cut off, nothing left behind.
	chunk := bytes.Repeat([]byte("x"), 1<<20)
	_, err = e.write(id, "/tmp/big", 0, chunk, chunk, chunk, chunk, chunk)
	wantCode(t, err, connect.CodeResourceExhausted, fmt.Sprintf("size: more than %d bytes arrived, over the upload limit of %d bytes (3 MiB, node.max_upload_mb)", 3<<20, 3<<20))
	if fs := files(); len(fs) != 1 || fs[0] != "/tmp/a.bin" {
		t.Fatalf("files after refused uploads: %v, want only /tmp/a.bin", fs)
	}
	// Fewer bytes than declared.
	_, err = e.write(id, "/tmp/short", 10, []byte("abc"))
	wantField(t, err, "size")
	_, err = e.write(id, "bad\x00path", 0, []byte("abc"))
	wantField(t, err, "path")
	if fs := files(); len(fs) != 1 {
		t.Fatalf("files after bad writes: %v", fs)
	}

	// Directory operations.
	md, err := e.files.MakeDir(t.Context(), connect.NewRequest(&v1.MakeDirRequest{SandboxId: id, Path: "/work"}))
	if err != nil || !md.Msg.GetCreated() || md.Msg.GetFile().GetType() != v1.FileType_FILE_TYPE_DIRECTORY {
		t.Fatalf("mkdir: %v %v", md, err)
	}
	md, err = e.files.MakeDir(t.Context(), connect.NewRequest(&v1.MakeDirRequest{SandboxId: id, Path: "/work"}))
	if err != nil || md.Msg.GetCreated() || md.Msg.GetFile().GetPath() != "/work" {
		t.Fatalf("mkdir again: %v %v, want created=false with the entry", md, err)
	}
	mv, err := e.files.Move(t.Context(), connect.NewRequest(&v1.MoveRequest{SandboxId: id, Source: "/tmp/a.bin", Destination: "/work/a.bin"}))
	if err != nil || mv.Msg.GetFile().GetPath() != "/work/a.bin" {
		t.Fatalf("move: %v %v", mv, err)
	}
	ls, err := e.files.ListDir(t.Context(), connect.NewRequest(&v1.ListDirRequest{SandboxId: id, Path: "/work"}))
	if err != nil || len(ls.Msg.GetEntries()) != 1 || ls.Msg.GetEntries()[0].GetName() != "a.bin" {
		t.Fatalf("list: %v %v", ls, err)
	}
	st, err := e.files.Stat(t.Context(), connect.NewRequest(&v1.StatRequest{SandboxId: id, Path: "/work/a.bin", User: "user"}))
	if err != nil || st.Msg.GetFile().GetSize() != int64(len(data)) || st.Msg.GetFile().GetOwner() != "user" {
		t.Fatalf("stat: %v %v", st, err)
	}
	_, err = e.files.Stat(t.Context(), connect.NewRequest(&v1.StatRequest{SandboxId: id, Path: "/missing"}))
	wantCode(t, err, connect.CodeNotFound, "path '/missing' does not exist")
	_, err = e.files.Move(t.Context(), connect.NewRequest(&v1.MoveRequest{SandboxId: id, Source: "/work/a.bin"}))
	wantField(t, err, "destination")
	if _, err := e.files.Remove(t.Context(), connect.NewRequest(&v1.RemoveRequest{SandboxId: id, Path: "/work/a.bin"})); err != nil {
		t.Fatal(err)
	}
	if fs := files(); len(fs) != 0 {
		t.Fatalf("files after remove: %v", fs)
	}
}

func TestHTTPRequest(t *testing.T) {
	e := setup(t, func(c *apiserver.Config) { c.MaxHTTPBodyBytes = 1 << 10 }, "n001")
	id := e.create(busybox()).GetId()
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/big" {
			w.Write(bytes.Repeat([]byte("y"), 2<<10))
			return
		}
		w.Header().Set("X-Echo", r.Header.Get("X-In"))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "%s %s %s %s", r.Method, r.URL.RequestURI(), r.Host, body)
	}))
	t.Cleanup(app.Close)
	agent := e.nodes[0].agent
	agent.mu.Lock()
	agent.ports[8000] = app.Listener.Addr().String()
	agent.mu.Unlock()

	resp, err := e.port.HTTPRequest(t.Context(), connect.NewRequest(&v1.HTTPRequestRequest{
		SandboxId: id, Port: 8000, Method: "POST", Path: "/api?x=1", Body: []byte("payload"),
		Headers: []*v1.Header{{Name: "X-In", Value: "42"}, {Name: "Host", Value: "example.test"}},
	}))
	if err != nil {
		t.Fatal(err)
	}
	echo := ""
	for _, h := range resp.Msg.GetHeaders() {
		if h.GetName() == "X-Echo" {
			echo = h.GetValue()
		}
	}
	if resp.Msg.GetStatus() != 201 || string(resp.Msg.GetBody()) != "POST /api?x=1 example.test payload" || echo != "42" {
		t.Fatalf("response %d %q echo=%q", resp.Msg.GetStatus(), resp.Msg.GetBody(), echo)
	}
	_, err = e.port.HTTPRequest(t.Context(), connect.NewRequest(&v1.HTTPRequestRequest{SandboxId: id, Port: 8000, Path: "/big"}))
	wantCode(t, err, connect.CodeResourceExhausted, "exceeds 1024 bytes")
	_, err = e.port.HTTPRequest(t.Context(), connect.NewRequest(&v1.HTTPRequestRequest{SandboxId: id, Port: 9000}))
	wantCode(t, err, connect.CodeUnavailable, "port 9000 is not open")
	for _, tc := range []struct {
		field string
		req   *v1.HTTPRequestRequest
	}{
		{"port", &v1.HTTPRequestRequest{SandboxId: id}},
		{"port", &v1.HTTPRequestRequest{SandboxId: id, Port: 70000}},
		{"method", &v1.HTTPRequestRequest{SandboxId: id, Port: 8000, Method: "GE T"}},
		{"path", &v1.HTTPRequestRequest{SandboxId: id, Port: 8000, Path: "no-slash"}},
		{"headers", &v1.HTTPRequestRequest{SandboxId: id, Port: 8000, Headers: []*v1.Header{{Name: "X", Value: "a\r\nb"}}}},
		{"timeout_ms", &v1.HTTPRequestRequest{SandboxId: id, Port: 8000, TimeoutMs: -1}},
	} {
		_, err := e.port.HTTPRequest(t.Context(), connect.NewRequest(tc.req))
		wantField(t, err, tc.field)
	}
}

// rawCodec sends pre-encoded bytes, so a test can send what a well-behaved
// protobuf library refuses to encode (invalid UTF-8 in a string).
type rawCodec struct{}

type rawMsg []byte

func (rawCodec) Name() string { return "proto" }
func (rawCodec) Marshal(m any) ([]byte, error) {
	return []byte(*m.(*rawMsg)), nil
}
func (rawCodec) Unmarshal(b []byte, m any) error { return proto.Unmarshal(b, m.(proto.Message)) }

func TestInvalidUTF8NamesField(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendString(b, id)
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	b = protowire.AppendBytes(b, []byte("/tmp/\xff\xfe"))
	c := connect.NewClient[rawMsg, v1.StatResponse](auth.Client(e.hc, e.tok), e.url+opendsecv1connect.FileServiceStatProcedure,
		connect.WithCodec(rawCodec{}), connect.WithGRPC())
	req := rawMsg(b)
	_, err := c.CallUnary(t.Context(), connect.NewRequest(&req))
	wantCode(t, err, connect.CodeInvalidArgument, "path: is not valid UTF-8")
}

// TestSecurityExecOutputIsNotCompressed: exec output goes to the caller
// uncompressed even when it accepts gzip (every SDK does). Compressed, the
// transport's flow-control windows, which count bytes on the wire, held
// hundreds of MiB of a slow reader's `yes` output ahead of the exit, where
// nothing held the process back or could skip it (issue 11, finding 1).
func TestSecurityExecOutputIsNotCompressed(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	var wire atomic.Int64
	hc := &http.Client{Transport: countingTransport{e.hc.Transport, &wire}}
	counted := *e
	counted.proc = opendsecv1connect.NewProcessServiceClient(auth.Client(hc, e.tok), e.url, connect.WithGRPC()) // accepts gzip
	r, err := counted.run(&v1.ExecStart{SandboxId: id, Command: []string{"flood"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.stdout) != 10000 || len(r.stderr) != 3000 {
		t.Fatalf("stdout %d stderr %d bytes, want 10000 and 3000", len(r.stdout), len(r.stderr))
	}
	if n := wire.Load(); n < 13000 {
		t.Fatalf("13000 bytes of output came in %d bytes on the wire: exec output must not be compressed", n)
	}
}

// countingTransport counts the response body bytes it reads.
type countingTransport struct {
	rt http.RoundTripper
	n  *atomic.Int64
}

func (c countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := c.rt.RoundTrip(req)
	if err == nil {
		resp.Body = countingBody{resp.Body, c.n}
	}
	return resp, err
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

// TestSecuritySandboxDiedIsMarked: calls into a sandbox that died (exec,
// a process list, a file read) are failed_precondition with the reason in
// the sandbox-died metadata, which the SDKs turn into their own error.
func TestSecuritySandboxDiedIsMarked(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	e.nodes[0].set(func(n *fakeNode) {
		n.sbs[id].State = nodev1.SandboxState_SANDBOX_STATE_FAILED
		n.sbs[id].Reason = "died: killed by signal 9"
	})
	check := func(what string, err error) {
		t.Helper()
		var ce *connect.Error
		if !errors.As(err, &ce) || ce.Code() != connect.CodeFailedPrecondition ||
			ce.Meta().Get(errdefs.DiedMetadataKey) != "killed by signal 9" || !strings.Contains(ce.Message(), "died: killed by signal 9") {
			t.Fatalf("%s: %v, want failed_precondition marked %s", what, err, errdefs.DiedMetadataKey)
		}
	}
	_, err := e.run(&v1.ExecStart{SandboxId: id, Command: []string{"echo", "hi"}})
	check("exec", err)
	_, err = e.proc.ListProcesses(t.Context(), connect.NewRequest(&v1.ListProcessesRequest{SandboxId: id}))
	check("list processes", err)
	_, _, err = e.read(id, "/etc/hostname")
	check("read file", err)
}
