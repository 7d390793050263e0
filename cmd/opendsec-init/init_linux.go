package main

import (
	"errors"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/seccompbpf"
)

// listenFD is the server's fd number for the listening socket.
const listenFD = 3

// listenBacklog is the socket's accept queue: connections wait there while
// no server runs (the kernel caps it at net.core.somaxconn).
const listenBacklog = 4096

func run(cfg config) int {
	// First: nothing in the sandbox may run without its filter, init
	// included.
	if cfg.seccomp != "" {
		if err := seccompbpf.Install(cfg.seccomp); err != nil {
			logf(err.Error())
			return 1
		}
	}
	var lfd int
	var err error
	if cfg.fd >= 0 {
		lfd, err = inheritListener(cfg.fd)
	} else {
		lfd, err = listenUnix(cfg.listen)
	}
	if err != nil {
		logf(err.Error())
		return 1
	}
	env, err := serverEnv(cfg.envFile)
	if err != nil {
		logf(err.Error())
		return 1
	}
	// Like the agent was as PID 1: the OOM killer takes a user process
	// before init (it fails quietly without CAP_SYS_RESOURCE).
	_ = os.WriteFile("/proc/self/oom_score_adj", []byte("-1000"), 0)

	// Separate channels: a burst of SIGCHLD never crowds out a SIGTERM
	// (one pending SIGCHLD is enough, every reap takes all exited children).
	chld, term := make(chan os.Signal, 1), make(chan os.Signal, 2)
	signal.Notify(chld, unix.SIGCHLD)
	signal.Notify(term, unix.SIGTERM, unix.SIGINT)
	dropSignals()
	s := &supervisor{cfg: cfg, lfd: lfd, env: env, arm: make(chan struct{}, 1), ready: make(chan struct{}, 1)}
	go waitReadable(lfd, s.arm, s.ready)
	// The node asks for /health the moment the sandbox starts: start the
	// server now, so its start overlaps runc's return instead of waiting
	// for that first connection. Later starts are on demand.
	var retry <-chan time.Time
	if err := s.start(); err != nil {
		s.failures++
		logf(err.Error())
		retry = s.rearm(s.backoff())
	}
	return s.loop(chld, term, retry)
}

// fatalSignals are the signals whose arrival from kill(2) would end init
// (the Go runtime dies of them unless they are notified): a root process in
// the sandbox must not take PID 1 down with kill -HUP 1. SIGTERM, SIGINT
// and SIGCHLD are handled in the loop; SIGKILL and SIGSTOP from inside the
// sandbox never reach PID 1.
var fatalSignals = []os.Signal{
	unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2, unix.SIGPIPE,
	unix.SIGALRM, unix.SIGVTALRM, unix.SIGSTKFLT, unix.SIGXCPU, unix.SIGXFSZ,
	unix.SIGIO, unix.SIGPWR, unix.SIGSYS, unix.SIGTRAP, unix.SIGABRT,
	// Sent by kill only: the runtime still panics on its own faults.
	unix.SIGILL, unix.SIGBUS, unix.SIGFPE, unix.SIGSEGV,
}

// dropSignals receives fatalSignals and discards them. Notify, not
// signal.Ignore: an ignored signal stays ignored across exec, in the server
// and every process it starts (a shell with SIGHUP and SIGPIPE ignored);
// a notified one is back to its default in the child.
func dropSignals() {
	c := make(chan os.Signal, 4)
	signal.Notify(c, fatalSignals...)
	go func() {
		for range c {
		}
	}()
}

// supervisor starts the server on demand and reaps every process.
type supervisor struct {
	cfg   config
	lfd   int
	env   []string      // the server's environment
	arm   chan struct{} // ask waitReadable for one readiness report
	ready chan struct{} // a connection waits

	pid         int // the running server; 0 when none
	started     time.Time
	failures    int // consecutive failed starts
	terminating bool
	exitCode    int
}

// loop runs until init is done; retry, when set, re-arms the socket watch.
func (s *supervisor) loop(chld, term <-chan os.Signal, retry <-chan time.Time) int {
	for {
		select {
		case <-chld:
			if done, delay := s.reap(); done {
				return s.exitCode
			} else if delay >= 0 {
				retry = s.rearm(delay)
			}
		case sig := <-term:
			s.terminating = true
			if s.pid == 0 {
				return 0
			}
			// The server ends its processes and exits; init follows.
			_ = unix.Kill(s.pid, sig.(syscall.Signal))
		case <-s.ready:
			if s.terminating || s.pid != 0 {
				continue
			}
			if err := s.start(); err != nil {
				s.failures++
				logf(err.Error())
				retry = s.rearm(s.backoff())
			}
		case <-retry:
			retry = nil
			s.arm <- struct{}{}
		}
	}
}

// rearm asks for the next readiness report after delay.
func (s *supervisor) rearm(delay time.Duration) <-chan time.Time {
	if delay == 0 {
		s.arm <- struct{}{}
		return nil
	}
	return time.After(delay)
}

func (s *supervisor) backoff() time.Duration {
	d := minBackoff << min(s.failures-1, 10)
	return min(d, maxBackoff)
}

