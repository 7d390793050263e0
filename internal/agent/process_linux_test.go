package agent

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/internal/testutil"
)

func TestStartEnvCwdAndExitCodes(t *testing.T) {
	e := newEnv(t, Config{Env: []string{"PATH=/usr/bin:/bin", "SANDBOX_WIDE=yes", "OVERRIDE=sandbox"}})
	dir := t.TempDir()
	cwd := dir
	req := startReq("/bin/sh", "-c", `echo "$FOO $SANDBOX_WIDE $OVERRIDE $HOME $USER"; pwd; echo oops >&2`)
	req.Msg.Process.Envs = map[string]string{"FOO": "bar", "OVERRIDE": "request"}
	req.Msg.Process.Cwd = &cwd
	s, err := e.proc.Start(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	r := collect(t, s)
	home := "/root"
	if want := "bar yes request " + home + " root\n" + dir + "\n"; r.stdout.String() != want {
		t.Errorf("stdout = %q, want %q", r.stdout.String(), want)
	}
	if r.stderr.String() != "oops\n" {
		t.Errorf("stderr = %q", r.stderr.String())
	}
	if r.pid == 0 || r.end.ExitCode != 0 || !r.end.Exited || r.end.Status != "exit status 0" || r.end.Error != nil {
		t.Errorf("pid %d end %v", r.pid, r.end)
	}

	r = e.run(t, "exit 3")
	if r.end.ExitCode != 3 || r.end.GetError() != "exit status 3" || r.end.Status != "exit status 3" {
		t.Errorf("exit 3: end = %v", r.end)
	}
}

func TestStartRejectsBadInput(t *testing.T) {
	e := newEnv(t, Config{})
	// An executable file that is no program (the paper's overwritten
	// /bin/bash): invalid_argument, not an internal error.
	notProgram := filepath.Join(t.TempDir(), "pwned")
	if err := os.WriteFile(notProgram, []byte("pwned\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		req  *process.StartRequest
		code connect.Code
		want string
	}{
		"empty cmd":     {&process.StartRequest{Process: &process.ProcessConfig{}}, connect.CodeInvalidArgument, "process.cmd"},
		"missing cwd":   {&process.StartRequest{Process: &process.ProcessConfig{Cmd: "/bin/true", Cwd: strPtr("/nonexistent/dir")}}, connect.CodeInvalidArgument, "cwd '/nonexistent/dir' does not exist"},
		"unknown cmd":   {&process.StartRequest{Process: &process.ProcessConfig{Cmd: "no-such-program-xyz"}}, connect.CodeInvalidArgument, "not found in PATH"},
		"not a program": {&process.StartRequest{Process: &process.ProcessConfig{Cmd: notProgram}}, connect.CodeInvalidArgument, "cannot be run: exec format error"},
		"bad env name":  {&process.StartRequest{Process: &process.ProcessConfig{Cmd: "/bin/true", Envs: map[string]string{"A=B": "x"}}}, connect.CodeInvalidArgument, "process.envs"},
	} {
		t.Run(name, func(t *testing.T) {
			s, err := e.proc.Start(t.Context(), connect.NewRequest(tc.req))
			if err == nil {
				for s.Receive() {
				}
				err = s.Err()
			}
			if connect.CodeOf(err) != tc.code || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %s containing %q", err, tc.code, tc.want)
			}
		})
	}
	// Unknown user in Basic auth.
	req := startReq("/bin/true")
	req.Header().Set("Authorization", "Basic bm9ib2R5LXh5ejo=") // "nobody-xyz:"
	s, err := e.proc.Start(t.Context(), req)
	if err == nil {
		for s.Receive() {
		}
		err = s.Err()
	}
	if connect.CodeOf(err) != connect.CodeUnauthenticated || !strings.Contains(err.Error(), "invalid username") {
		t.Fatalf("unknown user: err = %v", err)
	}
}

func strPtr(s string) *string { return &s }

func TestStdinSendInputAndClose(t *testing.T) {
	e := newEnv(t, Config{})
	tr := true
	req := startReq("/bin/cat")
	req.Msg.Stdin = &tr
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	s, err := e.proc.Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	p := s.Msg().GetEvent().GetStart().GetPid()
	for _, chunk := range []string{"hello ", "world\n"} {
		_, err := e.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{
			Process: pid(p), Input: &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: []byte(chunk)}},
		}))
		if err != nil {
			t.Fatal(err)
		}
	}
	// PTY input to a pipe process is refused.
	_, err = e.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{
		Process: pid(p), Input: &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: []byte("x")}},
	}))
	if connect.CodeOf(err) != connect.CodeInternal {
		t.Errorf("pty input to pipe process: %v", err)
	}
	if _, err := e.proc.CloseStdin(ctx, connect.NewRequest(&process.CloseStdinRequest{Process: pid(p)})); err != nil {
		t.Fatal(err)
	}
	r := &result{first: "start", pid: p}
	for s.Receive() {
		r.add(s.Msg().GetEvent())
	}
	if r.stdout.String() != "hello world\n" || r.end == nil || r.end.ExitCode != 0 {
		t.Fatalf("stdout %q end %v err %v", r.stdout.String(), r.end, s.Err())
	}
}

