package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/creack/pty"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

const (
	// drainGrace is how long output is still read after a process exits, for
	// pipes held open by its orphaned children.
	drainGrace = 250 * time.Millisecond
	// maxDrain bounds the extra time spent reading what is still buffered.
	maxDrain = 5 * time.Second
	// keepExited is how many exited processes are kept for Connect replay.
	keepExited       = 256
	defaultKeepalive = 90 * time.Second
	// readBatch bounds the output one stream pass takes from a log.
	readBatch = 256 << 10
)

// proc is one started process.
type proc struct {
	pid    uint32
	tag    *string
	config *process.ProcessConfig
	isPTY  bool
	out    *outLog
	handle *os.Process
	// owner is the Start stream's place in out (see follow).
	owner *outReader

	mu     sync.Mutex
	stdin  *os.File // pipe write end; nil when none or closed
	master *os.File // PTY master; nil unless isPTY
	end    *process.ProcessEvent_EndEvent
	subs   int
	timer  *time.Timer
	// timedOut is set, before the kill, when the Connect-Timeout-Ms timer
	// killed the process.
	timedOut bool
	done     chan struct{} // closed once end is set
}

func (p *proc) ended() *process.ProcessEvent_EndEvent {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.end
}

// signal sends sig to the process and its process group while it runs.
func (p *proc) signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.signalLocked(sig)
}

// expire kills the process at the end of its Connect-Timeout-Ms lifetime.
func (p *proc) expire() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end == nil {
		p.timedOut = true
		_ = p.signalLocked(unix.SIGKILL)
	}
}

// expired reports whether the lifetime timer killed the process.
func (p *proc) expired() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.timedOut
}

func (p *proc) signalLocked(sig syscall.Signal) error {
	if p.end != nil {
		return errdefs.New(errdefs.ErrNotFound, "process %d has already exited", p.pid)
	}
	// The group first: pgid == pid, valid while the leader is unreaped.
	_ = unix.Kill(-int(p.pid), sig)
	if err := p.handle.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("signal process %d: %w", p.pid, err)
	}
	return nil
}

func (p *proc) addSub() {
	p.mu.Lock()
	p.subs++
	p.mu.Unlock()
}

func (p *proc) removeSub() {
	p.mu.Lock()
	p.subs--
	release := p.subs == 0 && p.end != nil
	p.mu.Unlock()
	if release {
		p.out.release()
	}
}

// processes is the process.Process service.
type processes struct {
	processconnect.UnimplementedProcessHandler
	cfg   *Config
	users users

	mu     sync.Mutex
	byPID  map[uint32]*proc
	exited []*proc
}

var _ processconnect.ProcessHandler = (*processes)(nil)

func newProcesses(cfg *Config) *processes {
	return &processes{cfg: cfg, users: users{dir: cfg.EtcDir}, byPID: map[uint32]*proc{}}
}

// userFor resolves the Basic-auth user of a request, or the default user.
func userFor(cfg *Config, us users, h interface{ Get(string) string }) (*user, error) {
	name, err := basicUser(h.Get("Authorization"))
	if err != nil {
		return nil, err
	}
	if name == "" {
		name = cfg.DefaultUser
	}
	return us.lookup(name)
}

func (s *processes) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	p, err := s.start(ctx, req.Msg, req.Header())
	if err != nil {
		return errdefs.ToConnect(err)
	}
	// start subscribed us already, so output cannot be released before
	// this stream reads it even if the process exits at once.
	defer p.removeSub()
	defer p.out.detach(p.owner)
	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.StartResponse{Event: ev}) }
	if err := send(startEvent(p.pid)); err != nil {
		return err
	}
	return s.follow(ctx, p, cursor{}, p.owner, keepaliveInterval(req.Header()), send)
}