// start runs the server with the listening socket as fd 3.
func (s *supervisor) start() error {
	argv := append(append([]string{}, s.cfg.server...), "--listen-fd", strconv.Itoa(listenFD))
	pid, err := syscall.ForkExec(argv[0], argv, &syscall.ProcAttr{
		Env:   s.env,
		Files: []uintptr{0, 1, 2, uintptr(s.lfd)},
	})
	if err != nil {
		return &opError{"start server " + argv[0], err}
	}
	s.pid, s.started = pid, time.Now()
	return nil
}

// reap collects every exited child. When the server is among them it
// reports whether init is done and, if not, after how long to watch the
// socket again (negative: the server still runs, nothing to re-arm).
func (s *supervisor) reap() (done bool, delay time.Duration) {
	delay = -1
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || pid <= 0 {
			return false, delay
		}
		if pid != s.pid {
			continue // an orphan
		}
		s.pid = 0
		ran := time.Since(s.started)
		if s.terminating {
			s.exitCode = exitCode(ws)
			return true, 0
		}
		switch {
		case ws.Exited() && ws.ExitStatus() == 0:
			s.failures = 0
			delay = 0
		case ran < startWindow:
			s.failures++
			delay = s.backoff()
			logf("server " + describe(ws) + " after " + ran.Round(time.Millisecond).String() + " (failure " + strconv.Itoa(s.failures) + "); next start in " + delay.String())
		default:
			s.failures = 0
			delay = 0
			logf("server " + describe(ws) + "; it starts again on the next connection")
		}
	}
}

// waitReadable reports on ready, once per token on arm, that fd has a
// connection waiting.
func waitReadable(fd int, arm <-chan struct{}, ready chan<- struct{}) {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for range arm {
		for {
			n, err := unix.Poll(fds, -1)
			if err == nil && n > 0 {
				break
			}
			if err != nil && !errors.Is(err, unix.EINTR) {
				logf("poll listening socket: " + err.Error())
				time.Sleep(time.Second) // not synchronisation: never spin on a broken fd
			}
		}
		ready <- struct{}{}
	}
}

// serverEnv returns the server's environment: the entries of the env file
// when there is one (it is removed once read: it may hold secrets), else
// init's own.
func serverEnv(path string) ([]string, error) {
	if path == "" {
		return os.Environ(), nil
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return os.Environ(), nil
	}
	if err != nil {
		return nil, &opError{"read --env-file", err}
	}
	if err := os.Remove(path); err != nil {
		return nil, &opError{"remove --env-file", err}
	}
	var env []string
	for _, e := range strings.Split(string(b), "\x00") {
		if e == "" {
			continue
		}
		if !strings.Contains(e, "=") {
			return nil, errors.New("--env-file " + path + ": entry " + strconv.Quote(e) + " is not K=V")
		}
		env = append(env, e)
	}
	return env, nil
}

// inheritListener checks that fd is a listening unix stream socket and moves
// it to a close-on-exec descriptor above the standard ones: only the server
// gets it, as fd 3, never a process the server starts.
func inheritListener(fd int) (int, error) {
	name := "--listen-fd " + strconv.Itoa(fd)
	if dom, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN); err != nil {
		return -1, &opError{name + ": not a socket", err}
	} else if dom != unix.AF_UNIX {
		return -1, errors.New(name + ": not a unix socket")
	}
	if typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || typ != unix.SOCK_STREAM {
		return -1, errors.New(name + ": not a stream socket")
	}
	if acc, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || acc != 1 {
		return -1, errors.New(name + ": not listening; listen(2) before handing it over")
	}
	nfd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 10)
	if err != nil {
		return -1, &opError{name + ": dup", err}
	}
	unix.Close(fd)
	return nfd, nil
}

// listenUnix creates the listening socket at path (replacing a stale one).
// It is close-on-exec: only the server gets it, as fd 3.
func listenUnix(path string) (int, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return -1, &opError{"make socket directory", err}
	}
	if st, err := os.Lstat(path); err == nil {
		if st.Mode()&fs.ModeSocket == 0 {
			return -1, errors.New("listen: " + path + " exists and is not a socket; remove it or pick another --listen")
		}
		if err := os.Remove(path); err != nil {
			return -1, &opError{"remove stale socket", err}
		}
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, &opError{"make socket", err}
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		unix.Close(fd)
		return -1, &opError{"bind " + path, err}
	}
	if err := unix.Listen(fd, listenBacklog); err != nil {
		unix.Close(fd)
		return -1, &opError{"listen on " + path, err}
	}
	return fd, nil
}

func exitCode(ws unix.WaitStatus) int {
	if ws.Exited() {
		return ws.ExitStatus()
	}
	return 128 + int(ws.Signal())
}

func describe(ws unix.WaitStatus) string {
	if ws.Exited() {
		return "exited with status " + strconv.Itoa(ws.ExitStatus())
	}
	return "killed by " + ws.Signal().String()
}

// opError wraps err with what was being done (fmt would grow the binary).
type opError struct {
	op  string
	err error
}

func (e *opError) Error() string { return e.op + ": " + e.err.Error() }
func (e *opError) Unwrap() error { return e.err }
