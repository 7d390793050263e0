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
	"unsafe"

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
		b, err := readFile(cfg.seccomp)
		if err == nil {
			err = seccompbpf.InstallProgram(cfg.seccomp, b)
		} else {
			err = &seccompbpf.Error{Op: "read seccomp filter", Err: err}
		}
		if err != nil {
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
	_ = writeFile("/proc/self/oom_score_adj", "-1000")

	// Separate channels: a burst of SIGCHLD never crowds out a SIGTERM
	// (one pending SIGCHLD is enough, every reap takes all exited children).
	chld, term := make(chan os.Signal, 1), make(chan os.Signal, 2)
	signal.Notify(chld, unix.SIGCHLD)
	signal.Notify(term, unix.SIGTERM, unix.SIGINT)
	dropSignals()
	s := &supervisor{cfg: cfg, lfd: lfd, env: env, held: -1,
		arm: make(chan struct{}, 1), ready: make(chan waiting, 1), readyc: make(chan readyMsg, 8)}
	// No server at boot: init answers the node's first GET /health itself
	// (see classify), and the server starts with the first real request.
	// A missing or non-executable agent is caught here, at no cost, and
	// reported by that /health answer.
	s.failure = checkServer(cfg.server[0])
	if s.failure != "" {
		logf(s.failure)
	}
	go acceptLoop(lfd, s.arm, s.ready)
	s.arm <- struct{}{}
	var retry <-chan time.Time
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

// runtimeFaults are the fatalSignals the Go runtime needs its own handler
// for: the kernel raises them on a fault of init itself (a nil
// dereference is a SIGSEGV the runtime turns into a panic), so they stay
// with the runtime and are dropped only when sent by kill (notified).
var runtimeFaults = map[os.Signal]bool{
	unix.SIGSEGV: true, unix.SIGBUS: true, unix.SIGFPE: true, unix.SIGILL: true,
	unix.SIGTRAP: true, unix.SIGSYS: true,
}

// dropSignals keeps fatalSignals from ending init.
//
// As PID 1 of a PID namespace (every sandbox's init) a signal whose
// disposition is SIG_DFL never reaches init, from inside the namespace or
// from outside (pid_namespaces(7); the kernel drops it, SIGKILL and SIGSTOP
// from an ancestor namespace aside): init sets those signals to SIG_DFL
// itself, which is also what the server and its processes inherit across
// exec. That is what they were for os/signal's Notify too, which costs a
// round trip between two threads for each signal (os/signal updates a
// signal mask on a thread of its own), 12 of them: ~0.25 ms of CPU per
// sandbox (bench/results/2026-12-06-init-cpu.md). runtimeFaults, and every signal when init is not PID
// 1 (tests, or a host without PID namespaces), are received and discarded
// instead: Notify, not signal.Ignore, because an ignored signal stays
// ignored across exec, in the server and every process it starts (a shell
// with SIGHUP and SIGPIPE ignored); a notified one is back to its default
// in the child.
func dropSignals() {
	notify := fatalSignals
	if unix.Getpid() == 1 {
		notify = nil
		for _, sig := range fatalSignals {
			if runtimeFaults[sig] || sigDefault(sig.(unix.Signal)) != nil {
				notify = append(notify, sig)
			}
		}
	}
	c := make(chan os.Signal, 4)
	signal.Notify(c, notify...)
	go func() {
		for range c {
		}
	}()
}

// sigDefault sets sig's disposition to SIG_DFL behind the Go runtime's
// back (os/signal has no call for it: Reset puts back the runtime's
// handler). The runtime keeps no other copy of it: nothing but Notify,
// Ignore and Reset (which init does not call for these signals) changes
// it again, and a child it forks resets its handlers to SIG_DFL anyway.
func sigDefault(sig unix.Signal) error {
	// The kernel's struct sigaction all zero: SIG_DFL, no flags, empty
	// mask (in every layout, with or without sa_restorer).
	var act [4]uint64
	_, _, errno := unix.RawSyscall6(unix.SYS_RT_SIGACTION, uintptr(sig), uintptr(unsafe.Pointer(&act[0])), 0, sigsetSize, 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

// sigsetSize is the kernel's sizeof(sigset_t) on the 64-bit Linux ports
// but mips (whose rt_sigaction then fails with EINVAL: init falls back to
// Notify).
const sigsetSize = 8

// supervisor starts the server on demand and reaps every process.
type supervisor struct {
	cfg    config
	lfd    int
	env    []string      // the server's environment; nil: init's own, less --own-env's entry
	arm    chan struct{} // ask acceptLoop for one connection
	ready  chan waiting  // a connection taken from the socket
	readyc chan readyMsg // a started server's report on --ready-fd

	pid      int // the running server; 0 when none
	gen      int // counts starts: tells a stale readyMsg apart
	started  time.Time
	held     int  // init's copy of the connection the server started with, until it serves; -1: none
	notReady bool // the server closed its ready pipe without the byte
	failures int  // consecutive failed starts
	// failure says why no server can serve (the agent binary failed the
	// boot check, or the last start failed); /health answers 503 with it.
	// Empty once a server serves.
	failure     string
	terminating bool
	exitCode    int
}

// readyMsg is what a server said on its --ready-fd: ok when it wrote the
// byte (it serves), not ok when the pipe closed without it.
type readyMsg struct {
	gen int
	ok  bool
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
		case w := <-s.ready:
			switch {
			case w.health:
				answer(w.fd, w.proto, s.failure)
				retry = s.rearm(0)
			case s.terminating || s.pid != 0:
				unix.Close(w.fd)
			default:
				if err := s.start(w.fd); err != nil {
					s.failures++
					s.failure = "the agent cannot start: " + err.Error()
					logf(err.Error())
					answer(w.fd, "", s.failure)
					retry = s.rearm(s.backoff())
				}
			}
		case m := <-s.readyc:
			if m.gen == s.gen && m.ok {
				s.served()
			} else if m.gen == s.gen {
				s.notReady = true
			}
		case <-retry:
			retry = nil
			s.arm <- struct{}{}
		}
	}
}

// served: the server said it serves; the connection it started with is
// its alone now (init's copy would keep the peer from ever seeing EOF).
func (s *supervisor) served() {
	s.failure = ""
	if s.held >= 0 {
		unix.Close(s.held)
		s.held = -1
	}
}

// rearm asks for the next connection after delay.
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

// Server fds: the listening socket, the connection that made init start
// it (served first), and the write end of a pipe on which the server
// writes one byte once it serves.
const (
	connFD  = 4
	readyFD = 5
)

// start runs the server for the connection conn. Init keeps a copy of conn
// until the server reports on readyFD, so that a server that dies before
// serving gets its reason written to that connection instead of a bare EOF.
func (s *supervisor) start(conn int) error {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return &opError{"make ready pipe", err}
	}
	argv := append(append([]string{}, s.cfg.server...),
		"--listen-fd", strconv.Itoa(listenFD), "--conn-fd", strconv.Itoa(connFD), "--ready-fd", strconv.Itoa(readyFD))
	pid, err := syscall.ForkExec(argv[0], argv, &syscall.ProcAttr{
		Env:   s.serverEnv(),
		Files: []uintptr{0, 1, 2, uintptr(s.lfd), uintptr(conn), uintptr(p[1])},
	})
	unix.Close(p[1])
	if err != nil {
		unix.Close(p[0])
		return &opError{"start server " + argv[0], err}
	}
	s.gen++
	s.pid, s.started, s.held, s.notReady = pid, time.Now(), conn, false
	go readReady(p[0], s.gen, s.readyc)
	return nil
}