func (s *processes) Connect(ctx context.Context, req *connect.Request[process.ConnectRequest], stream *connect.ServerStream[process.ConnectResponse]) error {
	p, err := s.find(req.Msg.GetProcess(), true)
	if err != nil {
		return errdefs.ToConnect(err)
	}
	p.addSub()
	defer p.removeSub()
	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.ConnectResponse{Event: ev}) }
	if err := send(startEvent(p.pid)); err != nil {
		return err
	}
	if end := p.ended(); end != nil {
		return send(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: end}})
	}
	return s.follow(ctx, p, p.out.tail(), nil, keepaliveInterval(req.Header()), send)
}

func (s *processes) List(ctx context.Context, req *connect.Request[process.ListRequest]) (*connect.Response[process.ListResponse], error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	resp := &process.ListResponse{}
	for _, p := range s.byPID {
		if p.ended() != nil {
			continue
		}
		resp.Processes = append(resp.Processes, &process.ProcessInfo{Config: p.config, Pid: p.pid, Tag: p.tag})
	}
	slices.SortFunc(resp.Processes, func(a, b *process.ProcessInfo) int { return int(a.Pid) - int(b.Pid) })
	return connect.NewResponse(resp), nil
}

func (s *processes) Update(ctx context.Context, req *connect.Request[process.UpdateRequest]) (*connect.Response[process.UpdateResponse], error) {
	p, err := s.find(req.Msg.GetProcess(), false)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if req.Msg.Pty != nil {
		size := req.Msg.Pty.GetSize()
		if size.GetCols() == 0 || size.GetRows() == 0 {
			return nil, errdefs.ToConnect(errdefs.Invalid("pty.size", "cols and rows must both be at least 1"))
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.master == nil {
			return nil, errdefs.ToConnect(errdefs.Invalid("pty", "process %d was not started with a PTY; it cannot be resized", p.pid))
		}
		if err := pty.Setsize(p.master, &pty.Winsize{Rows: uint16(size.GetRows()), Cols: uint16(size.GetCols())}); err != nil {
			return nil, errdefs.ToConnect(fmt.Errorf("resize pty: %w", err))
		}
	}
	return connect.NewResponse(&process.UpdateResponse{}), nil
}

func (s *processes) SendInput(ctx context.Context, req *connect.Request[process.SendInputRequest]) (*connect.Response[process.SendInputResponse], error) {
	p, err := s.find(req.Msg.GetProcess(), false)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := p.write(ctx, req.Msg.GetInput()); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&process.SendInputResponse{}), nil
}

func (s *processes) StreamInput(ctx context.Context, stream *connect.ClientStream[process.StreamInputRequest]) (*connect.Response[process.StreamInputResponse], error) {
	var p *proc
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().(type) {
		case *process.StreamInputRequest_Start:
			found, err := s.find(ev.Start.GetProcess(), false)
			if err != nil {
				return nil, errdefs.ToConnect(err)
			}
			p = found
		case *process.StreamInputRequest_Data:
			if p == nil {
				return nil, errdefs.ToConnect(errdefs.Invalid("event", "data before start; send a start event with the process selector first"))
			}
			if err := p.write(ctx, ev.Data.GetInput()); err != nil {
				return nil, errdefs.ToConnect(err)
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.StreamInputResponse{}), nil
}

func (s *processes) SendSignal(ctx context.Context, req *connect.Request[process.SendSignalRequest]) (*connect.Response[process.SendSignalResponse], error) {
	var sig syscall.Signal
	switch req.Msg.GetSignal() {
	case process.Signal_SIGNAL_SIGKILL:
		sig = unix.SIGKILL
	case process.Signal_SIGNAL_SIGTERM:
		sig = unix.SIGTERM
	default:
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrUnimplemented, "signal %s is not supported; send SIGNAL_SIGTERM or SIGNAL_SIGKILL", req.Msg.GetSignal()))
	}
	p, err := s.find(req.Msg.GetProcess(), false)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := p.signal(sig); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&process.SendSignalResponse{}), nil
}

