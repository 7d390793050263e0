package apiserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// maxCommandArgs bounds an exec's argument count.
const maxCommandArgs = 4096

func validateStart(st *v1.ExecStart) error {
	if len(st.GetCommand()) == 0 || st.GetCommand()[0] == "" {
		return errdefs.Invalid("command", "is empty; give a program, e.g. [\"/bin/sh\",\"-c\",\"echo hi\"]")
	}
	if n := len(st.GetCommand()); n > maxCommandArgs {
		return errdefs.Invalid("command", "has %d arguments; at most %d are allowed — pass large input on stdin or in a file", n, maxCommandArgs)
	}
	total := 0
	for i, a := range st.GetCommand() {
		if !validPath(a) {
			return errdefs.Invalid("command", "arguments must be UTF-8 without NUL bytes")
		}
		if len(a) >= sandboxspec.MaxEnvEntryBytes {
			return errdefs.Invalid("command", "argument %d is %d bytes; one argument may be at most %d (the kernel's limit for exec)", i, len(a), sandboxspec.MaxEnvEntryBytes-1)
		}
		total += len(a) + 1
	}
	if total > sandboxspec.MaxEnvBytes {
		return errdefs.Invalid("command", "is %d bytes in all; at most %d are allowed — pass large input on stdin or in a file", total, sandboxspec.MaxEnvBytes)
	}
	if st.GetTimeoutSeconds() < 0 {
		return errdefs.Invalid("timeout_seconds", "%d must be ≥ 0 (0 means no limit beyond the sandbox's)", st.GetTimeoutSeconds())
	}
	if err := checkTimeout("timeout_seconds", st.GetTimeoutSeconds()); err != nil {
		return err
	}
	if err := validateEnv("env", st.GetEnv()); err != nil {
		return err
	}
	if err := validateUser("user", st.GetUser()); err != nil {
		return err
	}
	if len(st.GetCwd()) > sandboxspec.MaxPathLen {
		return errdefs.Invalid("cwd", "is %d bytes; a path has at most %d", len(st.GetCwd()), sandboxspec.MaxPathLen)
	}
	if st.GetCwd() != "" && !validPath(st.GetCwd()) {
		return errdefs.Invalid("cwd", "must be UTF-8 without NUL bytes")
	}
	if st.GetOutputLimitBytes() < 0 {
		return errdefs.Invalid("output_limit_bytes", "%d must be ≥ 0 (0 means no limit)", st.GetOutputLimitBytes())
	}
	if st.Pty != nil {
		if err := checkPtySize("pty", st.GetPty()); err != nil {
			return err
		}
	}
	return nil
}

func pidSelector(pid uint32) *process.ProcessSelector {
	return &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}
}

