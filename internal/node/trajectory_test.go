package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// procAgent is an envd process service for every sandbox of a test: it
// runs no programs but scripted commands, and counts what it started.
//
//	echo ARGS...   prints ARGS and exits 0
//	append         appends a line to the sandbox's "file" and prints the count
//	block          prints "started", then waits until release(tag) and exits 0
//	fail N         prints "bad" on stderr and exits N
type procAgent struct {
	processconnect.UnimplementedProcessHandler
	mu      sync.Mutex
	starts  int
	lines   int
	nextPid uint32
	procs   map[uint32]*fakeProc
	release map[string]chan struct{}
	writes  int               // uploads written
	files   map[string]string // path → content of the last write
	conns   chan net.Conn
	closed  chan struct{}
	srv     *http.Server
	interp  *fakeInterp // the code interpreter behind the port tunnel
}

type fakeProc struct {
	done chan struct{}
	code int32
}

func newProcAgent(t *testing.T) *procAgent {
	a := &procAgent{nextPid: 100, procs: map[uint32]*fakeProc{}, release: map[string]chan struct{}{}, files: map[string]string{}, conns: make(chan net.Conn), closed: make(chan struct{})}
	mux := http.NewServeMux()
	mux.Handle(processconnect.NewProcessHandler(a))
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	mux.HandleFunc("POST /files", a.serveUpload)
	a.interp = newFakeInterp(t)
	mux.HandleFunc("GET /_opendsec/port/{port}", a.interp.serveTunnel)
	a.srv = &http.Server{Handler: mux}
	go a.srv.Serve(chanListener{a.conns, a.closed})
	t.Cleanup(func() {
		close(a.closed)
		a.srv.Close()
	})
	return a
}

// chanListener accepts the server ends of AgentConn's pipes.
type chanListener struct {
	c      chan net.Conn
	closed chan struct{}
}

func (l chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.c:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}
func (l chanListener) Close() error   { return nil }
func (l chanListener) Addr() net.Addr { return &net.UnixAddr{Name: "fake", Net: "unix"} }

// serveUpload is the agent's POST /files: a plain or multipart body to
// ?path= (or the part's filename); a path under /forbidden is refused
// before the body is read.
func (a *procAgent) serveUpload(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Query().Get("path")
	if strings.HasPrefix(p, "/forbidden") {
		http.Error(w, `{"code":403,"message":"permission denied"}`, http.StatusForbidden)
		return
	}
	var content []byte
	var err error
	if ct, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); ct == "multipart/form-data" {
		mr := multipart.NewReader(r.Body, params["boundary"])
		part, perr := mr.NextPart()
		if perr != nil {
			http.Error(w, perr.Error(), http.StatusBadRequest)
			return
		}
		if p == "" {
			p = part.FileName()
		}
		content, err = io.ReadAll(part)
	} else {
		content, err = io.ReadAll(r.Body)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	a.mu.Lock()
	a.writes++
	a.files[p] = string(content)
	a.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `[{"path":%q,"name":"x","type":"file"}]`, p)
}

func (a *procAgent) writeCount() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.writes
}

func (a *procAgent) gate(tag string) chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	ch, ok := a.release[tag]
	if !ok {
		ch = make(chan struct{})
		a.release[tag] = ch
	}
	return ch
}