func (s *processes) CloseStdin(ctx context.Context, req *connect.Request[process.CloseStdinRequest]) (*connect.Response[process.CloseStdinResponse], error) {
	p, err := s.find(req.Msg.GetProcess(), false)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if p.isPTY {
		return nil, errdefs.ToConnect(errdefs.Invalid("process", "process %d uses a PTY; send Ctrl-D (\\x04) as pty input instead of closing stdin", p.pid))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
	return connect.NewResponse(&process.CloseStdinResponse{}), nil
}

// write sends input to the process. The lock is not held while writing: a
// process that does not read its stdin must not block signals to it.
func (p *proc) write(ctx context.Context, in *process.ProcessInput) error {
	f, data, err := p.inputFile(in)
	if err != nil {
		return err
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(30 * time.Second)
	}
	_ = f.SetWriteDeadline(deadline) // pipes and PTYs are pollable
	defer f.SetWriteDeadline(time.Time{})
	if _, err := f.Write(data); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return errdefs.New(errdefs.ErrDeadlineExceeded, "write input to process %d: it is not reading its input", p.pid)
		}
		if errors.Is(err, os.ErrClosed) {
			return errdefs.New(errdefs.ErrFailedPrecondition, "input of process %d was closed", p.pid)
		}
		return fmt.Errorf("write input to process %d: %w", p.pid, err)
	}
	return nil
}

func (p *proc) inputFile(in *process.ProcessInput) (*os.File, []byte, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var (
		f    *os.File
		data []byte
	)
	switch v := in.GetInput().(type) {
	case *process.ProcessInput_Stdin:
		if p.isPTY {
			return nil, nil, errdefs.New(errdefs.ErrInternal, "process %d uses a PTY; send input.pty instead of input.stdin", p.pid)
		}
		if p.stdin == nil {
			return nil, nil, errdefs.New(errdefs.ErrFailedPrecondition, "stdin of process %d is closed or was not opened (start it with stdin: true)", p.pid)
		}
		f, data = p.stdin, v.Stdin
	case *process.ProcessInput_Pty:
		if !p.isPTY {
			return nil, nil, errdefs.New(errdefs.ErrInternal, "process %d has no PTY; send input.stdin instead of input.pty", p.pid)
		}
		f, data = p.master, v.Pty
	default:
		return nil, nil, errdefs.Invalid("input", "empty; set stdin or pty")
	}
	if f == nil {
		return nil, nil, errdefs.New(errdefs.ErrNotFound, "process %d has already exited", p.pid)
	}
	return f, data, nil
}

// find returns the process a selector names. Exited processes are found
// only when withExited (Connect replays their end).
func (s *processes) find(sel *process.ProcessSelector, withExited bool) (*proc, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var found *proc
	switch v := sel.GetSelector().(type) {
	case *process.ProcessSelector_Pid:
		found = s.byPID[v.Pid]
		if found == nil || (!withExited && found.ended() != nil) {
			return nil, errdefs.New(errdefs.ErrNotFound, "process with pid %d not found", v.Pid)
		}
	case *process.ProcessSelector_Tag:
		for _, p := range s.byPID {
			if p.tag == nil || *p.tag != v.Tag {
				continue
			}
			if p.ended() == nil {
				return p, nil
			}
			if withExited {
				found = p
			}
		}
		if found == nil {
			return nil, errdefs.New(errdefs.ErrNotFound, "process with tag %q not found", v.Tag)
		}
	default:
		return nil, errdefs.Invalid("process", "no selector; set pid or tag")
	}
	return found, nil
}

func startEvent(pid uint32) *process.ProcessEvent {
	return &process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: pid}}}
}

func dataEvent(kind outKind, b []byte) *process.ProcessEvent {
	d := &process.ProcessEvent_DataEvent{}
	switch kind {
	case outStdout:
		d.Output = &process.ProcessEvent_DataEvent_Stdout{Stdout: b}
	case outStderr:
		d.Output = &process.ProcessEvent_DataEvent_Stderr{Stderr: b}
	default:
		d.Output = &process.ProcessEvent_DataEvent_Pty{Pty: b}
	}
	return &process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: d}}
}