func TestConnectTimeoutIsProcessLifetime(t *testing.T) {
	e := newEnv(t, Config{})
	req := startReq("/bin/sleep", "30")
	req.Header().Set("Connect-Timeout-Ms", "300")
	start := time.Now()
	s, err := e.proc.Start(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	r := &result{}
	for s.Receive() {
		r.add(s.Msg().GetEvent())
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("process lived %s", took)
	}
	// The SDKs raise their timeout error on deadline_exceeded (an end event
	// would read as a failed command instead).
	if connect.CodeOf(s.Err()) != connect.CodeDeadlineExceeded || r.end != nil {
		t.Fatalf("stream ended with %v (end %v); want deadline_exceeded and no end", s.Err(), r.end)
	}
	eventually(t, 5*time.Second, "the process to be killed", func() bool {
		_, err := os.Stat("/proc/" + strconv.Itoa(int(r.pid)))
		return errors.Is(err, os.ErrNotExist)
	})
	c, err := e.proc.Connect(t.Context(), connect.NewRequest(&process.ConnectRequest{Process: pid(r.pid)}))
	if err != nil {
		t.Fatal(err)
	}
	cr := collect(t, c)
	if cr.end.Status != "signal: killed" || cr.end.ExitCode != -1 {
		t.Fatalf("end = %v", cr.end)
	}
}

func TestSendSignalListAndConnect(t *testing.T) {
	e := newEnv(t, Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	tag := "sleeper"
	req := startReq("/bin/sleep", "30")
	req.Msg.Tag = &tag
	s, err := e.proc.Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	p := s.Msg().GetEvent().GetStart().GetPid()

	list, err := e.proc.List(ctx, connect.NewRequest(&process.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, pi := range list.Msg.Processes {
		if pi.Pid == p && pi.GetTag() == tag && pi.GetConfig().GetCmd() == "/bin/sleep" {
			found = true
		}
	}
	if !found {
		t.Fatalf("List = %v, want pid %d tag %s", list.Msg.Processes, p, tag)
	}

	// A second client follows it by tag.
	c, err := e.proc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{
		Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Tag{Tag: tag}},
	}))
	if err != nil {
		t.Fatal(err)
	}
	if !c.Receive() || c.Msg().GetEvent().GetStart().GetPid() != p {
		t.Fatalf("connect first event: %v %v", c.Msg(), c.Err())
	}
	_, err = e.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pid(p), Signal: process.Signal_SIGNAL_SIGKILL}))
	if err != nil {
		t.Fatal(err)
	}
	for _, stream := range []interface {
		Receive() bool
		Err() error
	}{s, c} {
		var end *process.ProcessEvent_EndEvent
		for stream.Receive() {
			switch m := stream.(type) {
			case *connect.ServerStreamForClient[process.StartResponse]:
				end = m.Msg().GetEvent().GetEnd()
			case *connect.ServerStreamForClient[process.ConnectResponse]:
				end = m.Msg().GetEvent().GetEnd()
			}
		}
		if end == nil || end.Status != "signal: killed" || end.ExitCode != -1 || end.Exited {
			t.Fatalf("end = %v err %v", end, stream.Err())
		}
	}
	// Exited: not listed, signals are not_found, Connect replays the end.
	list, _ = e.proc.List(ctx, connect.NewRequest(&process.ListRequest{}))
	for _, pi := range list.Msg.Processes {
		if pi.Pid == p {
			t.Fatal("exited process still listed")
		}
	}
	_, err = e.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pid(p), Signal: process.Signal_SIGNAL_SIGTERM}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("signal exited: %v", err)
	}
	_, err = e.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pid(p), Signal: process.Signal(1)}))
	if connect.CodeOf(err) != connect.CodeUnimplemented {
		t.Fatalf("SIGHUP: %v", err)
	}
	c2, err := e.proc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: pid(p)}))
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, c2); r.end.Status != "signal: killed" {
		t.Fatalf("replayed end = %v", r.end)
	}
	_, err = e.proc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: pid(999999)}))
	if err == nil {
		c3, _ := e.proc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: pid(999999)}))
		c3.Receive()
		err = c3.Err()
	}
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("connect unknown pid: %v", err)
	}
}

