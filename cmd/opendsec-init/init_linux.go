package main

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
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

	// The socket is non-blocking for init's accept (it is anyway once a
	// server took it: Go's net.FileListener sets that on the shared file
	// description).
	if err := unix.SetNonblock(lfd, true); err != nil {
		logf("listening socket: " + err.Error())
		return 1
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		logf("eventfd: " + err.Error())
		return 1
	}
	if err := catchSignals(wake, unix.Getpid() == 1); err != nil {
		logf(err.Error())
		return 1
	}
	p, err := newPoller()
	if err != nil {
		logf(err.Error())
		return 1
	}
	if err := p.watch(wake, true); err != nil {
		logf(err.Error())
		return 1
	}
	s := &supervisor{cfg: cfg, lfd: lfd, env: env, p: p, wake: wake, held: -1, ready: -1}
	// No server at boot: init answers the node's first GET /health itself
	// (see classify), and the server starts with the first real request.
	// A missing or non-executable agent is caught here, at no cost, and
	// reported by that /health answer.
	s.failure = checkServer(cfg.server[0])
	if s.failure != "" {
		logf(s.failure)
	}
	return s.loop()
}

// sigPending has bit 1<<sig set for each signal caught since the loop last
// looked; sigWakeFD is the eventfd the signal handler writes to wake the
// loop, and sigOne the 8 bytes it writes (catchSignals).
var (
	sigPending uint64
	sigWakeFD  int64  = -1 //nolint:unused // read by sig_linux_amd64.s
	sigOne     uint64 = 1  //nolint:unused // read by sig_linux_amd64.s
)

// takeSignals returns and clears the signals caught.
func takeSignals() uint64 { return atomic.SwapUint64(&sigPending, 0) }

// fatalSignals are the signals whose arrival from kill(2) would end init
// (the Go runtime dies of them unless they are caught): a root process in
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
// with the runtime and are dropped only when sent by a process.
var runtimeFaults = map[os.Signal]bool{
	unix.SIGSEGV: true, unix.SIGBUS: true, unix.SIGFPE: true, unix.SIGILL: true,
	unix.SIGTRAP: true, unix.SIGSYS: true,
}

// sigDefault sets sig's disposition to SIG_DFL behind the Go runtime's
// back (os/signal has no call for it: Reset puts back the runtime's
// handler). The runtime keeps no other copy of it: nothing but Notify,
// Ignore and Reset (which init does not call for these signals) changes
// it again, and a child it forks resets its handlers to SIG_DFL anyway.
//
// As PID 1 of a PID namespace (every sandbox's init) a signal whose
// disposition is SIG_DFL never reaches init, from inside the namespace or
// from outside (pid_namespaces(7); the kernel drops it, SIGKILL and SIGSTOP
// from an ancestor namespace aside): so init sets the fatalSignals but
// runtimeFaults to SIG_DFL there, which is also what the server and its
// processes inherit across exec, and costs nothing when one is sent.
// runtimeFaults, and every one of them when init is not PID 1 (tests, or a
// host without PID namespaces), are caught and discarded instead
// (catchSignals): caught, not ignored, because an ignored signal stays
// ignored across exec, in the server and every process it starts (a shell
// with SIGHUP and SIGPIPE ignored); a caught one is back to its default
// in the child.
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
// catching the signal).
const sigsetSize = 8

// poller is init's one wait: an epoll instance holding what init waits for
// (the eventfd of its signal handler, the listening socket while init
// accepts, a connection it reads the start of, a started server's ready
// pipe), itself waited on through the Go runtime's network poller. So the
// main goroutine, init's only one, parks, and the thread that runs it
// sleeps in the scheduler's epoll_pwait with nothing to run. (A goroutine
// blocked in a system call would hold a thread of its own, and each
// blocked goroutine another.) With GOMAXPROCS=1 an idle init has three
// threads: that one, the runtime's sysmon, and the idle one the runtime's
// own start leaves behind (two, when its start races: see TestIdleThreads).
// Deadlines (backoff, a connection's first bytes) are the runtime's
// timers, through SetReadDeadline.
type poller struct {
	ep  int
	f   *os.File
	rc  syscall.RawConn
	evs [8]unix.EpollEvent
}