// Exec starts a process through the agent and relays its events. Stdin,
// close_stdin, resize and signal messages after the start become agent
// calls on the started pid.
//
// When the caller goes away the process keeps running, as in E2B: its pid
// was sent in ExecStarted, so it can be found with ListProcesses and ended
// with SignalProcess; its timeout_seconds and the sandbox's lifetime still
// bound it.
func (s *Server) Exec(ctx context.Context, stream *connect.BidiStream[v1.ExecRequest, v1.ExecResponse]) error {
	first, err := stream.Receive()
	if errors.Is(err, io.EOF) {
		return errdefs.Invalid("start", "the stream ended before the start message")
	}
	if err != nil {
		return err
	}
	st := first.GetStart()
	if st == nil {
		return errdefs.Invalid("start", "the first message must be start; stdin, close_stdin, resize and signal come after it")
	}
	a, err := s.agentFor(ctx, st.GetSandboxId())
	if err != nil {
		return err
	}
	if err := validateStart(st); err != nil {
		return err
	}
	if err := trajectory.ValidateCallID(st.GetCallId()); err != nil {
		return err
	}

	cfg := &process.ProcessConfig{Cmd: st.GetCommand()[0], Args: st.GetCommand()[1:], Envs: st.GetEnv()}
	if st.GetCwd() != "" {
		cfg.Cwd = proto.String(st.GetCwd())
	}
	sreq := &process.StartRequest{Process: cfg, Stdin: proto.Bool(st.GetStdin())}
	if st.GetTag() != "" {
		sreq.Tag = proto.String(st.GetTag())
	}
	isPty := st.Pty != nil
	if isPty {
		sreq.Pty = &process.PTY{Size: &process.PTY_Size{Cols: st.GetPty().GetCols(), Rows: st.GetPty().GetRows()}}
	}
	creq := connect.NewRequest(sreq)
	setUser(creq.Header(), st.GetUser())
	timeout := time.Duration(st.GetTimeoutSeconds()) * time.Second
	if timeout > 0 {
		// envd takes Start's Connect-Timeout-Ms as the process lifetime. It
		// is set as a header, not a context deadline, so that we still read
		// the exit event the agent sends when it kills the process.
		creq.Header().Set("Connect-Timeout-Ms", strconv.FormatInt(timeout.Milliseconds(), 10))
	}
	creq.Header().Set("Keepalive-Ping-Interval", "50")
	if id := st.GetCallId(); id != "" {
		creq.Header().Set(trajectory.CallIDHeader, id)
	}
	if lim := st.GetOutputLimitBytes(); lim > 0 {
		creq.Header().Set(trajectory.OutputLimitHeader, strconv.FormatInt(lim, 10))
	}

	// The caller's deadline must not reach the agent: connect would send it
	// as Connect-Timeout-Ms, replacing the process lifetime set above. The
	// call still ends when the caller goes away.
	pctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(nil)
	stopAfter := context.AfterFunc(ctx, func() { cancel(context.Cause(ctx)) })
	defer stopAfter()
	started := time.Now()
	out, err := a.proc.Start(pctx, creq)
	if err != nil {
		return a.agentErr(ctx, "start process", err)
	}
	defer out.Close()

	var inputOnce sync.Once
	replayed := false
	outCap := outputCap{limit: st.GetOutputLimitBytes()}
	for out.Receive() {
		switch e := out.Msg().GetEvent().GetEvent().(type) {
		case *process.ProcessEvent_Start:
			pid := e.Start.GetPid()
			h := out.ResponseHeader()
			replayed = h.Get(trajectory.ReplayedHeader) == "true"
			seq, _ := strconv.ParseUint(h.Get(trajectory.CallSeqHeader), 10, 64)
			started := &v1.ExecStarted{Pid: pid, Seq: seq, Replayed: replayed, Joined: h.Get(trajectory.JoinedHeader) == "true"}
			if err := stream.Send(&v1.ExecResponse{Event: &v1.ExecResponse_Started{Started: started}}); err != nil {
				return err
			}
			if replayed {
				continue // nothing runs: no input to relay
			}
			inputOnce.Do(func() { go s.relayInput(pctx, cancel, a, stream, pid, isPty, st.GetStdin() || isPty) })
		case *process.ProcessEvent_Data:
			var r *v1.ExecResponse
			switch d := e.Data.GetOutput().(type) {
			case *process.ProcessEvent_DataEvent_Stdout:
				if b := outCap.take(false, d.Stdout); len(b) > 0 {
					r = &v1.ExecResponse{Event: &v1.ExecResponse_Stdout{Stdout: b}}
				}
			case *process.ProcessEvent_DataEvent_Stderr:
				if b := outCap.take(true, d.Stderr); len(b) > 0 {
					r = &v1.ExecResponse{Event: &v1.ExecResponse_Stderr{Stderr: b}}
				}
			case *process.ProcessEvent_DataEvent_Pty:
				if b := outCap.take(false, d.Pty); len(b) > 0 {
					r = &v1.ExecResponse{Event: &v1.ExecResponse_Pty{Pty: b}}
				}
			}
			if r == nil {
				continue // past the output limit: read and dropped
			}
			if err := stream.Send(r); err != nil {
				return err
			}
		case *process.ProcessEvent_End:
			x := exitOf(e.End, timeout, time.Since(started))
			if replayed {
				// The recorded run's own timing decided timed_out.
				x.TimedOut = timeout > 0 && !e.End.GetExited() && x.ExitCode == -1 && strings.Contains(x.Status, "killed")
			}
			outCap.report(x)
			x.Replayed = replayed
			return stream.Send(&v1.ExecResponse{Event: &v1.ExecResponse_Exit{Exit: x}})
		}
	}
	err = out.Err()
	if cause := context.Cause(pctx); cause != nil && ctx.Err() == nil {
		// relayInput rejected a message.
		return cause
	}
	if timeout > 0 && connect.CodeOf(err) == connect.CodeDeadlineExceeded {
		x := &v1.ExecExit{ExitCode: -1, Status: fmt.Sprintf("killed after timeout_seconds=%d", st.GetTimeoutSeconds()), TimedOut: true}
		outCap.report(x)
		x.Replayed = replayed
		return stream.Send(&v1.ExecResponse{Event: &v1.ExecResponse_Exit{Exit: x}})
	}
	if err == nil {
		err = errdefs.New(errdefs.ErrUnavailable, "the agent ended the process stream without an exit event; the sandbox may have stopped")
	}
	return a.agentErr(ctx, "process stream", err)
}