// readReady reports whether the server wrote its byte on the pipe r before
// closing it (or exiting).
func readReady(r, gen int, out chan<- readyMsg) {
	var b [1]byte
	n, err := unix.Read(r, b[:])
	for errors.Is(err, unix.EINTR) {
		n, err = unix.Read(r, b[:])
	}
	unix.Close(r)
	out <- readyMsg{gen: gen, ok: err == nil && n == 1}
}

// readyGrace bounds the wait, after the server's exit, for its ready
// report: the pipe is closed by then unless a child of the server holds it.
const readyGrace = 200 * time.Millisecond

// servedBeforeExit tells, for a server that exited holding init's
// connection, whether it served (reported ready) first.
func (s *supervisor) servedBeforeExit() bool {
	t := time.NewTimer(readyGrace)
	defer t.Stop()
	for {
		select {
		case m := <-s.readyc:
			if m.gen == s.gen {
				return m.ok
			}
		case <-t.C:
			return false
		}
	}
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
		how := describe(ws) + " after " + ran.Round(time.Millisecond).String()
		neverServed := false
		if s.held >= 0 {
			if !s.notReady && s.servedBeforeExit() {
				s.served()
			} else {
				neverServed = true
			}
		}
		if s.terminating {
			if s.held >= 0 {
				unix.Close(s.held)
				s.held = -1
			}
			s.exitCode = exitCode(ws)
			return true, 0
		}
		switch {
		case neverServed:
			s.failures++
			delay = s.backoff()
			s.failure = "the agent (" + s.cfg.server[0] + ") " + how + " before serving; the sandbox's agent log has its reason"
			answer(s.held, "", s.failure)
			s.held = -1
			logf("server " + how + " before serving (failure " + strconv.Itoa(s.failures) + "); next start in " + delay.String())
		case ws.Exited() && ws.ExitStatus() == 0:
			s.failures = 0
			delay = 0
		case ran < startWindow:
			s.failures++
			delay = s.backoff()
			logf("server " + how + " (failure " + strconv.Itoa(s.failures) + "); next start in " + delay.String())
		default:
			s.failures = 0
			delay = 0
			logf("server " + describe(ws) + "; it starts again on the next connection")
		}
	}
}