func newPoller() (*poller, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, &opError{"epoll_create1", err}
	}
	// Non-blocking: os.NewFile then registers it with the runtime's poller.
	if err := unix.SetNonblock(ep, true); err != nil {
		unix.Close(ep)
		return nil, &opError{"epoll fd", err}
	}
	f := os.NewFile(uintptr(ep), "epoll")
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, &opError{"epoll fd", err}
	}
	return &poller{ep: ep, f: f, rc: rc}, nil
}

// watch adds fd (level-triggered, for reading) or removes it. A watched fd
// must be removed before init closes it or hands it to the server: a copy
// in another process would keep it in the set.
func (p *poller) watch(fd int, on bool) error {
	op, what := unix.EPOLL_CTL_DEL, "unwatch "
	if on {
		op, what = unix.EPOLL_CTL_ADD, "watch "
	}
	if err := unix.EpollCtl(p.ep, op, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil { //nolint:gosec // an fd fits
		return &opError{what + strconv.Itoa(fd), err}
	}
	return nil
}

// wait returns the fds that are ready, none once deadline (when not zero)
// passed.
func (p *poller) wait(deadline time.Time) ([]unix.EpollEvent, error) {
	if err := p.f.SetReadDeadline(deadline); err != nil {
		return nil, &opError{"set deadline", err}
	}
	var n int
	var werr error
	err := p.rc.Read(func(uintptr) bool {
		n, werr = unix.EpollWait(p.ep, p.evs[:], 0)
		if errors.Is(werr, unix.EINTR) {
			n, werr = 0, nil
			return true // the caller waits again
		}
		// Nothing ready: park until the epoll fd turns readable (the
		// runtime's poller watches it edge-triggered; each new event in
		// the set is an edge).
		return n > 0 || werr != nil
	})
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil, nil
	case err != nil:
		return nil, &opError{"wait", err}
	case werr != nil:
		return nil, &opError{"epoll_wait", werr}
	}
	return p.evs[:n], nil
}

// supervisor starts the server on demand and reaps every process.
type supervisor struct {
	cfg  config
	lfd  int
	env  []string // the server's environment; nil: init's own, less --own-env's entry
	p    *poller
	wake int  // the signal handler's eventfd
	lsn  bool // lfd is in the poller's set

	retryAt time.Time // no accept before then (backoff); zero: none
	pend    *pending  // a connection init accepted and reads the start of

	pid      int // the running server; 0 when none
	started  time.Time
	held     int  // init's copy of the connection the server started with, until it serves; -1: none
	ready    int  // the read end of the server's ready pipe until it reports; -1: none
	notReady bool // the server closed its ready pipe without the byte
	failures int  // consecutive failed starts
	// failure says why no server can serve (the agent binary failed the
	// boot check, or the last start failed); /health answers 503 with it.
	// Empty once a server serves.
	failure     string
	terminating bool
	exitCode    int
}

// pending is a connection init accepted while no server ran.
type pending struct {
	fd       int
	deadline time.Time // for its first bytes, then for a GET /health's head
	watched  bool
	health   bool   // a GET /health whose head init reads: init answers it
	head     []byte // what of that head arrived
}

// loop runs until init is done.
func (s *supervisor) loop() int {
	for {
		// Init accepts only while no server runs (the server accepts
		// then), one connection at a time, and not during a backoff.
		if err := s.listen(s.pid == 0 && !s.terminating && s.pend == nil && s.retryAt.IsZero()); err != nil {
			logf(err.Error())
			return 1
		}
		deadline := s.retryAt
		if s.pend != nil && (deadline.IsZero() || s.pend.deadline.Before(deadline)) {
			deadline = s.pend.deadline
		}
		evs, err := s.p.wait(deadline)
		if err != nil {
			logf(err.Error())
			return 1
		}
		for _, ev := range evs {
			// Each handler is non-blocking and checks the fd against
			// the current state: an earlier one may have closed it.
			switch fd := int(ev.Fd); {
			case fd == s.wake:
				if s.signals() {
					return s.exitCode
				}
			case fd == s.lfd && s.lsn:
				s.accept()
			case s.pend != nil && fd == s.pend.fd:
				s.classify(false)
			case fd == s.ready:
				s.readReady()
			}
		}
		now := time.Now()
		if !s.retryAt.IsZero() && !now.Before(s.retryAt) {
			s.retryAt = time.Time{}
		}
		if s.pend != nil && !now.Before(s.pend.deadline) {
			s.classify(true)
		}
	}
}

