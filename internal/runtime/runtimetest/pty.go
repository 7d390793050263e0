package runtimetest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/runtime"
)

// PTY is a process started through the agent with a terminal, as a user's
// interactive shell is: its output is the terminal's, its input goes to the
// terminal, and it can be resized.
type PTY struct {
	Pid uint32
	c   processconnect.ProcessClient

	mu     sync.Mutex
	seen   strings.Builder
	end    *process.ProcessEvent_EndEvent
	err    error
	closed bool
	more   chan struct{} // closed and replaced whenever output or the end arrives
}

// StartPTY starts cmd with a cols x rows terminal in sandbox id and reads
// its output in the background until it ends or ctx ends.
func StartPTY(ctx context.Context, rt runtime.Runtime, id string, cols, rows uint32, env map[string]string, cmd string, args ...string) (*PTY, error) {
	c := processconnect.NewProcessClient(AgentHTTPClient(rt, id), agentBaseURL)
	stream, err := c.Start(ctx, connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: cmd, Args: args, Envs: env},
		Pty:     &process.PTY{Size: &process.PTY_Size{Cols: cols, Rows: rows}},
	}))
	if err != nil {
		return nil, fmt.Errorf("start pty process: %w", err)
	}
	if !stream.Receive() {
		err := stream.Err()
		stream.Close()
		return nil, fmt.Errorf("pty process start event: %w", err)
	}
	pid := stream.Msg().GetEvent().GetStart().GetPid()
	if pid == 0 {
		stream.Close()
		return nil, fmt.Errorf("pty process: first event %v is not a start event", stream.Msg().GetEvent())
	}
	p := &PTY{Pid: pid, c: c, more: make(chan struct{})}
	go func() {
		defer stream.Close()
		for stream.Receive() {
			ev := stream.Msg().GetEvent()
			p.mu.Lock()
			if d := ev.GetData(); d != nil {
				p.seen.Write(d.GetPty())
				// A PTY process has no separate stdout or stderr.
				if len(d.GetStdout())+len(d.GetStderr()) > 0 {
					p.seen.WriteString("\x00PIPE-OUTPUT")
				}
			}
			if e := ev.GetEnd(); e != nil {
				p.end = e
			}
			close(p.more)
			p.more = make(chan struct{})
			p.mu.Unlock()
		}
		p.mu.Lock()
		p.err, p.closed = stream.Err(), true
		close(p.more)
		p.more = make(chan struct{})
		p.mu.Unlock()
	}()
	return p, nil
}

// Output is everything the terminal showed so far.
func (p *PTY) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seen.String()
}

// WaitOutput waits until the terminal has shown want (after the first
// from bytes of output), and returns the offset just past it.
func (p *PTY) WaitOutput(ctx context.Context, from int, want string, timeout time.Duration) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		p.mu.Lock()
		s, closed, more := p.seen.String(), p.closed, p.more
		p.mu.Unlock()
		if from <= len(s) {
			if i := strings.Index(s[from:], want); i >= 0 {
				return from + i + len(want), nil
			}
		}
		if closed {
			return 0, fmt.Errorf("pty stream ended (%v) without %q; output %q", p.err, want, s)
		}
		select {
		case <-more:
		case <-ctx.Done():
			return 0, fmt.Errorf("no %q in pty output after %s: %q", want, timeout, s)
		}
	}
}

// Write sends in to the terminal.
func (p *PTY) Write(ctx context.Context, in string) error {
	_, err := p.c.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{
		Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: p.Pid}},
		Input:   &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: []byte(in)}},
	}))
	if err != nil {
		return fmt.Errorf("pty input: %w", err)
	}
	return nil
}

// Resize sets the terminal's size.
func (p *PTY) Resize(ctx context.Context, cols, rows uint32) error {
	_, err := p.c.Update(ctx, connect.NewRequest(&process.UpdateRequest{
		Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: p.Pid}},
		Pty:     &process.PTY{Size: &process.PTY_Size{Cols: cols, Rows: rows}},
	}))
	if err != nil {
		return fmt.Errorf("pty resize: %w", err)
	}
	return nil
}

// Wait waits for the process's end event.
func (p *PTY) Wait(ctx context.Context, timeout time.Duration) (*process.ProcessEvent_EndEvent, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		p.mu.Lock()
		end, closed, err, more := p.end, p.closed, p.err, p.more
		p.mu.Unlock()
		if end != nil {
			return end, nil
		}
		if closed {
			return nil, fmt.Errorf("pty stream ended without an end event: %v", err)
		}
		select {
		case <-more:
		case <-ctx.Done():
			return nil, fmt.Errorf("pty process did not end in %s; output %q", timeout, p.Output())
		}
	}
}

// testPTY: an interactive shell on a terminal, through the agent as a
// user's is: it sees a terminal of the size asked for, reads what is typed,
// follows a resize, and its exit status comes back.
func testPTY(t *testing.T, f Factory, o Options) {
	if !o.Exec {
		t.Skip("the sandbox has no shell (Options.Exec false)")
	}
	rt, tmpl := f(t)
	ctx := t.Context()
	spec, _ := StartSandbox(t, rt, tmpl)
	p, err := StartPTY(ctx, rt, spec.ID, 80, 24, map[string]string{"TERM": "xterm", "PS1": "$ "}, "/bin/sh")
	if err != nil {
		t.Fatal(err)
	}
	const wait = 20 * time.Second
	step := func(in, want string, at int) int {
		t.Helper()
		if err := p.Write(ctx, in); err != nil {
			t.Fatal(err)
		}
		n, err := p.WaitOutput(ctx, at, want, wait)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	// Markers are printed by the shell ("$((...))"), so the terminal's echo
	// of the command line cannot match them.
	at := step("stty size; tty; echo tty-$((6*7))\n", "tty-42", 0)
	out := p.Output()
	if !strings.Contains(out, "24 80") {
		t.Errorf("stty size on an 80x24 terminal: output %q lacks %q", out, "24 80")
	}
	if !strings.Contains(out, "/dev/pts/") {
		t.Errorf("tty: output %q names no /dev/pts/ terminal", out)
	}
	// Input reaches a program reading the terminal, line by line.
	at = step("read line; echo \"got:$line:$((1+1))\"\n", "", at)
	at = step("typed words\n", "got:typed words:2", at)
	if err := p.Resize(ctx, 132, 43); err != nil {
		t.Fatal(err)
	}
	at = step("stty size; echo size-$((2*3))\n", "size-6", at)
	if got := p.Output()[:at]; !strings.Contains(got, "43 132") {
		t.Errorf("stty size after a resize to 132x43: output %q lacks %q", got, "43 132")
	}
	if strings.Contains(p.Output(), "\x00PIPE-OUTPUT") {
		t.Errorf("a PTY process sent stdout or stderr events")
	}
	if err := p.Write(ctx, "exit 7\n"); err != nil {
		t.Fatal(err)
	}
	end, err := p.Wait(ctx, wait)
	if err != nil {
		t.Fatal(err)
	}
	if end.GetExitCode() != 7 || !end.GetExited() || end.GetStatus() != "exit status 7" {
		t.Fatalf("end of the shell after exit 7: code %d exited %v status %q", end.GetExitCode(), end.GetExited(), end.GetStatus())
	}
	mustAlive(t, rt, spec.ID, o)
}