func (a *procAgent) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	cfg := req.Msg.GetProcess()
	a.mu.Lock()
	a.starts++
	a.nextPid++
	pid := a.nextPid
	p := &fakeProc{done: make(chan struct{})}
	a.procs[pid] = p
	a.mu.Unlock()
	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.StartResponse{Event: ev}) }
	if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: pid}}}); err != nil {
		return err
	}
	out := func(s string) error {
		return send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stdout{Stdout: []byte(s)}}}})
	}
	var code int32
	switch cfg.GetCmd() {
	case "echo":
		if err := out(strings.Join(cfg.GetArgs(), " ") + "\n"); err != nil {
			return err
		}
	case "append":
		a.mu.Lock()
		a.lines++
		n := a.lines
		a.mu.Unlock()
		if err := out(strconv.Itoa(n) + "\n"); err != nil {
			return err
		}
	case "block":
		if err := out("started\n"); err != nil {
			return err
		}
		select {
		case <-a.gate(req.Msg.GetTag()):
		case <-ctx.Done():
			// As envd: the process outlives its caller; Connect finds it.
			<-a.gate(req.Msg.GetTag())
			close(p.done)
			return ctx.Err()
		}
		if err := out("released\n"); err != nil {
			return err
		}
	case "fail":
		c, _ := strconv.Atoi(cfg.GetArgs()[0])
		code = int32(c)
		if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stderr{Stderr: []byte("bad\n")}}}}); err != nil {
			return err
		}
	}
	p.code = code
	close(p.done)
	end := send(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: &process.ProcessEvent_EndEvent{ExitCode: code, Exited: true, Status: "exit status " + strconv.Itoa(int(code))}}})
	if cfg.GetCmd() == "endhold" {
		// The end is sent; the stream stays open until release(tag).
		close(a.gate(req.Msg.GetTag() + ":ended"))
		<-a.gate(req.Msg.GetTag())
	}
	return end
}

func (a *procAgent) Connect(ctx context.Context, req *connect.Request[process.ConnectRequest], stream *connect.ServerStream[process.ConnectResponse]) error {
	pid := req.Msg.GetProcess().GetPid()
	a.mu.Lock()
	p, ok := a.procs[pid]
	a.mu.Unlock()
	if !ok {
		return connect.NewError(connect.CodeNotFound, errors.New("no such process"))
	}
	if err := stream.Send(&process.ConnectResponse{Event: &process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: pid}}}}); err != nil {
		return err
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	return stream.Send(&process.ConnectResponse{Event: &process.ProcessEvent{Event: &process.ProcessEvent_End{End: &process.ProcessEvent_EndEvent{ExitCode: p.code, Exited: true, Status: "exit status 0"}}}})
}

func (a *procAgent) startCount() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.starts
}

// agentRuntime is the fake backend with procAgent behind every sandbox.
type agentRuntime struct {
	*runtimefake.Runtime
	agent *procAgent
}

func (r agentRuntime) AgentConn(ctx context.Context, id string) (net.Conn, error) {
	if _, err := r.Status(ctx, id); err != nil {
		return nil, err
	}
	// A unix socket pair, buffered like the real agent's socket (a
	// net.Pipe is not: an answer sent before the body was read would race
	// the body's write, which a real socket's buffer takes).
	c, s, err := socketPair()
	if err != nil {
		return nil, err
	}
	select {
	case r.agent.conns <- s:
		return c, nil
	case <-r.agent.closed:
		return nil, net.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// socketPair is a connected pair of unix stream sockets.
func socketPair() (net.Conn, net.Conn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		return nil, nil, err
	}
	unix.CloseOnExec(fds[0])
	unix.CloseOnExec(fds[1])
	var conns [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "agent")
		c, err := net.FileConn(f) // a dup: f is closed either way
		_ = f.Close()
		if err != nil {
			if i == 1 {
				_ = conns[0].Close()
			} else {
				_ = unix.Close(fds[1])
			}
			return nil, nil, err
		}
		conns[i] = c
	}
	return conns[0], conns[1], nil
}

// trajFixture is a node over agentRuntime, restartable over the same
// state dir and backend state.
type trajFixture struct {
	cfg   Config
	root  string
	agent *procAgent
	n     *Node
	srv   *httptest.Server
	// wrap, when set, wraps the backend (e.g. diffOnly).
	wrap func(runtime.Runtime) runtime.Runtime
}

func newTrajFixture(t *testing.T, mutate ...func(*trajFixture)) *trajFixture {
	f := &trajFixture{root: t.Name() + "-" + sandboxid.New("fake"), agent: newProcAgent(t)}
	f.cfg = Config{
		ID:             "t001",
		StateDir:       t.TempDir(),
		DefaultBackend: runtimefake.Name,
		Images:         images{layer: t.TempDir(), mu: new(sync.Mutex), holds: map[string]bool{}},
		CPU:            4,
		MemoryMB:       4096,
		ReapInterval:   20 * time.Millisecond,
	}
	for _, m := range mutate {
		m(f)
	}
	f.start(t)
	t.Cleanup(func() {
		f.n.StopAll(context.Background(), "test cleanup")
		f.n.Close()
		f.srv.Close()
	})
	return f
}