// listen puts the listening socket in the poller's set or takes it out.
func (s *supervisor) listen(on bool) error {
	if on == s.lsn {
		return nil
	}
	if err := s.p.watch(s.lfd, on); err != nil {
		return err
	}
	s.lsn = on
	return nil
}

// signals handles the signals caught; done: init exits with s.exitCode.
func (s *supervisor) signals() (done bool) {
	var b [8]byte
	_, _ = unix.Read(s.wake, b[:]) // reset the eventfd before taking the bits
	got := takeSignals()
	for _, sig := range []unix.Signal{unix.SIGTERM, unix.SIGINT} {
		if got&(1<<uint(sig)) == 0 {
			continue
		}
		s.terminating = true
		if s.pid == 0 {
			return true
		}
		// The server ends its processes and exits; init follows.
		_ = unix.Kill(s.pid, sig)
	}
	if got&(1<<uint(unix.SIGCHLD)) != 0 {
		return s.reap()
	}
	return false
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

// backoffNext: no accept for the next backoff delay.
func (s *supervisor) backoffNext() {
	s.retryAt = time.Now().Add(s.backoff())
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
	if err == nil {
		err = s.p.watch(p[0], true)
		if err != nil {
			_ = unix.Kill(pid, unix.SIGKILL) // reaped with the next SIGCHLD
		}
	}
	if err != nil {
		unix.Close(p[0])
		return &opError{"start server " + argv[0], err}
	}
	s.pid, s.started, s.held, s.ready, s.notReady = pid, time.Now(), conn, p[0], false
	return nil
}

// readReady takes the server's report on its ready pipe: the byte (it
// serves), or the pipe closed without it.
func (s *supervisor) readReady() {
	var b [1]byte
	n, err := unix.Read(s.ready, b[:])
	if errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN) {
		return // the poller says again
	}
	s.closeReady()
	if err == nil && n == 1 {
		s.served()
	} else {
		s.notReady = true
	}
}

func (s *supervisor) closeReady() {
	if s.ready >= 0 {
		_ = s.p.watch(s.ready, false)
		unix.Close(s.ready)
		s.ready = -1
	}
}

// readyGrace bounds the wait, after the server's exit, for its ready
// report: the pipe is closed by then unless a child of the server holds it.
const readyGrace = 200 * time.Millisecond

// servedBeforeExit tells, for a server that exited holding init's
// connection, whether it served (reported ready) first: the report may
// still be in the pipe, not yet taken by the loop.
func (s *supervisor) servedBeforeExit() bool {
	if s.ready >= 0 {
		fds := []unix.PollFd{{Fd: int32(s.ready), Events: unix.POLLIN}} //nolint:gosec // an fd fits
		deadline := time.Now().Add(readyGrace)
		for left := readyGrace; left > 0; left = time.Until(deadline) {
			n, err := unix.Poll(fds, int(left.Milliseconds())+1)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if n > 0 {
				s.readReady()
			}
			break
		}
	}
	return s.held < 0
}

// reap collects every exited child. When the server is among them it
// says whether init is done, and when init accepts again.
func (s *supervisor) reap() (done bool) {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || pid <= 0 {
			return false
		}
		if pid != s.pid {
			continue // an orphan
		}
		s.pid = 0
		ran := time.Since(s.started)
		how := describe(ws) + " after " + ran.Round(time.Millisecond).String()
		neverServed := s.held >= 0 && (s.notReady || !s.servedBeforeExit())
		s.closeReady()
		if s.terminating {
			if s.held >= 0 {
				unix.Close(s.held)
				s.held = -1
			}
			s.exitCode = exitCode(ws)
			return true
		}
		switch {
		case neverServed:
			s.failures++
			s.backoffNext()
			s.failure = "the agent (" + s.cfg.server[0] + ") " + how + " before serving; the sandbox's agent log has its reason"
			answer(s.held, "", s.failure)
			s.held = -1
			logf("server " + how + " before serving (failure " + strconv.Itoa(s.failures) + "); next start in " + s.backoff().String())
		case ws.Exited() && ws.ExitStatus() == 0:
			s.failures = 0
			s.retryAt = time.Time{}
		case ran < startWindow:
			s.failures++
			s.backoffNext()
			logf("server " + how + " (failure " + strconv.Itoa(s.failures) + "); next start in " + s.backoff().String())
		default:
			s.failures = 0
			s.retryAt = time.Time{}
			logf("server " + describe(ws) + "; it starts again on the next connection")
		}
	}
}