var keepaliveEvent = &process.ProcessEvent{Event: &process.ProcessEvent_Keepalive{Keepalive: &process.ProcessEvent_KeepAlive{}}}

func keepaliveInterval(h interface{ Get(string) string }) time.Duration {
	if n, err := strconv.Atoi(h.Get("Keepalive-Ping-Interval")); err == nil && n > 0 {
		return time.Duration(n) * time.Second
	}
	return defaultKeepalive
}

// follow streams p's output from c, then its end. If the client reads more
// slowly than the process writes, the output it missed is replaced by a
// marker naming the dropped byte count.
// The caller holds a subscription (addSub) for the duration.
// owner is the reader of the Start stream (nil for Connect streams): the
// process waits for it rather than drop output it has not read, as under
// envd, so commands.run loses nothing; Connect streams that fall behind are
// told what they lost instead, and never stall the process.
func (s *processes) follow(ctx context.Context, p *proc, c cursor, owner *outReader, keepalive time.Duration, send func(*process.ProcessEvent) error) error {
	ka := time.NewTimer(keepalive)
	defer ka.Stop()
	for {
		evs, next, dropped, done, wait := p.out.read(c, readBatch)
		c = next
		if owner != nil {
			p.out.advance(owner, c)
		}
		if dropped > 0 {
			kind := outStderr
			if p.isPTY {
				kind = outPTY
			}
			msg := fmt.Sprintf("\n[opendsec-agent: %d bytes of output dropped: the client read more slowly than the process wrote]\n", dropped)
			if err := send(dataEvent(kind, []byte(msg))); err != nil {
				return err
			}
		}
		for _, e := range evs {
			if err := send(dataEvent(e.kind, e.data)); err != nil {
				return err
			}
		}
		if done {
			<-p.done
			if owner != nil && p.expired() {
				// The lifetime timer and the stream's deadline are two
				// timers: when the kill wins, the stream still ends as
				// the deadline it is (see the ctx.Done case below).
				return errdefs.ToConnect(errdefs.New(errdefs.ErrDeadlineExceeded, "process %d was killed at the end of its Connect-Timeout-Ms lifetime", p.pid))
			}
			return send(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: p.ended()}})
		}
		if len(evs) > 0 || dropped > 0 {
			ka.Reset(keepalive)
			continue
		}
		select {
		case <-wait:
		case <-ka.C:
			if err := send(keepaliveEvent); err != nil {
				return err
			}
			ka.Reset(keepalive)
		case <-ctx.Done():
			// Connect-Timeout-Ms is the process lifetime: its timer is
			// killing the process right now. The stream ends with
			// deadline_exceeded, as envd's does, so the SDKs raise their
			// timeout error rather than a failed-command one; Connect
			// still replays the end.
			return errdefs.ToConnect(ctx.Err())
		}
	}
}

