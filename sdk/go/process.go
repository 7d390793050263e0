package opendsec

import (
	"bytes"
	"context"
	"io"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// PtySize is a terminal size in character cells.
type PtySize struct {
	Cols, Rows uint32
}

// ExecOptions describes a process to start in a sandbox.
type ExecOptions struct {
	// Command is the program and its arguments, run as is (no shell). Use
	// RunShell, or {"/bin/sh", "-c", line}, for a shell line.
	Command []string
	Env     map[string]string
	// Cwd is the working directory; empty means the sandbox's.
	Cwd string
	// User runs the process as this user; empty means the sandbox's default.
	User string
	// Stdin keeps a stdin pipe open for SendStdin until CloseStdin.
	Stdin bool
	// Timeout kills the process after this long; 0 means no limit beyond
	// the sandbox's lifetime.
	Timeout time.Duration
	// PTY, when set, runs the process on a pseudo-terminal of this size.
	// Terminal output arrives as stdout.
	PTY *PtySize
	// Tag names the process so it can be found later.
	Tag string
	// OutputLimit, when > 0, has the server send at most this many bytes
	// of each of stdout and stderr (PTY output counts as stdout) and drop
	// the rest; the process still runs to its end and ExitStatus reports
	// OutputTruncated and the full byte counts. 0 sends everything.
	OutputLimit int64
	// CallID makes the call exactly-once through the sandbox's trajectory
	// log: a call whose ID is already in the log returns the recorded
	// result (Process.Replayed) without running anything, one still
	// running is joined (Process.Joined), and one whose request differs is
	// refused with CodeFailedPrecondition naming both. At most 256 bytes.
	CallID string

	// Stdout and Stderr receive the process's output as it arrives. Exec
	// keeps none of it: bound what your writers keep (RunShell keeps at
	// most DefaultOutputLimit bytes of each).
	Stdout, Stderr io.Writer
	// OnStdout and OnStderr are called with each output chunk, after the
	// writers. The slice is not reused.
	OnStdout, OnStderr func([]byte)
}

// ExitStatus is how a process ended.
type ExitStatus struct {
	// ExitCode is the process's exit code, -1 when a signal killed it.
	ExitCode int
	// Status is a description such as "exit status 1" or "signal: killed".
	Status string
	// TimedOut reports whether ExecOptions.Timeout killed the process.
	TimedOut bool
	// OutputTruncated reports whether the server dropped output past
	// ExecOptions.OutputLimit.
	OutputTruncated bool
	// StdoutBytes and StderrBytes count what the process wrote to each
	// stream, sent or dropped (0 from servers that do not count).
	StdoutBytes, StderrBytes int64
	// Replayed: the result is the trajectory log's record of an earlier
	// call with the same CallID; nothing ran.
	Replayed bool
}

// Process is a running process in a sandbox, started with Exec. Its output
// is delivered by a goroutine to the ExecOptions writers and callbacks, in
// the order the server sent it; call Wait to learn how it ended.
type Process struct {
	stream *connect.BidiStreamForClient[opendsecv1.ExecRequest, opendsecv1.ExecResponse]
	opts   ExecOptions
	pid    uint32
	// seq is the call's number in the sandbox's trajectory log; replayed
	// and joined say it did not start a process (see ExecOptions.CallID).
	seq              uint64
	replayed, joined bool

	// sendMu serialises Send and CloseRequest on stream, which are not
	// safe for concurrent use.
	sendMu sync.Mutex

	done chan struct{} // closed when exit and err are final
	exit *ExitStatus
	err  error
}

// Seq is the call's number in the sandbox's trajectory log (0 when the
// node keeps none).
func (p *Process) Seq() uint64 { return p.seq }

// Replayed reports that the call's ID was in the trajectory log with its
// result: the events are the recorded ones and nothing ran.
func (p *Process) Replayed() bool { return p.replayed }

// Joined reports that the call's ID was in the log still running: this
// follows that process instead of starting another.
func (p *Process) Joined() bool { return p.joined }

// Exec starts a process in sandbox id and returns once the sandbox has
// started it. ctx bounds the whole process: cancelling it ends the stream.
func (c *Client) Exec(ctx context.Context, id string, opts ExecOptions) (*Process, error) {
	if len(opts.Command) == 0 {
		return nil, invalid("command", "must not be empty; give the program and its arguments")
	}
	start := &opendsecv1.ExecStart{
		SandboxId:        id,
		Command:          opts.Command,
		Env:              opts.Env,
		Cwd:              opts.Cwd,
		User:             opts.User,
		Stdin:            opts.Stdin,
		TimeoutSeconds:   int64((opts.Timeout + time.Second - 1) / time.Second),
		Tag:              opts.Tag,
		OutputLimitBytes: max(opts.OutputLimit, 0),
		CallId:           opts.CallID,
	}
	if opts.PTY != nil {
		start.Pty = &opendsecv1.PtySize{Cols: opts.PTY.Cols, Rows: opts.PTY.Rows}
	}
	p := &Process{stream: c.processes.Exec(ctx), opts: opts, done: make(chan struct{})}
	if err := p.stream.Send(&opendsecv1.ExecRequest{Msg: &opendsecv1.ExecRequest_Start{Start: start}}); err != nil && !isEOF(err) {
		p.closeStream()
		return nil, convertError(err)
	}
	// Read up to the started event so a bad command or sandbox fails here.
	for {
		resp, err := p.stream.Receive()
		if err != nil {
			p.closeStream()
			if isEOF(err) {
				return nil, &Error{Code: CodeInternal, Message: "exec stream ended before the process started"}
			}
			return nil, convertError(err)
		}
		if s := resp.GetStarted(); s != nil {
			p.pid = s.GetPid()
			p.seq, p.replayed, p.joined = s.GetSeq(), s.GetReplayed(), s.GetJoined()
			break
		}
		if p.handle(resp) {
			// Exited before a started event: nothing more to read.
			p.finish(nil)
			return p, nil
		}
	}
	go p.readLoop()
	return p, nil
}

// PID returns the process ID inside the sandbox.
func (p *Process) PID() uint32 { return p.pid }

// readLoop delivers events until the exit event or a stream error.
func (p *Process) readLoop() {
	for {
		resp, err := p.stream.Receive()
		if err != nil {
			if isEOF(err) {
				p.finish(&Error{Code: CodeInternal, Message: "exec stream ended without an exit status"})
			} else {
				p.finish(convertError(err))
			}
			return
		}
		if p.handle(resp) {
			p.finish(nil)
			return
		}
	}
}

// handle delivers one event and reports whether it was the exit event.
func (p *Process) handle(resp *opendsecv1.ExecResponse) bool {
	switch ev := resp.GetEvent().(type) {
	case *opendsecv1.ExecResponse_Stdout:
		deliver(ev.Stdout, p.opts.Stdout, p.opts.OnStdout)
	case *opendsecv1.ExecResponse_Pty:
		deliver(ev.Pty, p.opts.Stdout, p.opts.OnStdout)
	case *opendsecv1.ExecResponse_Stderr:
		deliver(ev.Stderr, p.opts.Stderr, p.opts.OnStderr)
	case *opendsecv1.ExecResponse_Exit:
		p.exit = &ExitStatus{
			ExitCode:        int(ev.Exit.GetExitCode()),
			Status:          ev.Exit.GetStatus(),
			TimedOut:        ev.Exit.GetTimedOut(),
			OutputTruncated: ev.Exit.GetOutputTruncated(),
			StdoutBytes:     ev.Exit.GetStdoutTotalBytes(),
			StderrBytes:     ev.Exit.GetStderrTotalBytes(),
			Replayed:        ev.Exit.GetReplayed(),
		}
		return true
	}
	return false
}

func deliver(b []byte, w io.Writer, fn func([]byte)) {
	if w != nil {
		// A failing local writer must not stall the process's stream;
		// the caller sees its own writer's errors.
		_, _ = w.Write(b)
	}
	if fn != nil {
		fn(b)
	}
}

func (p *Process) finish(err error) {
	p.err = err
	p.closeStream()
	close(p.done)
}

func (p *Process) closeStream() {
	p.sendMu.Lock()
	_ = p.stream.CloseRequest()
	p.sendMu.Unlock()
	_ = p.stream.CloseResponse()
}

// send sends one request; after the process has ended it reports that.
func (p *Process) send(req *opendsecv1.ExecRequest) error {
	select {
	case <-p.done:
		return &Error{Code: CodeFailedPrecondition, Message: "process has exited"}
	default:
	}
	p.sendMu.Lock()
	err := p.stream.Send(req)
	p.sendMu.Unlock()
	if err == nil {
		return nil
	}
	if isEOF(err) {
		// The server ended the stream; the reason comes with Wait.
		<-p.done
		if p.err != nil {
			return p.err
		}
		return &Error{Code: CodeFailedPrecondition, Message: "process has exited"}
	}
	return convertError(err)
}

// SendStdin writes data to the process's stdin (or its terminal with a PTY).
func (p *Process) SendStdin(data []byte) error {
	return p.send(&opendsecv1.ExecRequest{Msg: &opendsecv1.ExecRequest_Stdin{Stdin: data}})
}

// CloseStdin closes the process's stdin so it reads end of file.
func (p *Process) CloseStdin() error {
	return p.send(&opendsecv1.ExecRequest{Msg: &opendsecv1.ExecRequest_CloseStdin{CloseStdin: true}})
}

// Signal sends sig (e.g. syscall.SIGTERM) to the process.
func (p *Process) Signal(sig syscall.Signal) error {
	return p.send(&opendsecv1.ExecRequest{Msg: &opendsecv1.ExecRequest_Signal{Signal: int32(sig)}})
}

// Resize changes the size of the process's pseudo-terminal.
func (p *Process) Resize(cols, rows uint32) error {
	return p.send(&opendsecv1.ExecRequest{Msg: &opendsecv1.ExecRequest_Resize{Resize: &opendsecv1.PtySize{Cols: cols, Rows: rows}}})
}

// Done returns a channel closed when the process has ended and all its
// output has been delivered.
func (p *Process) Done() <-chan struct{} { return p.done }

// Wait blocks until the process ends and all its output has been delivered,
// and returns how it ended. A non-zero exit code is not an error; an error
// means the stream broke (e.g. the sandbox was stopped or ctx ended).
func (p *Process) Wait() (*ExitStatus, error) {
	<-p.done
	if p.err != nil {
		return nil, p.err
	}
	return p.exit, nil
}

// DefaultOutputLimit is how many bytes of each output stream (stdout,
// stderr) RunShell keeps unless WithOutputLimit says otherwise. Output past
// it is counted, not kept, and the Result has OutputTruncated set.
const DefaultOutputLimit = 16 << 20

// Result is the outcome of RunShell.
type Result struct {
	// Stdout and Stderr are the first output-limit bytes of each stream.
	Stdout   string
	Stderr   string
	ExitCode int
	// Status is e.g. "exit status 1" or "signal: killed".
	Status string
	// TimedOut reports whether the process's timeout killed it.
	TimedOut bool
	// OutputTruncated reports that output is missing: a stream produced
	// more than the output limit (see StdoutBytes, StderrBytes), or the
	// server dropped output read too slowly.
	OutputTruncated bool
	// StdoutBytes and StderrBytes count every byte the process wrote to
	// each stream, kept or not.
	StdoutBytes, StderrBytes int64
	// Replayed: the trajectory log's record of an earlier call with the
	// same call ID (WithCallID); the command did not run again.
	Replayed bool
	// Seq is the call's number in the sandbox's trajectory log.
	Seq uint64
}

// RunOption changes how RunShell runs its command.
type RunOption func(*runConfig)

type runConfig struct {
	limit   int64
	timeout time.Duration
	callID  string
}

// WithCallID makes the command exactly-once (see ExecOptions.CallID).
func WithCallID(id string) RunOption { return func(c *runConfig) { c.callID = id } }

// WithOutputLimit keeps at most n bytes of each output stream in the
// Result (default DefaultOutputLimit); n < 0 keeps everything. The command
// still runs to its end: output past the limit is read and dropped.
func WithOutputLimit(n int64) RunOption { return func(c *runConfig) { c.limit = n } }

// WithTimeout kills the command after d (see ExecOptions.Timeout).
func WithTimeout(d time.Duration) RunOption { return func(c *runConfig) { c.timeout = d } }

// RunShell runs cmd with /bin/sh -c in sandbox id, waits for it and returns
// its output, at most DefaultOutputLimit bytes of each stream unless
// WithOutputLimit says otherwise. A non-zero exit code is in the Result,
// not an error.
func (c *Client) RunShell(ctx context.Context, id, cmd string, opts ...RunOption) (*Result, error) {
	if cmd == "" {
		return nil, invalid("command", "must not be empty")
	}
	rc := runConfig{limit: DefaultOutputLimit}
	for _, o := range opts {
		o(&rc)
	}
	stdout, stderr := &limitedBuffer{limit: rc.limit}, &limitedBuffer{limit: rc.limit}
	// The server enforces the limit too, so what is dropped never crosses
	// the network; the buffers bound memory with servers that do not.
	p, err := c.Exec(ctx, id, ExecOptions{Command: []string{"/bin/sh", "-c", cmd}, Stdout: stdout, Stderr: stderr,
		Timeout: rc.timeout, OutputLimit: rc.limit, CallID: rc.callID})
	if err != nil {
		return nil, err
	}
	st, err := p.Wait()
	if err != nil {
		return nil, err
	}
	return &Result{
		Stdout: stdout.buf.String(), Stderr: stderr.buf.String(), ExitCode: st.ExitCode, Status: st.Status,
		TimedOut:        st.TimedOut,
		OutputTruncated: st.OutputTruncated || stdout.truncated() || stderr.truncated(),
		StdoutBytes:     max(stdout.total, st.StdoutBytes), StderrBytes: max(stderr.total, st.StderrBytes),
		Replayed: st.Replayed || p.replayed, Seq: p.seq,
	}, nil
}

// limitedBuffer keeps the first limit bytes written to it (all if limit < 0)
// and counts the rest. Writes never fail, so the stream keeps draining.
type limitedBuffer struct {
	buf   bytes.Buffer
	limit int64
	total int64
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	b.total += int64(len(p))
	if room := b.limit - int64(b.buf.Len()); b.limit < 0 || room >= int64(len(p)) {
		b.buf.Write(p)
	} else if room > 0 {
		b.buf.Write(p[:room])
	}
	return len(p), nil
}

func (b *limitedBuffer) truncated() bool { return b.limit >= 0 && b.total > b.limit }
