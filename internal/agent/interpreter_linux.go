package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// interpreterStartTimeout bounds how long a tunnel waits for a freshly
// started code interpreter to listen.
const interpreterStartTimeout = 20 * time.Second

// codeInterpreter starts the code interpreter (interpreter.py) on demand:
// the first tunnel to its port that finds nothing listening starts it as the
// sandbox's default user, then waits until it listens.
type codeInterpreter struct {
	a *Agent

	mu      sync.Mutex
	running *runnerProc // nil when none was started or it ended
}

type runnerProc struct {
	proc   *os.Process
	exited chan struct{}
	stderr *tailBuffer
	status string // set before exited is closed
}

// dialInterpreter connects to the code interpreter, starting it when
// nothing listens on its port.
func (c *codeInterpreter) dial(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err == nil || !errors.Is(err, syscall.ECONNREFUSED) {
		return conn, err
	}
	r, err := c.ensure(ctx)
	if err != nil {
		if errors.Is(err, errdefs.ErrUnavailable) {
			return nil, err
		}
		return nil, errdefs.New(errdefs.ErrUnavailable, "%s", err)
	}
	for {
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			return conn, nil
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, err
		}
		select {
		case <-r.exited:
			return nil, errdefs.New(errdefs.ErrUnavailable, "code interpreter: exited before listening (%s): %s", r.status, r.stderr.String())
		case <-ctx.Done():
			return nil, errdefs.New(errdefs.ErrUnavailable, "code interpreter: not listening on port %d after %s: %s", c.a.cfg.InterpreterPort, interpreterStartTimeout, r.stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ensure returns the running interpreter process, starting one if needed.
func (c *codeInterpreter) ensure(ctx context.Context) (*runnerProc, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if r := c.running; r != nil {
		select {
		case <-r.exited:
		default:
			return r, nil
		}
	}
	path := c.a.cfg.InterpreterPath
	if _, err := os.Stat(path); err != nil {
		return nil, errdefs.New(errdefs.ErrUnavailable, "code interpreter: %s is missing in this sandbox", path)
	}
	usr, err := c.a.users.lookup(c.a.cfg.DefaultUser)
	if err != nil {
		return nil, fmt.Errorf("code interpreter: %w", err)
	}
	env, err := c.a.procs.env(usr, nil)
	if err != nil {
		return nil, fmt.Errorf("code interpreter: %w", err)
	}
	dir, err := c.a.procs.cwd(usr, nil)
	if err != nil {
		return nil, fmt.Errorf("code interpreter: %w", err)
	}
	py, err := lookPath("python3", dir, env)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrUnavailable, "code interpreter: python3 is not installed in this sandbox's image; use an image with python3 (e.g. root/py:3.11)")
	}
	cmd := &exec.Cmd{
		Path: py,
		Args: []string{"python3", "-u", path, "--port", strconv.Itoa(c.a.cfg.InterpreterPort)},
		Env:  env,
		Dir:  dir,
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if os.Geteuid() == 0 || int(usr.UID) != os.Geteuid() {
		groups := usr.Groups
		if groups == nil {
			groups = []uint32{}
		}
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: usr.UID, Gid: usr.GID, Groups: groups}
	}
	r := &runnerProc{exited: make(chan struct{}), stderr: &tailBuffer{max: 4096}}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("code interpreter: create output pipe: %w", err)
	}
	cmd.Stdout, cmd.Stderr = pw, pw
	waitc, err := theReaper.startChild(cmd)
	pw.Close()
	if err != nil {
		pr.Close()
		return nil, fmt.Errorf("code interpreter: start python3: %w", err)
	}
	go func() {
		// Until every holder of the write end (the runner and its
		// contexts) has closed it.
		io.Copy(r.stderr, pr)
		pr.Close()
	}()
	r.proc = cmd.Process
	if c.a.cfg.Init {
		_ = os.WriteFile("/proc/"+itoa(cmd.Process.Pid)+"/oom_score_adj", []byte(childOOMScoreAdj), 0)
	}
	go func() {
		ws := <-waitc
		_, _, r.status = exitInfo(ws)
		close(r.exited)
		log.G(context.Background()).Info("code interpreter ended", "status", r.status)
	}()
	log.G(ctx).Info("code interpreter started", "pid", cmd.Process.Pid, "user", usr.Name)
	c.running = r
	return r, nil
}

// stop kills a running interpreter and its contexts (its process group).
func (c *codeInterpreter) stop() {
	c.mu.Lock()
	r := c.running
	c.mu.Unlock()
	if r == nil {
		return
	}
	select {
	case <-r.exited: // reaped: its pid may belong to someone else now
	default:
		_ = unix.Kill(-r.proc.Pid, unix.SIGKILL)
	}
}

// current returns the interpreter process last started, or nil.
func (c *codeInterpreter) current() *runnerProc {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.running
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - t.max; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := strings.TrimSpace(string(t.b))
	if s == "" {
		return "no output"
	}
	return s
}