// start validates req and starts the process, detached from ctx.
func (s *processes) start(ctx context.Context, req *process.StartRequest, h interface{ Get(string) string }) (*proc, error) {
	usr, err := userFor(s.cfg, s.users, h)
	if err != nil {
		return nil, err
	}
	pc := req.GetProcess()
	if pc == nil || pc.GetCmd() == "" {
		return nil, errdefs.Invalid("process.cmd", "is empty; give the program to run, e.g. /bin/bash")
	}
	if strings.IndexByte(pc.Cmd, 0) >= 0 || !utf8.ValidString(pc.Cmd) {
		return nil, errdefs.Invalid("process.cmd", "contains a NUL byte or invalid UTF-8")
	}
	for _, a := range pc.Args {
		if strings.IndexByte(a, 0) >= 0 {
			return nil, errdefs.Invalid("process.args", "an argument contains a NUL byte; remove it")
		}
	}
	var lifetime time.Duration
	if v := h.Get("Connect-Timeout-Ms"); v != "" {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil || ms < 0 {
			return nil, errdefs.Invalid("Connect-Timeout-Ms", "%q is not a non-negative integer of milliseconds", v)
		}
		lifetime = time.Duration(ms) * time.Millisecond
	}
	env, err := s.env(usr, pc.Envs)
	if err != nil {
		return nil, err
	}
	dir, err := s.cwd(usr, pc.Cwd)
	if err != nil {
		return nil, err
	}
	path, err := lookPath(pc.Cmd, dir, env)
	if err != nil {
		return nil, err
	}

	cmd := &exec.Cmd{Path: path, Args: append([]string{pc.Cmd}, pc.Args...), Env: env, Dir: dir}
	cmd.SysProcAttr = &syscall.SysProcAttr{}
	if os.Geteuid() == 0 || int(usr.UID) != os.Geteuid() {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: usr.UID, Gid: usr.GID, Groups: usr.Groups}
		if usr.Groups == nil {
			cmd.SysProcAttr.Credential.Groups = []uint32{}
		}
	}

	// subs: 1 for the Start stream that asked for it.
	p := &proc{tag: req.Tag, config: pc, isPTY: req.Pty != nil, out: newOutLog(s.cfg.MaxOutputBytes), done: make(chan struct{}), subs: 1}
	p.owner = p.out.attach(cursor{})
	var (
		readers   []*os.File // parent's read ends
		childSide []*os.File // closed in the parent after start
	)
	closeAll := func(fs []*os.File) {
		for _, f := range fs {
			f.Close()
		}
	}
	if p.isPTY {
		master, tty, err := pty.Open()
		if err != nil {
			return nil, fmt.Errorf("open pty: %w", err)
		}
		size := req.Pty.GetSize()
		if size.GetCols() > 0 && size.GetRows() > 0 {
			if err := pty.Setsize(master, &pty.Winsize{Rows: uint16(size.GetRows()), Cols: uint16(size.GetCols())}); err != nil {
				master.Close()
				tty.Close()
				return nil, fmt.Errorf("size pty: %w", err)
			}
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
		cmd.SysProcAttr.Setsid = true
		cmd.SysProcAttr.Setctty = true
		p.master = master
		readers = []*os.File{master}
		childSide = []*os.File{tty}
	} else {
		cmd.SysProcAttr.Setpgid = true
		or, ow, err := os.Pipe()
		if err != nil {
			return nil, fmt.Errorf("create stdout pipe: %w", err)
		}
		er, ew, err := os.Pipe()
		if err != nil {
			closeAll([]*os.File{or, ow})
			return nil, fmt.Errorf("create stderr pipe: %w", err)
		}
		cmd.Stdout, cmd.Stderr = ow, ew
		readers = []*os.File{or, er}
		childSide = []*os.File{ow, ew}
		if req.Stdin == nil || *req.Stdin {
			ir, iw, err := os.Pipe()
			if err != nil {
				closeAll(append(readers, childSide...))
				return nil, fmt.Errorf("create stdin pipe: %w", err)
			}
			cmd.Stdin = ir
			childSide = append(childSide, ir)
			p.stdin = iw
		}
	}

	waitc, err := theReaper.startChild(cmd)
	closeAll(childSide)
	if err != nil {
		closeAll(readers)
		if p.stdin != nil {
			p.stdin.Close()
		}
		if errors.Is(err, os.ErrPermission) {
			return nil, errdefs.New(errdefs.ErrPermissionDenied, "start %s as %s: %s", pc.Cmd, usr.Name, err)
		}
		if errors.Is(err, syscall.ENOEXEC) {
			// The file is there but is no program (an overwritten binary,
			// a script without #!): the caller's command, not our fault.
			return nil, errdefs.Invalid("command", "%s cannot be run: exec format error; give a program or a script starting with #!", pc.Cmd)
		}
		return nil, fmt.Errorf("start process %s: %w", pc.Cmd, err)
	}
	p.pid = uint32(cmd.Process.Pid)
	p.handle = cmd.Process
	if s.cfg.Init {
		// The agent is the sandbox's init: if the OOM killer took it the
		// whole sandbox would die. Lowering its own score needs
		// CAP_SYS_RESOURCE, which neither it nor (on some hosts) the node
		// has; raising a child's needs nothing. So every process it starts
		// is made the preferred victim of a memory limit.
		_ = os.WriteFile("/proc/"+itoa(int(p.pid))+"/oom_score_adj", []byte(childOOMScoreAdj), 0)
	}
	if lifetime > 0 {
		p.timer = time.AfterFunc(lifetime, p.expire)
	}
	s.register(p)
	log.G(ctx).Debug("process started", "pid", p.pid, "cmd", pc.Cmd, "user", usr.Name, "pty", p.isPTY)

	var wg sync.WaitGroup
	kinds := []outKind{outStdout, outStderr}
	if p.isPTY {
		kinds = []outKind{outPTY}
	}
	for i, f := range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pump(f, kinds[i], p.out)
		}()
	}
	go s.await(context.WithoutCancel(ctx), p, waitc, readers, &wg)
	return p, nil
}