func TestPTYInputAndResize(t *testing.T) {
	e := newEnv(t, Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	req := connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "/bin/sh", Envs: map[string]string{"TERM": "xterm", "PS1": "$ "}},
		Pty:     &process.PTY{Size: &process.PTY_Size{Cols: 80, Rows: 24}},
	})
	s, err := e.proc.Start(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	p := s.Msg().GetEvent().GetStart().GetPid()
	out := make(chan string, 1024)
	go func() {
		defer close(out)
		for s.Receive() {
			if b := s.Msg().GetEvent().GetData().GetPty(); len(b) > 0 {
				out <- string(b)
			}
			if end := s.Msg().GetEvent().GetEnd(); end != nil {
				out <- "\x00END:" + end.Status
			}
		}
	}()
	var seen strings.Builder
	waitFor := func(want string) {
		t.Helper()
		timeout := time.After(10 * time.Second)
		for !strings.Contains(seen.String(), want) {
			select {
			case s, ok := <-out:
				if !ok {
					t.Fatalf("stream closed; output so far %q", seen.String())
				}
				seen.WriteString(s)
			case <-timeout:
				t.Fatalf("no %q in pty output %q", want, seen.String())
			}
		}
	}
	send := func(in string) {
		t.Helper()
		_, err := e.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{
			Process: pid(p), Input: &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: []byte(in)}},
		}))
		if err != nil {
			t.Fatal(err)
		}
	}
	send("stty size; tty\n")
	waitFor("24 80")
	waitFor("/dev/pts/")
	_, err = e.proc.Update(ctx, connect.NewRequest(&process.UpdateRequest{
		Process: pid(p), Pty: &process.PTY{Size: &process.PTY_Size{Cols: 132, Rows: 43}},
	}))
	if err != nil {
		t.Fatal(err)
	}
	send("stty size\n")
	waitFor("43 132")
	// Stdin input and CloseStdin are refused on a PTY process.
	_, err = e.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{
		Process: pid(p), Input: &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: []byte("x")}},
	}))
	if connect.CodeOf(err) != connect.CodeInternal {
		t.Errorf("stdin to pty: %v", err)
	}
	send("exit 7\n")
	waitFor("\x00END:exit status 7")
}