// waiting is a connection init accepted while no server ran.
type waiting struct {
	fd     int
	health bool   // a GET /health whose head init has read: init answers it
	proto  string // its HTTP version
}

// peekTimeout bounds the wait for a new connection's first bytes: a client
// that sends nothing in time gets the server (which has its own timeouts).
const peekTimeout = time.Second

// acceptLoop hands the loop one connection per token on arm. Only init
// accepts meanwhile: no server runs while it is armed.
func acceptLoop(lfd int, arm <-chan struct{}, ready chan<- waiting) {
	fds := []unix.PollFd{{Fd: int32(lfd), Events: unix.POLLIN}}
	for range arm {
		for {
			if _, err := unix.Poll(fds, -1); err != nil {
				if !errors.Is(err, unix.EINTR) {
					logf("poll listening socket: " + err.Error())
					time.Sleep(time.Second) // not synchronisation: never spin on a broken fd
				}
				continue
			}
			// The socket may be non-blocking (a server's net.FileListener
			// sets that on the shared file description): EAGAIN is a
			// connection gone meanwhile.
			fd, _, err := unix.Accept4(lfd, unix.SOCK_CLOEXEC)
			if err != nil {
				if !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EINTR) && !errors.Is(err, unix.ECONNABORTED) {
					logf("accept: " + err.Error())
					time.Sleep(time.Second) // not synchronisation: never spin on a broken fd
				}
				continue
			}
			w, ok := classify(fd)
			if !ok {
				unix.Close(fd)
				continue
			}
			ready <- w
			break
		}
	}
}

// healthPrefix starts a GET /health request line.
const healthPrefix = "GET /health"

// classify looks at a new connection's first bytes without taking them
// (MSG_PEEK), so that any request but GET /health reaches the server
// untouched. A GET /health has its head read here, for init to answer. Not
// ok: the peer closed without sending anything.
func classify(fd int) (w waiting, ok bool) {
	w.fd = fd
	tv := unix.NsecToTimeval(peekTimeout.Nanoseconds())
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	defer func() {
		var zero unix.Timeval
		_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &zero)
	}()
	var buf [len(healthPrefix) + 1]byte
	n, _, err := unix.Recvfrom(fd, buf[:], unix.MSG_PEEK)
	for errors.Is(err, unix.EINTR) {
		n, _, err = unix.Recvfrom(fd, buf[:], unix.MSG_PEEK)
	}
	switch {
	case err != nil: // nothing in time: the server decides
		return w, true
	case n == 0:
		return w, false
	case n < len(buf) || string(buf[:len(healthPrefix)]) != healthPrefix || buf[len(healthPrefix)] != ' ' && buf[len(healthPrefix)] != '?':
		return w, true
	}
	w.health = true
	w.proto = readHead(fd)
	return w, true
}

// readHead reads a request's head (to the blank line, at most 8 KiB, for
// at most peekTimeout in all: a client dribbling bytes holds init's accept
// no longer) and returns its HTTP version ("" when it cannot tell).
func readHead(fd int) string {
	var head []byte
	buf := make([]byte, 1024)
	deadline := time.Now().Add(peekTimeout)
	for len(head) < 8<<10 && !strings.Contains(string(head), "\r\n\r\n") {
		left := time.Until(deadline)
		if left <= 0 {
			break
		}
		// At least 1ms: a zero timeval means no timeout at all.
		tv := unix.NsecToTimeval(max(left, time.Millisecond).Nanoseconds())
		_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		n, err := unix.Read(fd, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || n <= 0 {
			break
		}
		head = append(head, buf[:n]...)
	}
	line, _, _ := strings.Cut(string(head), "\r\n")
	if strings.HasSuffix(line, " HTTP/1.0") {
		return "HTTP/1.0"
	}
	return ""
}

// answer writes init's own answer on fd and closes it: 204 when failure is
// empty (the answer the agent gives to GET /health), else 503 with envd's
// error body naming the failure.
func answer(fd int, proto, failure string) {
	if proto == "" {
		proto = "HTTP/1.1"
	}
	const common = "Cache-Control: no-store\r\nAccess-Control-Allow-Origin: *\r\nConnection: close\r\n"
	var msg string
	if failure == "" {
		msg = proto + " 204 No Content\r\n" + common + "\r\n"
	} else {
		body := `{"code":503,"message":` + jsonString("opendsec-init: "+failure) + "}"
		msg = proto + " 503 Service Unavailable\r\n" + common + "Content-Type: application/json\r\nContent-Length: " +
			strconv.Itoa(len(body)) + "\r\n\r\n" + body
	}
	// A few hundred bytes into an empty socket buffer: this does not block
	// unless the peer stopped reading altogether, which SO_SNDTIMEO bounds.
	tv := unix.NsecToTimeval(peekTimeout.Nanoseconds())
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	// The request (or what of it arrived) is taken first: a unix socket
	// closed with unread data resets the peer, which may then lose the
	// answer.
	drain(fd)
	b := []byte(msg)
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || n <= 0 {
			break
		}
		b = b[n:]
	}
	_ = unix.Shutdown(fd, unix.SHUT_WR)
	drain(fd)
	unix.Close(fd)
}