// outputCap enforces ExecStart.output_limit_bytes: it passes at most limit
// bytes of each stream (stdout and PTY output together, stderr) and counts
// every byte, so the exit can report what was produced.
type outputCap struct {
	limit            int64 // 0: no limit
	stdout, stderr   int64 // bytes produced
	sentOut, sentErr int64
	truncated        bool
}

// take counts b and returns the part of it to send.
func (c *outputCap) take(isStderr bool, b []byte) []byte {
	total, sent := &c.stdout, &c.sentOut
	if isStderr {
		total, sent = &c.stderr, &c.sentErr
	}
	*total += int64(len(b))
	if c.limit == 0 {
		*sent += int64(len(b))
		return b
	}
	room := c.limit - *sent
	if room < int64(len(b)) {
		c.truncated = true
		b = b[:max(room, 0)]
	}
	*sent += int64(len(b))
	return b
}

func (c *outputCap) report(x *v1.ExecExit) {
	x.StdoutTotalBytes, x.StderrTotalBytes = c.stdout, c.stderr
	x.OutputTruncated = x.OutputTruncated || c.truncated
}

func exitOf(end *process.ProcessEvent_EndEvent, timeout, ran time.Duration) *v1.ExecExit {
	x := &v1.ExecExit{ExitCode: end.GetExitCode(), Status: end.GetStatus()}
	if !end.GetExited() && x.ExitCode == 0 {
		x.ExitCode = -1
	}
	if x.Status == "" {
		x.Status = end.GetError()
	}
	// Killed (not exited) at or after its lifetime: the timeout did it.
	x.TimedOut = timeout > 0 && !end.GetExited() && ran >= timeout-100*time.Millisecond
	return x
}

// relayInput turns the caller's messages after start into agent calls. It
// ends when the caller closes its side or the exec ends. A bad message
// ends the exec with an invalid-argument error (through cancel).
func (s *Server) relayInput(ctx context.Context, cancel context.CancelCauseFunc, a *agent, stream *connect.BidiStream[v1.ExecRequest, v1.ExecResponse], pid uint32, isPty, hasStdin bool) {
	for {
		msg, err := stream.Receive()
		if err != nil {
			return // caller closed its side or went away
		}
		var callErr error
		switch m := msg.GetMsg().(type) {
		case *v1.ExecRequest_Start:
			cancel(errdefs.Invalid("start", "only the first message may be start"))
			return
		case *v1.ExecRequest_Stdin:
			if !hasStdin {
				cancel(errdefs.Invalid("stdin", "the process was started without stdin; set start.stdin = true to send input"))
				return
			}
			in := &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: m.Stdin}}
			if isPty {
				in.Input = &process.ProcessInput_Pty{Pty: m.Stdin}
			}
			_, callErr = a.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: pidSelector(pid), Input: in}))
		case *v1.ExecRequest_CloseStdin:
			if m.CloseStdin {
				_, callErr = a.proc.CloseStdin(ctx, connect.NewRequest(&process.CloseStdinRequest{Process: pidSelector(pid)}))
			}
		case *v1.ExecRequest_Resize:
			if err := checkPtySize("resize", m.Resize); err != nil {
				cancel(err)
				return
			}
			_, callErr = a.proc.Update(ctx, connect.NewRequest(&process.UpdateRequest{Process: pidSelector(pid),
				Pty: &process.PTY{Size: &process.PTY_Size{Cols: m.Resize.GetCols(), Rows: m.Resize.GetRows()}}}))
		case *v1.ExecRequest_Signal:
			if err := checkSignal(m.Signal); err != nil {
				cancel(err)
				return
			}
			_, callErr = a.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pidSelector(pid), Signal: process.Signal(m.Signal)}))
		}
		if callErr != nil && ctx.Err() == nil {
			// Usually the process just exited; its exit event follows.
			log.G(ctx).Debug("exec input", log.SandboxID(a.id), log.Err(callErr))
		}
	}
}