// TestYesKeepsMemoryBounded runs `yes` with one fast and one stalled client
// and checks that the agent's memory stays bounded and the stalled client is
// told about the output it lost.
func TestYesKeepsMemoryBounded(t *testing.T) {
	e := newEnv(t, Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	before := vmRSS(t)

	s, err := e.proc.Start(ctx, startReq("/usr/bin/yes"))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	p := s.Msg().GetEvent().GetStart().GetPid()
	// The stalled client: a raw Connect stream whose body is not read yet.
	body := rawConnect(t, e, p)
	defer body.Close()

	var got int64
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) && s.Receive() {
		got += int64(len(s.Msg().GetEvent().GetData().GetStdout()))
	}
	after := vmRSS(t)
	t.Logf("streamed %d MiB of yes; VmRSS %d KiB -> %d KiB", got>>20, before>>10, after>>10)
	if got < 4<<20 {
		t.Fatalf("only %d bytes streamed in 3s", got)
	}
	if after-before > 20<<20 && !raceEnabled {
		t.Fatalf("agent RSS grew by %d MiB (> 20 MiB)", (after-before)>>20)
	}
	// The stalled client now reads: it must learn that output was dropped.
	br := bufio.NewReader(body)
	hdr := make([]byte, 5)
	sawDrop := false
	for i := 0; i < 200 && !sawDrop; i++ {
		if _, err := io.ReadFull(br, hdr); err != nil {
			t.Fatal(err)
		}
		n := int(hdr[1])<<24 | int(hdr[2])<<16 | int(hdr[3])<<8 | int(hdr[4])
		msg := make([]byte, n)
		if _, err := io.ReadFull(br, msg); err != nil {
			t.Fatal(err)
		}
		// "[opendsec-agent: N bytes of output dropped" base64-encoded as stderr.
		sawDrop = strings.Contains(string(msg), `"stderr"`)
	}
	if !sawDrop {
		t.Fatal("stalled client got no dropped-output marker")
	}
	if _, err := e.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pid(p), Signal: process.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
}

// rawConnect opens a Connect stream for pid and returns its unread body.
func rawConnect(t *testing.T, e *env, p uint32) io.ReadCloser {
	t.Helper()
	msg := []byte(`{"process":{"pid":` + strconv.Itoa(int(p)) + `}}`)
	frame := append([]byte{0, 0, 0, 0, byte(len(msg))}, msg...)
	req, _ := http.NewRequestWithContext(t.Context(), "POST", base+"/process.Process/Connect", strings.NewReader(string(frame)))
	req.Header.Set("Content-Type", "application/connect+json")
	resp, err := e.http.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		t.Fatalf("connect: %s", resp.Status)
	}
	return resp.Body
}

func vmRSS(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			return kb << 10
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

// TestReapsOrphans makes the test process a subreaper and the agent its
// reaper: an orphaned grandchild must be reaped, and the agent's own
// children must still get their exit statuses.
func TestReapsOrphans(t *testing.T) {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, Config{Init: true})
	r := e.run(t, "sleep 0.2 & echo $!; exit 5")
	if r.end.ExitCode != 5 {
		t.Fatalf("end = %v", r.end)
	}
	orphan := strings.TrimSpace(r.stdout.String())
	if _, err := strconv.Atoi(orphan); err != nil {
		t.Fatalf("orphan pid %q", orphan)
	}
	eventually(t, 10*time.Second, "orphan "+orphan+" to be reaped (not a zombie)", func() bool {
		_, err := os.Stat("/proc/" + orphan)
		return errors.Is(err, os.ErrNotExist)
	})
	// Many concurrent children all get their own statuses.
	errc := make(chan error, 20)
	for i := range 20 {
		go func() {
			ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
			defer cancel()
			s, err := e.proc.Start(ctx, startReq("/bin/sh", "-c", "exit "+strconv.Itoa(i)))
			if err != nil {
				errc <- err
				return
			}
			var end *process.ProcessEvent_EndEvent
			for s.Receive() {
				if x := s.Msg().GetEvent().GetEnd(); x != nil {
					end = x
				}
			}
			if end == nil || end.ExitCode != int32(i) {
				errc <- errors.New("wrong end for exit " + strconv.Itoa(i) + ": " + end.String())
				return
			}
			errc <- nil
		}()
	}
	for range 20 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
}