// start opens the node (again), with a fresh backend over the same state.
func (f *trajFixture) start(t *testing.T) {
	t.Helper()
	fake := runtimefake.New(runtimefake.Config{StateRoot: f.root})
	var rt runtime.Runtime = agentRuntime{Runtime: fake, agent: f.agent}
	if f.wrap != nil {
		rt = f.wrap(rt)
	}
	f.cfg.Backends = map[string]runtime.Runtime{runtimefake.Name: rt}
	n, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.n = n
	f.srv = httptest.NewServer(n.AgentProxy())
}

// restart is a node killed (nothing of it runs on) and started again.
func (f *trajFixture) restart(t *testing.T) {
	t.Helper()
	f.srv.CloseClientConnections()
	f.srv.Close()
	f.n.Close()
	f.start(t)
}

func (f *trajFixture) create(t *testing.T) string {
	t.Helper()
	rec, err := f.n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "root/busybox"}})
	if err != nil {
		t.Fatal(err)
	}
	return rec.ID
}

type execResult struct {
	pid      uint32
	out, err string
	code     int32
	ended    bool
	replayed bool
	joined   bool
	seq      string
	rpcErr   error
}

// exec runs cmd through the node's agent proxy as the apiserver does.
func (f *trajFixture) exec(ctx context.Context, id, callID, tag string, cmd ...string) execResult {
	client := processconnect.NewProcessClient(http.DefaultClient, f.srv.URL+AgentPrefix+id)
	req := connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: cmd[0], Args: cmd[1:]}})
	if tag != "" {
		req.Msg.Tag = &tag
	}
	if callID != "" {
		req.Header().Set(CallIDHeader, callID)
	}
	var r execResult
	out, err := client.Start(ctx, req)
	if err != nil {
		r.rpcErr = err
		return r
	}
	defer out.Close()
	for out.Receive() {
		r.replayed = out.ResponseHeader().Get(ReplayedHeader) == "true"
		r.joined = out.ResponseHeader().Get(JoinedHeader) == "true"
		r.seq = out.ResponseHeader().Get(CallSeqHeader)
		switch e := out.Msg().GetEvent().GetEvent().(type) {
		case *process.ProcessEvent_Start:
			r.pid = e.Start.GetPid()
		case *process.ProcessEvent_Data:
			r.out += string(e.Data.GetStdout())
			r.err += string(e.Data.GetStderr())
		case *process.ProcessEvent_End:
			r.code, r.ended = e.End.GetExitCode(), true
		}
	}
	r.rpcErr = out.Err()
	return r
}

// TestTrajectoryReplaysKnownCallIDs: a 20-call rollout, one call appending;
// the same 20 call IDs again run nothing and return the recorded results
// marked replayed; the log holds the 20 in order with their output.
func TestTrajectoryReplaysKnownCallIDs(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	ctx := t.Context()
	step := func(i int) (string, []string) {
		cid := "rollout-1/" + strconv.Itoa(i)
		switch {
		case i == 7:
			return cid, []string{"append"}
		case i == 12:
			return cid, []string{"fail", "3"}
		}
		return cid, []string{"echo", "step", strconv.Itoa(i)}
	}
	first := make([]execResult, 20)
	for i := range 20 {
		cid, cmd := step(i)
		first[i] = f.exec(ctx, id, cid, "", cmd...)
		if first[i].rpcErr != nil || !first[i].ended || first[i].replayed {
			t.Fatalf("call %d: %+v", i, first[i])
		}
	}
	if n := f.agent.startCount(); n != 20 {
		t.Fatalf("%d starts for 20 calls", n)
	}
	for i := range 20 {
		cid, cmd := step(i)
		again := f.exec(ctx, id, cid, "", cmd...)
		if !again.replayed || again.out != first[i].out || again.err != first[i].err || again.code != first[i].code || again.pid != first[i].pid || again.seq != strconv.Itoa(i+1) {
			t.Fatalf("replay of call %d: %+v; want the recorded %+v, replayed", i, again, first[i])
		}
	}
	if n := f.agent.startCount(); n != 20 {
		t.Fatalf("%d starts after the replay; want still 20", n)
	}
	if f.agent.lines != 1 {
		t.Fatalf("the append ran %d times", f.agent.lines)
	}
	_, calls, err := f.n.Trajectory(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) != 20 || calls[7].Req.Command[0] != "append" || calls[12].ExitCode != 3 || string(calls[12].Output[0].Data) != "bad\n" || calls[12].Output[0].Stream != trajectory.Stderr {
		t.Fatalf("log: %d calls, %+v", len(calls), calls[12])
	}
	// A call without an ID is logged and always runs.
	f.exec(ctx, id, "", "", "echo", "x")
	f.exec(ctx, id, "", "", "echo", "x")
	if n := f.agent.startCount(); n != 22 {
		t.Fatalf("%d starts; calls without a call ID must run each time", n)
	}
}