// unread is how many bytes wait in the read ends of pipes or a PTY.
func unread(fs []*os.File) int {
	n := 0
	for _, f := range fs {
		// SyscallConn, not Fd: Fd would switch the file to blocking mode.
		rc, err := f.SyscallConn()
		if err != nil {
			continue
		}
		_ = rc.Control(func(fd uintptr) { // a closed pipe counts as empty
			if v, err := unix.IoctlGetInt(int(fd), unix.TIOCINQ); err == nil {
				n += v
			}
		})
	}
	return n
}

// pump drains f into the log until EOF or close. It never blocks on readers
// of the log, so a process is never slowed down by its clients.
func pump(f *os.File, kind outKind, out *outLog) {
	buf := make([]byte, maxChunk)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			out.append(kind, slices.Clone(buf[:n]))
		}
		if err != nil {
			return
		}
	}
}

// await records the process's end once it exited and its output drained.
func (s *processes) await(ctx context.Context, p *proc, waitc <-chan unix.WaitStatus, readers []*os.File, wg *sync.WaitGroup) {
	ws := <-waitc
	// The process is gone: its pipes are drained at once instead of at the
	// reader's pace. Held back, a slow reader's pumps stayed blocked, the
	// drain below gave up after maxDrain and what was still in the pipes
	// was lost without a marker.
	p.out.processExited()
	drained := make(chan struct{})
	go func() { wg.Wait(); close(drained) }()
	// Output normally ends at EOF right after the exit. If an orphaned
	// child keeps a pipe open, stop reading once the grace has passed and
	// nothing is left unread (a loaded machine may just be slow to read).
	grace := time.Now().Add(drainGrace)
	tick := time.NewTicker(50 * time.Millisecond)
wait:
	for {
		select {
		case <-drained:
			break wait
		case now := <-tick.C:
			if now.After(grace) && (unread(readers) == 0 || now.After(grace.Add(maxDrain))) {
				log.G(ctx).Debug("output still open after exit; closing it", "pid", p.pid)
				break wait
			}
		}
	}
	tick.Stop()
	for _, f := range readers {
		f.Close()
	}
	code, exited, status := exitInfo(ws)
	end := &process.ProcessEvent_EndEvent{ExitCode: code, Exited: exited, Status: status}
	if status != "exit status 0" {
		end.Error = proto.String(status)
	}
	p.mu.Lock()
	if p.timer != nil {
		p.timer.Stop()
	}
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
	p.master = nil
	p.end = end
	release := p.subs == 0
	_ = p.handle.Release() // the process has been waited for; nothing to undo on failure
	p.mu.Unlock()
	close(p.done)
	p.out.close()
	if release {
		p.out.release()
	}
	s.retire(p)
	log.G(ctx).Debug("process ended", "pid", p.pid, "status", status)
}