// peekTimeout bounds the wait for a new connection's first bytes: a client
// that sends nothing in time gets the server (which has its own timeouts).
// It bounds the wait for a GET /health's head the same.
const peekTimeout = time.Second

// accept takes one connection: only init accepts meanwhile, no server runs.
func (s *supervisor) accept() {
	// The socket is non-blocking: EAGAIN is a connection gone meanwhile.
	fd, _, err := unix.Accept4(s.lfd, unix.SOCK_CLOEXEC)
	if err != nil {
		if !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EINTR) && !errors.Is(err, unix.ECONNABORTED) {
			logf("accept: " + err.Error())
			s.retryAt = time.Now().Add(time.Second) // never spin on a broken socket
		}
		return
	}
	s.pend = &pending{fd: fd, deadline: time.Now().Add(peekTimeout)}
	s.classify(false) // the request is usually there already
}

// healthPrefix starts a GET /health request line.
const healthPrefix = "GET /health"

// classify looks at the pending connection's first bytes without taking
// them (MSG_PEEK), so that any request but GET /health reaches the server
// untouched; a GET /health has its head read here, for init to answer.
// Nothing waits: with no bytes yet the connection joins the poller's set
// until they come or its deadline passes (timedOut). A connection that
// sends nothing in time goes to the server; one closed before sending
// anything starts nothing.
func (s *supervisor) classify(timedOut bool) {
	c := s.pend
	if !c.health {
		var buf [len(healthPrefix) + 1]byte
		n, _, err := unix.Recvfrom(c.fd, buf[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		for errors.Is(err, unix.EINTR) {
			n, _, err = unix.Recvfrom(c.fd, buf[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		}
		switch {
		case errors.Is(err, unix.EAGAIN) && !timedOut:
			s.watchPending()
			return
		case err != nil: // nothing in time: the server decides
			s.toServer()
			return
		case n == 0:
			s.dropPending()
			unix.Close(c.fd)
			return
		case n < len(buf) || string(buf[:len(healthPrefix)]) != healthPrefix || buf[len(healthPrefix)] != ' ' && buf[len(healthPrefix)] != '?':
			s.toServer()
			return
		}
		// The head gets its own peekTimeout: a client dribbling bytes
		// holds init's accept no longer.
		c.health, c.deadline, timedOut = true, time.Now().Add(peekTimeout), false
	}
	buf := make([]byte, 1024)
	for len(c.head) < 8<<10 && !strings.Contains(string(c.head), "\r\n\r\n") {
		n, _, err := unix.Recvfrom(c.fd, buf, unix.MSG_DONTWAIT)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if errors.Is(err, unix.EAGAIN) && !timedOut {
			s.watchPending()
			return
		}
		if err != nil || n <= 0 {
			break
		}
		c.head = append(c.head, buf[:n]...)
	}
	s.dropPending()
	proto := ""
	if line, _, _ := strings.Cut(string(c.head), "\r\n"); strings.HasSuffix(line, " HTTP/1.0") {
		proto = "HTTP/1.0"
	}
	answer(c.fd, proto, s.failure)
}

// watchPending puts the pending connection in the poller's set: it has no
// unread bytes (level-triggered, it would be ready at once otherwise).
func (s *supervisor) watchPending() {
	if s.pend.watched {
		return
	}
	if err := s.p.watch(s.pend.fd, true); err != nil {
		logf(err.Error())
		s.pend.deadline = time.Now() // decided without waiting
		return
	}
	s.pend.watched = true
}

// dropPending takes the pending connection out of the poller's set and of
// the supervisor, for init to answer, close or hand it over.
func (s *supervisor) dropPending() {
	if s.pend.watched {
		_ = s.p.watch(s.pend.fd, false)
	}
	s.pend = nil
}

// toServer hands the pending connection to a new server.
func (s *supervisor) toServer() {
	fd := s.pend.fd
	s.dropPending()
	if s.terminating || s.pid != 0 {
		unix.Close(fd)
		return
	}
	if err := s.start(fd); err != nil {
		s.failures++
		s.failure = "the agent cannot start: " + err.Error()
		logf(err.Error())
		answer(fd, "", s.failure)
		s.backoffNext()
	}
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