// drain reads and drops what is waiting on fd, without waiting for more
// (at most 1 MiB: a client still sending a body after that gets a reset).
func drain(fd int) {
	buf := make([]byte, 4096)
	for total := 0; total < 1<<20; {
		n, _, err := unix.Recvfrom(fd, buf, unix.MSG_DONTWAIT)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || n <= 0 {
			return
		}
		total += n
	}
}

// jsonString quotes s as a JSON string (encoding/json would grow init).
func jsonString(s string) string {
	const hex = "0123456789abcdef"
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20:
			b.WriteString(`\u00`)
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&15])
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// checkServer returns why the server binary at path cannot run ("" when
// it looks fine): it must be executable and start like an ELF binary or a
// script. One access and one 4-byte read at boot, instead of starting the
// agent only to see it answer.
func checkServer(path string) string {
	if err := unix.Access(path, unix.X_OK); err != nil {
		return "the agent (" + path + ") cannot run: " + err.Error()
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "the agent (" + path + ") cannot be read: " + err.Error()
	}
	defer unix.Close(fd)
	var b [4]byte
	n, _ := unix.Read(fd, b[:])
	if n < 2 || string(b[:2]) != "#!" && (n < 4 || string(b[:]) != "\x7fELF") {
		return "the agent (" + path + ") is not an executable (no ELF or #! header)"
	}
	return ""
}

// serverEnv returns the server's environment from the env file when there
// is one (it is removed once read: it may hold secrets); nil when there is
// none: the server gets init's own (supervisor.serverEnv, copied only when
// a server starts).
func serverEnv(path string) ([]string, error) {
	if path == "" {
		return nil, nil
	}
	b, err := readFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, &opError{"read --env-file", err}
	}
	if err := unix.Unlink(path); err != nil {
		return nil, &opError{"remove --env-file", &fs.PathError{Op: "remove", Path: path, Err: err}}
	}
	// Not nil when the file has no entry: the server gets none then.
	env := []string{}
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

// serverEnv is the environment a server starts with.
func (s *supervisor) serverEnv() []string {
	if s.env != nil {
		return s.env
	}
	return withoutOwn(os.Environ(), s.cfg.ownEnv)
}

// withoutOwn returns env without its first entry when that is own (init's
// alone, --own-env); a later entry of the same key is the server's.
func withoutOwn(env []string, own string) []string {
	if own != "" && len(env) > 0 && env[0] == own {
		return env[1:]
	}
	return env
}

// readFile is os.ReadFile without package os: the first file os opens
// starts the Go runtime's network poller (an epoll instance, an eventfd,
// and an epoll_wait in the scheduler from then on), which init has no use
// for. Errors are os's (*fs.PathError).
func readFile(path string) ([]byte, error) {
	fd, err := openFile(path, unix.O_RDONLY)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var b []byte
	buf := make([]byte, 4096)
	for {
		n, err := unix.Read(fd, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, &fs.PathError{Op: "read", Path: path, Err: err}
		}
		if n == 0 {
			return b, nil
		}
		b = append(b, buf[:n]...)
	}
}

// writeFile writes data to the existing file at path (os.WriteFile
// without package os; see readFile).
func writeFile(path, data string) error {
	fd, err := openFile(path, unix.O_WRONLY|unix.O_TRUNC)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for b := []byte(data); len(b) > 0; {
		n, err := unix.Write(fd, b)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return &fs.PathError{Op: "write", Path: path, Err: err}
		}
		b = b[n:]
	}
	return nil
}

func openFile(path string, mode int) (int, error) {
	for {
		fd, err := unix.Open(path, mode|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return -1, &fs.PathError{Op: "open", Path: path, Err: err}
		}
		return fd, nil
	}
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