func (s *processes) register(p *proc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byPID[p.pid] = p
}

// retire keeps p for Connect replay, forgetting the oldest exited ones.
func (s *processes) retire(p *proc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.exited = append(s.exited, p)
	for len(s.exited) > keepExited {
		old := s.exited[0]
		s.exited = s.exited[1:]
		if s.byPID[old.pid] == old {
			delete(s.byPID, old.pid)
		}
	}
}

// signalAll sends sig to every running process (agent shutdown).
func (s *processes) signalAll(sig syscall.Signal) {
	s.mu.Lock()
	ps := make([]*proc, 0, len(s.byPID))
	for _, p := range s.byPID {
		ps = append(ps, p)
	}
	s.mu.Unlock()
	for _, p := range ps {
		_ = p.signal(sig)
	}
}

// env builds a process environment: the sandbox-wide env, then the user's
// HOME, USER and LOGNAME (and a PATH if none), then the request's envs.
func (s *processes) env(usr *user, extra map[string]string) ([]string, error) {
	m := map[string]string{}
	var order []string
	set := func(k, v string) {
		if _, ok := m[k]; !ok {
			order = append(order, k)
		}
		m[k] = v
	}
	for _, kv := range s.cfg.Env {
		if k, v, ok := strings.Cut(kv, "="); ok && k != "" {
			set(k, v)
		}
	}
	if _, ok := m["PATH"]; !ok {
		set("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	}
	set("HOME", usr.Home)
	set("USER", usr.Name)
	set("LOGNAME", usr.Name)
	keys := make([]string, 0, len(extra))
	for k := range extra {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return nil, errdefs.Invalid("process.envs", "name %q is not valid; names must be non-empty without '=' or NUL", k)
		}
		if strings.IndexByte(extra[k], 0) >= 0 {
			return nil, errdefs.Invalid("process.envs", "value of %s contains a NUL byte; remove it", k)
		}
		set(k, extra[k])
	}
	out := make([]string, 0, len(order))
	for _, k := range order {
		out = append(out, k+"="+m[k])
	}
	return out, nil
}

// cwd resolves a requested working directory as envd does.
func (s *processes) cwd(usr *user, req *string) (string, error) {
	if req == nil || *req == "" {
		for _, d := range []string{s.cfg.DefaultWorkdir, usr.Home} {
			if d == "" {
				continue
			}
			if st, err := os.Stat(d); err == nil && st.IsDir() {
				return d, nil
			}
		}
		return "/", nil
	}
	p, err := resolvePath("process.cwd", *req, usr.Home)
	if err != nil {
		return "", err
	}
	if st, err := os.Stat(p); err != nil || !st.IsDir() {
		return "", errdefs.Invalid("process.cwd", "cwd '%s' does not exist; create it first or pick an existing directory", p)
	}
	return p, nil
}

// lookPath finds cmd the way a shell would, with the process's own PATH.
func lookPath(cmd, dir string, env []string) (string, error) {
	if strings.Contains(cmd, "/") {
		p := cmd
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if err := executable(p); err != nil {
			return "", errdefs.Invalid("process.cmd", "%s: %s", cmd, err)
		}
		return p, nil
	}
	path := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, d := range filepath.SplitList(path) {
		if d == "" {
			d = "."
		}
		p := filepath.Join(d, cmd)
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if executable(p) == nil {
			return p, nil
		}
	}
	return "", errdefs.Invalid("process.cmd", "%q not found in PATH %q; give an absolute path or install it", cmd, path)
}

func executable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return errors.New("no such file")
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return errors.New("not an executable file")
	}
	return nil
}

// childOOMScoreAdj is the oom_score_adj of every process the agent starts
// (the agent keeps 0): a memory limit kills user processes, not the agent.
const childOOMScoreAdj = "500"