func TestRawJSONUnary(t *testing.T) {
	e := newEnv(t, Config{})
	req, _ := http.NewRequestWithContext(t.Context(), "POST", base+"/process.Process/List", strings.NewReader("{}"))
	req.Header.Set("Content-Type", "application/json")
	resp, err := e.http.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" || !strings.HasPrefix(strings.TrimSpace(string(b)), "{") {
		t.Fatalf("%s %s %q", resp.Status, resp.Header.Get("Content-Type"), b)
	}
	// A Connect error body for a missing process.
	req, _ = http.NewRequestWithContext(t.Context(), "POST", base+"/process.Process/SendSignal", strings.NewReader(`{"process":{"pid":999999},"signal":"SIGNAL_SIGKILL"}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err = e.http.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 404 || !strings.Contains(string(b), `"code":"not_found"`) {
		t.Fatalf("%s %q", resp.Status, b)
	}
}

func TestKeepaliveAndUnreadStdin(t *testing.T) {
	e := newEnv(t, Config{})
	req := startReq("/bin/sleep", "1.5")
	req.Header().Set("Keepalive-Ping-Interval", "1")
	s, err := e.proc.Start(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, s); r.keepalives < 1 {
		t.Fatalf("no keepalive in 1.5 s with a 1 s interval")
	}

	// A process that never reads stdin: input times out instead of hanging,
	// and the process can still be killed.
	tr := true
	req = startReq("/bin/sleep", "30")
	req.Msg.Stdin = &tr
	s, err = e.proc.Start(t.Context(), req)
	if err != nil || !s.Receive() {
		t.Fatal(err, s.Err())
	}
	p := s.Msg().GetEvent().GetStart().GetPid()
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	_, err = e.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{
		Process: pid(p), Input: &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: make([]byte, 1<<20)}},
	}))
	cancel()
	if c := connect.CodeOf(err); c != connect.CodeDeadlineExceeded {
		t.Fatalf("input to a process not reading: %v", err)
	}
	if _, err := e.proc.SendSignal(t.Context(), connect.NewRequest(&process.SendSignalRequest{Process: pid(p), Signal: process.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
	r := &result{first: "start"}
	for s.Receive() {
		r.add(s.Msg().GetEvent())
	}
	if r.end == nil || r.end.Status != "signal: killed" {
		t.Fatalf("end %v", r.end)
	}
}

func TestStreamInput(t *testing.T) {
	e := newEnv(t, Config{})
	tr := true
	req := startReq("/bin/cat")
	req.Msg.Stdin = &tr
	s, err := e.proc.Start(t.Context(), req)
	if err != nil || !s.Receive() {
		t.Fatal(err, s.Err())
	}
	p := s.Msg().GetEvent().GetStart().GetPid()
	in := e.proc.StreamInput(t.Context())
	msgs := []*process.StreamInputRequest{
		{Event: &process.StreamInputRequest_Start{Start: &process.StreamInputRequest_StartEvent{Process: pid(p)}}},
		{Event: &process.StreamInputRequest_Data{Data: &process.StreamInputRequest_DataEvent{Input: &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: []byte("streamed\n")}}}}},
		{Event: &process.StreamInputRequest_Keepalive{Keepalive: &process.StreamInputRequest_KeepAlive{}}},
	}
	for _, m := range msgs {
		if err := in.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := in.CloseAndReceive(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.proc.CloseStdin(t.Context(), connect.NewRequest(&process.CloseStdinRequest{Process: pid(p)})); err != nil {
		t.Fatal(err)
	}
	r := &result{first: "start"}
	for s.Receive() {
		r.add(s.Msg().GetEvent())
	}
	if r.stdout.String() != "streamed\n" || r.end == nil || r.end.ExitCode != 0 {
		t.Fatalf("stdout %q end %v", r.stdout.String(), r.end)
	}
}

// TestFastExitKeepsOutput: a process that exits before its Start stream
// has subscribed must still deliver its output (regression: output was
// released as "nobody is reading" and reported as dropped).
func TestFastExitKeepsOutput(t *testing.T) {
	e := newEnv(t, Config{})
	const n = 40
	errc := make(chan string, n)
	for i := range n {
		go func() {
			want := "out-" + strconv.Itoa(i) + "\n"
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			s, err := e.proc.Start(ctx, startReq("/bin/echo", strings.TrimSpace(want)))
			if err != nil {
				errc <- err.Error()
				return
			}
			var out strings.Builder
			for s.Receive() {
				out.Write(s.Msg().GetEvent().GetData().GetStdout())
				out.Write(s.Msg().GetEvent().GetData().GetStderr())
			}
			if out.String() != want {
				errc <- "got " + strconv.Quote(out.String()) + " want " + strconv.Quote(want)
				return
			}
			errc <- ""
		}()
	}
	for range n {
		if msg := <-errc; msg != "" {
			t.Fatal(msg)
		}
	}
}

// TestOutputKeptUntilStartStreamReads makes the race deterministic: the
// process has fully ended before its Start stream begins to read.
func TestOutputKeptUntilStartStreamReads(t *testing.T) {
	testutil.RequiresRoot(t) // starts its process as the default user, root
	cfg := Config{}
	cfg.setDefaults()
	s := newProcesses(&cfg)
	f := false
	p, err := s.start(t.Context(), &process.StartRequest{Process: &process.ProcessConfig{Cmd: "/bin/echo", Args: []string{"hi"}}, Stdin: &f}, http.Header{})
	if err != nil {
		t.Fatal(err)
	}
	<-p.done
	var out strings.Builder
	err = s.follow(t.Context(), p, cursor{}, p.owner, time.Minute, func(ev *process.ProcessEvent) error {
		out.Write(ev.GetData().GetStdout())
		out.Write(ev.GetData().GetStderr())
		return nil
	})
	p.removeSub()
	if err != nil || out.String() != "hi\n" {
		t.Fatalf("output %q, %v", out.String(), err)
	}
}

// TestStartStreamLosesNoOutput: a Start stream that reads more slowly than
// the process writes still gets every byte (envd blocks the process; so do
// we), far beyond the retained-output cap.
func TestStartStreamLosesNoOutput(t *testing.T) {
	e := newEnv(t, Config{MaxOutputBytes: 256 << 10})
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	const n = 3 << 20
	s, err := e.proc.Start(ctx, startReq("/bin/sh", "-c", "head -c "+strconv.Itoa(n)+" /dev/zero | tr '\\0' a"))
	if err != nil {
		t.Fatal(err)
	}
	got := 0
	var end *process.ProcessEvent_EndEvent
	for i := 0; s.Receive(); i++ {
		ev := s.Msg().GetEvent()
		if d := ev.GetData().GetStdout(); d != nil {
			if bytes.Count(d, []byte("a")) != len(d) {
				t.Fatalf("unexpected output %q", d[:min(len(d), 200)])
			}
			got += len(d)
		}
		if ev.GetData().GetStderr() != nil {
			t.Fatalf("stderr %q", ev.GetData().GetStderr())
		}
		if ev.GetEnd() != nil {
			end = ev.GetEnd()
		}
		if i%8 == 0 {
			time.Sleep(time.Millisecond) // a slow reader (pacing, not synchronisation)
		}
	}
	if got != n || end == nil || end.ExitCode != 0 {
		t.Fatalf("got %d of %d bytes, end %v, err %v", got, n, end, s.Err())
	}
}