// TestTrajectoryEndRecordedBeforeCallerSeesIt: a call's end is in the log
// before its caller is shown it, so a caller that got the result (and a
// trainer that moved on) finds it there even if the node dies right after.
// The agent here sends the end and holds its stream open: the old order
// showed the caller the end while the call was still running in the log.
func TestTrajectoryEndRecordedBeforeCallerSeesIt(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	ctx := t.Context()
	seen := make(chan string, 1) // the call's state in the log when its caller saw the end
	go func() {
		client := processconnect.NewProcessClient(http.DefaultClient, f.srv.URL+AgentPrefix+id)
		tag := "hold"
		req := connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "endhold"}, Tag: &tag})
		req.Header().Set(CallIDHeader, "held-1")
		out, err := client.Start(ctx, req)
		if err != nil {
			seen <- "start: " + err.Error()
			return
		}
		defer out.Close()
		for out.Receive() {
			if out.Msg().GetEvent().GetEnd() != nil {
				_, calls, err := f.n.Trajectory(ctx, id)
				if err != nil || len(calls) != 1 {
					seen <- fmt.Sprintf("log: %d calls, %v", len(calls), err)
					return
				}
				seen <- calls[0].State
				return
			}
		}
		seen <- fmt.Sprintf("stream ended without an end: %v", out.Err())
	}()
	<-f.agent.gate("hold:ended") // the agent sent the end and holds the stream
	var got string
	select {
	case got = <-seen: // the caller was shown the end before the stream ended
		close(f.agent.gate("hold"))
	case <-time.After(time.Second): // it is not: let the stream end
		close(f.agent.gate("hold"))
		got = <-seen
	}
	if got != trajectory.StateDone {
		t.Fatalf("the call's state in the log when its caller saw the end: %q; want %q", got, trajectory.StateDone)
	}
}

// TestTrajectoryRefusesReusedCallID: a call ID with another command is a
// failed precondition naming both; a 10 KB call ID is invalid.
func TestTrajectoryRefusesReusedCallID(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	ctx := t.Context()
	f.exec(ctx, id, "c1", "", "echo", "one")
	r := f.exec(ctx, id, "c1", "", "echo", "two")
	if connect.CodeOf(r.rpcErr) != connect.CodeFailedPrecondition || !strings.Contains(r.rpcErr.Error(), `"one"`) || !strings.Contains(r.rpcErr.Error(), `"two"`) {
		t.Fatalf("reused call ID: %v; want failed_precondition naming both commands", r.rpcErr)
	}
	r = f.exec(ctx, id, strings.Repeat("k", 10<<10), "", "echo")
	if connect.CodeOf(r.rpcErr) != connect.CodeInvalidArgument || !strings.Contains(r.rpcErr.Error(), "call_id") || !strings.Contains(r.rpcErr.Error(), "256") {
		t.Fatalf("10 KB call ID: %v; want invalid_argument naming call_id and the limit", r.rpcErr)
	}
	if n := f.agent.startCount(); n != 1 {
		t.Fatalf("%d starts; the refused calls must not run", n)
	}
}