// ListProcesses lists the processes the agent started.
func (s *Server) ListProcesses(ctx context.Context, req *connect.Request[v1.ListProcessesRequest]) (*connect.Response[v1.ListProcessesResponse], error) {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	resp, err := a.proc.List(ctx, connect.NewRequest(&process.ListRequest{}))
	if err != nil {
		return nil, a.agentErr(ctx, "list processes", err)
	}
	out := &v1.ListProcessesResponse{}
	for _, p := range resp.Msg.GetProcesses() {
		cfg := p.GetConfig()
		out.Processes = append(out.Processes, &v1.ProcessInfo{
			Pid:     p.GetPid(),
			Command: append([]string{cfg.GetCmd()}, cfg.GetArgs()...),
			Tag:     p.GetTag(),
			Cwd:     cfg.GetCwd(),
		})
	}
	return connect.NewResponse(out), nil
}

// SignalProcess sends SIGTERM or SIGKILL to a process.
func (s *Server) SignalProcess(ctx context.Context, req *connect.Request[v1.SignalProcessRequest]) (*connect.Response[v1.SignalProcessResponse], error) {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := firstErr(checkPid(req.Msg.GetPid()), checkSignal(req.Msg.GetSignal())); err != nil {
		return nil, err
	}
	_, err = a.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pidSelector(req.Msg.GetPid()), Signal: process.Signal(req.Msg.GetSignal())}))
	if err != nil {
		return nil, a.agentErr(ctx, "signal process", err)
	}
	return connect.NewResponse(&v1.SignalProcessResponse{}), nil
}

// SendInput writes to a process's stdin or PTY.
func (s *Server) SendInput(ctx context.Context, req *connect.Request[v1.SendInputRequest]) (*connect.Response[v1.SendInputResponse], error) {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := checkPid(req.Msg.GetPid()); err != nil {
		return nil, err
	}
	in := &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: req.Msg.GetData()}}
	if req.Msg.GetPty() {
		in.Input = &process.ProcessInput_Pty{Pty: req.Msg.GetData()}
	}
	if _, err := a.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: pidSelector(req.Msg.GetPid()), Input: in})); err != nil {
		return nil, a.agentErr(ctx, "send input", err)
	}
	return connect.NewResponse(&v1.SendInputResponse{}), nil
}

// ResizePty resizes a process's PTY.
func (s *Server) ResizePty(ctx context.Context, req *connect.Request[v1.ResizePtyRequest]) (*connect.Response[v1.ResizePtyResponse], error) {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := firstErr(checkPid(req.Msg.GetPid()), checkPtySize("size", req.Msg.GetSize())); err != nil {
		return nil, err
	}
	size := req.Msg.GetSize()
	if _, err := a.proc.Update(ctx, connect.NewRequest(&process.UpdateRequest{Process: pidSelector(req.Msg.GetPid()),
		Pty: &process.PTY{Size: &process.PTY_Size{Cols: size.GetCols(), Rows: size.GetRows()}}})); err != nil {
		return nil, a.agentErr(ctx, "resize pty", err)
	}
	return connect.NewResponse(&v1.ResizePtyResponse{}), nil
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}