// TestTrajectoryJoinsRunningCall: a caller that goes away mid-call and
// comes back with the same call ID joins the process (its output so far,
// then the rest and the exit) instead of starting it again.
func TestTrajectoryJoinsRunningCall(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	cctx, cancel := context.WithCancel(t.Context())
	client := processconnect.NewProcessClient(http.DefaultClient, f.srv.URL+AgentPrefix+id)
	tag := "j1"
	req := connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "block"}, Tag: &tag})
	req.Header().Set(CallIDHeader, "long")
	out, err := client.Start(cctx, req)
	if err != nil {
		t.Fatal(err)
	}
	for out.Receive() {
		if string(out.Msg().GetEvent().GetData().GetStdout()) == "started\n" {
			break
		}
	}
	cancel() // the trainer vanished
	out.Close()
	// A new caller with the same ID joins: it gets the output so far
	// while the process still runs, then the rest once it is released.
	req = connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "block"}, Tag: &tag})
	req.Header().Set(CallIDHeader, "long")
	out, err = client.Start(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	var got string
	var ended bool
	for out.Receive() {
		if out.ResponseHeader().Get(JoinedHeader) != "true" {
			t.Fatalf("second caller not marked joined: %v", out.ResponseHeader())
		}
		got += string(out.Msg().GetEvent().GetData().GetStdout())
		if got == "started\n" {
			close(f.agent.gate(tag)) // only now does the process go on
		}
		if out.Msg().GetEvent().GetEnd() != nil {
			ended = true
		}
	}
	if got != "started\nreleased\n" || !ended || out.Err() != nil {
		t.Fatalf("joined call: %q ended=%v err=%v; want all its output and its exit", got, ended, out.Err())
	}
	if n := f.agent.startCount(); n != 1 {
		t.Fatalf("%d starts; the join must not start it again", n)
	}
	if r := f.exec(t.Context(), id, "long", tag, "block"); !r.replayed || r.out != "started\nreleased\n" {
		t.Fatalf("after its end: %+v; want replayed", r)
	}
}

func waitCall(t *testing.T, n *Node, id, callID string, ok func(*trajectory.Call) bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		lg, err := n.traj.Log(id, trajectory.Meta{})
		if err == nil {
			if c := lg.Find(callID); c != nil {
				seen, ch := lg.Watch(c.Seq)
				if ok(seen) {
					return
				}
				select {
				case <-ch:
				case <-time.After(100 * time.Millisecond):
				}
				continue
			}
		}
		time.Sleep(5 * time.Millisecond) // the call not begun yet
	}
	t.Fatalf("call %q did not reach the state within 5 s", callID)
}

// TestTrajectorySurvivesNodeRestartAndPause: the log and its exactly-once
// answers survive a node restart and a pause/resume; a call running across
// the restart is re-attached and its end recorded; a fork's log starts with
// its parent's; a stopped sandbox's log stays readable.
func TestTrajectorySurvivesNodeRestartAndPause(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	ctx := t.Context()
	a := f.exec(ctx, id, "s0", "", "append")
	// A call running when the node goes.
	bctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go f.exec(bctx, id, "s1", "r1", "block")
	waitCall(t, f.n, id, "s1", func(c *trajectory.Call) bool { return c.Pid != 0 })

	f.restart(t)
	cancel()
	if r := f.exec(ctx, id, "s0", "", "append"); !r.replayed || r.out != a.out {
		t.Fatalf("after restart: %+v; want the recorded %q replayed", r, a.out)
	}
	close(f.agent.gate("r1"))
	waitCall(t, f.n, id, "s1", func(c *trajectory.Call) bool { return c.State == trajectory.StateDone })
	if r := f.exec(ctx, id, "s1", "r1", "block"); !r.replayed || !r.ended || r.code != 0 {
		t.Fatalf("call that ran across the restart: %+v; want its recorded end", r)
	}
	// Its output from before the restart ("started") was never recorded:
	// the record says so, so no replay passes it off as whole.
	waitCall(t, f.n, id, "s1", func(c *trajectory.Call) bool { return c.Truncated })
	if _, err := f.n.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := f.n.Resume(ctx, id, 0); err != nil {
		t.Fatal(err)
	}
	if r := f.exec(ctx, id, "s0", "", "append"); !r.replayed {
		t.Fatalf("after pause/resume: %+v", r)
	}
	if f.agent.lines != 1 || f.agent.startCount() != 2 {
		t.Fatalf("append ran %d times, %d starts; want 1 and 2", f.agent.lines, f.agent.startCount())
	}

	out, err := f.n.Fork(ctx, ForkRequest{SourceID: id, Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	fork := out.Forks[0].Sandbox.id
	meta, calls, err := f.n.Trajectory(ctx, fork)
	if err != nil || meta.ParentID != id || len(calls) != 2 || calls[0].Origin != id {
		t.Fatalf("fork log: %+v %d calls %v", meta, len(calls), err)
	}
	if r := f.exec(ctx, fork, "s0", "", "append"); !r.replayed {
		t.Fatalf("parent's call ID in the fork: %+v; want replayed", r)
	}

	if err := f.n.Stop(ctx, id, "test"); err != nil {
		t.Fatal(err)
	}
	if meta, calls, err := f.n.Trajectory(ctx, id); err != nil || len(calls) != 2 || meta.Closed.IsZero() {
		t.Fatalf("stopped sandbox's log: %+v %d %v", meta, len(calls), err)
	}
}

// TestTrajectoryInterruptedCallNotRerun: a call whose process ended while
// no node read it (its end lost) is marked interrupted and refused, not
// run again.
func TestTrajectoryInterruptedCallNotRerun(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	lg, err := f.n.traj.Log(id, trajectory.Meta{})
	if err != nil {
		t.Fatal(err)
	}
	// As a node killed after the begin and the pid were written.
	c, _, err := lg.Begin("gone", trajectory.Request{Kind: trajectory.KindExec, Command: []string{"append"}}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := lg.SetPid(c.Seq, 9999); err != nil {
		t.Fatal(err)
	}
	f.restart(t)
	waitCall(t, f.n, id, "gone", func(c *trajectory.Call) bool { return c.State == trajectory.StateInterrupted })
	r := f.exec(t.Context(), id, "gone", "", "append")
	if connect.CodeOf(r.rpcErr) != connect.CodeFailedPrecondition || !strings.Contains(r.rpcErr.Error(), "not run again") {
		t.Fatalf("interrupted call: %+v; want failed_precondition saying it was not run again", r)
	}
	if f.agent.lines != 0 {
		t.Fatal("the interrupted call ran again")
	}
}

// TestTrajectoryOtherPrincipalRefused: a user sees only the logs of
// sandboxes it owns, also after the stop.
func TestTrajectoryOtherPrincipalRefused(t *testing.T) {
	f := newTrajFixture(t)
	alice := auth.WithClaims(t.Context(), auth.Claims{Subject: "alice", Scope: auth.ScopeUser})
	bob := auth.WithClaims(t.Context(), auth.Claims{Subject: "bob", Scope: auth.ScopeUser})
	rec, err := f.n.Create(alice, CreateRequest{ID: sandboxid.New(f.cfg.ID), Owner: "alice", Spec: specRecord{Image: "root/busybox"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := f.exec(t.Context(), rec.ID, "x", "", "echo", "secret"); r.rpcErr != nil {
		t.Fatal(r.rpcErr)
	}
	if m, _, _ := f.n.traj.Read(rec.ID); m.Owner != "alice" {
		t.Fatalf("log owner %+v", m)
	}
	if _, calls, err := f.n.Trajectory(alice, rec.ID); err != nil || len(calls) != 1 {
		t.Fatalf("owner: %d %v", len(calls), err)
	}
	if _, _, err := f.n.Trajectory(bob, rec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("other principal: %v; want not found", err)
	}
	if err := f.n.Stop(t.Context(), rec.ID, "test"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.n.Trajectory(bob, rec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("other principal after stop: %v; want not found", err)
	}
}
