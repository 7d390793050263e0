package inittest

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/testutil"
)

func poll(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %s", what, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// lockedBuffer is a bytes.Buffer that a process's output copier writes
// while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// startInit runs opendsec-init (not as PID 1) with server and returns it
// and its socket.
func startInit(t *testing.T, server ...string) (*exec.Cmd, string, *lockedBuffer) {
	t.Helper()
	return startInitEnv(t, nil, nil, server...)
}

// startInitEnv is startInit with init's arguments before --listen and its
// environment's first entries (then the test's own).
func startInitEnv(t *testing.T, args, env []string, server ...string) (*exec.Cmd, string, *lockedBuffer) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "run", "agent.sock")
	cmd := exec.Command(testutil.InitBinary(t), append(append(args, "--listen", sock, "--"), server...)...)
	if env != nil {
		cmd.Env = append(env, os.Environ()...)
	}
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	poll(t, 5*time.Second, "init's socket", func() bool { return listening(sock) })
	return cmd, sock, stderr
}

// listening reports whether a unix socket listens at path: its file
// exists from bind(2) on, but connections are refused until listen(2).
func listening(path string) bool {
	b, _ := os.ReadFile("/proc/net/unix")
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		// Num RefCount Protocol Flags Type St Inode Path; Flags has
		// __SO_ACCEPTCON (0x10000) once it listens.
		if len(f) == 8 && f[7] == path && f[3] == "00010000" {
			return true
		}
	}
	return false
}

// children lists the pids whose parent is pid.
func children(pid int) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		f := bytes.Fields(b[bytes.LastIndexByte(b, ')')+1:])
		if len(f) > 1 && string(f[1]) == strconv.Itoa(pid) && string(f[0]) != "Z" {
			c, _ := strconv.Atoi(e.Name())
			out = append(out, c)
		}
	}
	return out
}

// unixClient is an HTTP client of the socket, one connection per request.
func unixClient(sock string) *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
}

// get asks for path on the socket and returns the status and body.
func get(t *testing.T, hc *http.Client, path string, stderr *lockedBuffer) (int, string) {
	t.Helper()
	resp, err := hc.Get("http://agent" + path)
	if err != nil {
		t.Fatalf("GET %s: %v (init stderr: %s)", path, err, stderr)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// request writes a raw HTTP/1.0 request on a new connection and returns
// all the connection carries until EOF: the answer ends only when every
// copy of the connection is closed, so a complete read shows that init let
// go of the connection it handed to the server.
func request(t *testing.T, sock, path string) string {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("GET " + path + " HTTP/1.0\r\nHost: agent\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("GET %s: read to EOF: %v (got %q)", path, err, b)
	}
	return string(b)
}

// TestHealthWithoutServerThenOnDemand: no server runs at boot; init itself
// answers GET /health (the node's check after every create) as the agent
// would, without starting one. The first other request starts the real
// agent, which serves it (handed over untouched) and exits after its idle
// window; the next request starts a new one on the same socket.
func TestHealthWithoutServerThenOnDemand(t *testing.T) {
	cmd, sock, stderr := startInit(t, testutil.AgentBinary(t), "--log-level", "warn", "--idle-exit", "300ms")
	hc := unixClient(sock)
	for range 3 {
		resp, err := hc.Get("http://agent/health?probe=1")
		if err != nil {
			t.Fatalf("health: %v (init stderr: %s)", err, stderr)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent || resp.Header.Get("Access-Control-Allow-Origin") != "*" {
			t.Fatalf("health: %d %v, want 204 with the agent's headers", resp.StatusCode, resp.Header)
		}
	}
	if got := children(cmd.Process.Pid); len(got) != 0 {
		t.Fatalf("servers after /health only: %v, want none", got)
	}
	// Not /health: a path that only starts like it goes to the server.
	if code, _ := get(t, hc, "/healthz", stderr); code != http.StatusNotFound {
		t.Fatalf("GET /healthz: %d, want the agent's 404", code)
	}
	first := children(cmd.Process.Pid)
	if len(first) != 1 {
		t.Fatalf("servers after a real request: %v, want one", first)
	}
	if got := request(t, sock, "/envs"); !strings.HasPrefix(got, "HTTP/1.0 200") || !strings.Contains(got, "PATH") {
		t.Fatalf("GET /envs: %q", got)
	}
	poll(t, 10*time.Second, "server idle exit", func() bool { return len(children(cmd.Process.Pid)) == 0 })
	// The first request after the exit is handed to a new server and gets
	// the whole answer and EOF (init kept no copy of the connection).
	if got := request(t, sock, "/envs"); !strings.HasPrefix(got, "HTTP/1.0 200") {
		t.Fatalf("GET /envs after the idle exit: %q (init stderr: %s)", got, stderr)
	}
	second := children(cmd.Process.Pid)
	if len(second) != 1 || second[0] == first[0] {
		t.Fatalf("servers after the idle exit: %v (first %v), want a new one", second, first)
	}
	if cmd.ProcessState != nil {
		t.Fatal("init exited")
	}
}

// TestServerFailureReported: a server that dies before serving leaves
// no caller with a bare EOF: the request that started it gets a 503 whose
// message names the agent and how it ended, /health says the same from then
// on, and the next starts come with a growing delay, never in a tight loop.
func TestServerFailureReported(t *testing.T) {
	count := filepath.Join(t.TempDir(), "starts")
	cmd, sock, stderr := startInit(t, "/bin/sh", "-c", "echo x >> "+count+"; exit 3")
	hc := unixClient(sock)
	if code, _ := get(t, hc, "/health", stderr); code != http.StatusNoContent {
		t.Fatalf("health before any start: %d, want 204 (the binary looks fine)", code)
	}
	code, body := get(t, hc, "/envs", stderr)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "/bin/sh") || !strings.Contains(body, "exited with status 3") {
		t.Fatalf("request to a failing server: %d %q, want 503 naming the agent and its exit", code, body)
	}
	if code, body := get(t, hc, "/health", stderr); code != http.StatusServiceUnavailable || !strings.Contains(body, "exited with status 3") {
		t.Fatalf("health after the failure: %d %q, want 503 with the reason", code, body)
	}
	// Many waiting requests: each gets its answer, one start at a time.
	// Backoff 100ms, 200ms, 400ms, 800ms...: within 1.5s of the first
	// start at most 5 starts; without it there would be hundreds.
	start := time.Now()
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.Dial("unix", sock)
			if err != nil {
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(1500 * time.Millisecond))
			c.Write([]byte("GET /envs HTTP/1.0\r\n\r\n"))
			io.ReadAll(c)
		}()
	}
	wg.Wait()
	b, _ := os.ReadFile(count)
	if n := strings.Count(string(b), "x"); n > 7 {
		t.Fatalf("%d starts in %s: init spins", n, time.Since(start))
	}
	if !strings.Contains(stderr.String(), "exited with status 3") {
		t.Errorf("init did not log the failure: %q", stderr.String())
	}
	if cmd.ProcessState != nil {
		t.Fatal("init exited")
	}
}

// TestMissingServerReported: an agent binary that is not there is seen at
// boot, without starting anything: /health answers 503 naming it (so the
// node's check after create fails and stops the sandbox with the reason),
// and so does a request.
func TestMissingServerReported(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "no-agent")
	cmd, sock, stderr := startInit(t, missing)
	hc := unixClient(sock)
	for _, path := range []string{"/health", "/envs"} {
		code, body := get(t, hc, path, stderr)
		if code != http.StatusServiceUnavailable || !strings.Contains(body, missing) || !strings.Contains(body, "no such file") {
			t.Fatalf("GET %s with a missing agent: %d %q, want 503 naming %s", path, code, body, missing)
		}
	}
	notExec := filepath.Join(t.TempDir(), "agent")
	if err := os.WriteFile(notExec, []byte("MZ not an ELF"), 0o755); err != nil {
		t.Fatal(err)
	}
	_, sock2, stderr2 := startInit(t, notExec)
	if code, body := get(t, unixClient(sock2), "/health", stderr2); code != http.StatusServiceUnavailable || !strings.Contains(body, "not an executable") {
		t.Fatalf("health with a non-executable agent: %d %q", code, body)
	}
	if cmd.ProcessState != nil {
		t.Fatal("init exited")
	}
}

// TestSlowHealthClientHoldsNoOne: a client that sends the start of a
// GET /health and then dribbles holds init's accept for at most about a
// second: a health request behind it is answered, and so is the slow one.
func TestSlowHealthClientHoldsNoOne(t *testing.T) {
	cmd, sock, stderr := startInit(t, "/bin/false")
	slow, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	if _, err := slow.Write([]byte("GET /health HTTP/1.1\r\nHost: a")); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	dribbled := make(chan struct{})
	go func() {
		defer close(dribbled)
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond): // the dribble's pace, not synchronisation
				if _, err := slow.Write([]byte("x")); err != nil {
					return
				}
			}
		}
	}()
	defer func() { close(stop); <-dribbled }()
	start := time.Now()
	if code, _ := get(t, unixClient(sock), "/health", stderr); code != http.StatusNoContent {
		t.Fatalf("health behind a slow client: %d", code)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("health behind a slow client took %s; init's wait for a head is bounded by about 1s", d)
	}
	slow.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 64)
	if n, err := slow.Read(b); err != nil || !strings.HasPrefix(string(b[:n]), "HTTP/1.1 204") {
		t.Fatalf("slow client's answer: %q, %v", b[:n], err)
	}
	if cmd.ProcessState != nil {
		t.Fatal("init exited")
	}
}

// TestSilentConnectionGoesToServer: a connection that sends nothing within
// init's peek window is handed to the server (its timeouts apply), and one
// closed before sending anything starts nothing.
func TestSilentConnectionGoesToServer(t *testing.T) {
	count := filepath.Join(t.TempDir(), "starts")
	cmd, sock, _ := startInit(t, "/bin/sh", "-c", "echo x >> "+count+"; exec sleep 60")
	closed, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	silent, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	t.Cleanup(func() {
		for _, c := range children(cmd.Process.Pid) {
			syscall.Kill(c, syscall.SIGKILL)
		}
	})
	starts := func() int {
		b, _ := os.ReadFile(count)
		return strings.Count(string(b), "x")
	}
	// The closed connection was first in the queue: by the time the silent
	// one started a server, init was done with it.
	poll(t, 5*time.Second, "server start for the silent connection", func() bool { return starts() >= 1 })
	if n := starts(); n != 1 {
		t.Fatalf("%d starts, want 1 (the closed connection starts nothing)", n)
	}
}

// TestSIGTERMForwarded: SIGTERM reaches the server, and init exits when
// the server has, with its status.
func TestSIGTERMForwarded(t *testing.T) {
	marker := filepath.Join(t.TempDir(), "term")
	trapped := marker + ".trapped"
	cmd, sock, _ := startInit(t, "/bin/sh", "-c", "trap 'echo got > "+marker+"; exit 0' TERM; touch "+trapped+"; while :; do sleep 0.05; done")
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("GET /envs HTTP/1.0\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	// The trap must be set before the signal, or the shell dies of it.
	poll(t, 5*time.Second, "server start", func() bool { _, err := os.Stat(trapped); return err == nil })
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("init: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("init did not exit after SIGTERM")
	}
	if b, _ := os.ReadFile(marker); string(b) != "got\n" {
		t.Fatalf("server did not get SIGTERM (marker %q)", b)
	}
}

// TestStraySignalsDoNotKillInit: signals whose default ends a process (a
// root process's kill -HUP 1) leave init running, and the server it starts
// still has them at their default (not ignored).
func TestStraySignalsDoNotKillInit(t *testing.T) {
	dir := t.TempDir()
	marker, sigign := filepath.Join(dir, "term"), filepath.Join(dir, "sigign")
	// The trap goes first: the test signals once the sigign file exists,
	// and a TERM before the trap would end the shell (status 143). A
	// trapped signal is caught, not ignored, so SigIgn still shows what
	// init passed on.
	cmd, sock, stderr := startInit(t, "/bin/sh", "-c", "trap 'echo got > "+marker+"; exit 0' TERM; grep SigIgn /proc/self/status > "+sigign+".new; mv "+sigign+".new "+sigign+
		"; while :; do sleep 0.05; done")
	conn, err := net.Dial("unix", sock) // a request starts the server
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("GET /envs HTTP/1.0\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	poll(t, 5*time.Second, "server start", func() bool { _, err := os.Stat(sigign); return err == nil })
	for _, sig := range []syscall.Signal{syscall.SIGHUP, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGPIPE, syscall.SIGQUIT, syscall.SIGALRM, syscall.SIGSEGV} {
		if err := cmd.Process.Signal(sig); err != nil {
			t.Fatalf("send %v: %v", sig, err)
		}
	}
	// Init still supervises: SIGTERM reaches the server and init exits
	// with its status, not of a stray signal.
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("init after stray signals: %v (stderr %q)", err, stderr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("init did not exit after SIGTERM")
	}
	if b, _ := os.ReadFile(marker); string(b) != "got\n" {
		t.Fatalf("server did not get SIGTERM (marker %q)", b)
	}
	b, err := os.ReadFile(sigign)
	if err != nil {
		t.Fatal(err)
	}
	mask := statusMask(t, string(b), "SigIgn:")
	for _, sig := range []syscall.Signal{syscall.SIGHUP, syscall.SIGPIPE, syscall.SIGUSR1} {
		if mask&(1<<(uint(sig)-1)) != 0 {
			t.Errorf("the server inherits %v ignored (SigIgn %x)", sig, mask)
		}
	}
}

// TestStraySignalsDoNotKillInitAsPID1: as in a sandbox, init is PID 1 of a
// PID namespace. The signals whose default ends a process, sent by a root
// process inside (kill -HUP 1) and from the host, leave it running; it
// leaves them at SIG_DFL there (the kernel drops those for a namespace's
// init), and the server it starts has none of them ignored. SIGTERM still
// reaches the server.
func TestStraySignalsDoNotKillInitAsPID1(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("a PID namespace needs root")
	}
	stray := []syscall.Signal{syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGPIPE,
		syscall.SIGALRM, syscall.SIGVTALRM, syscall.SIGSTKFLT, syscall.SIGXCPU, syscall.SIGXFSZ, syscall.SIGIO,
		syscall.SIGPWR, syscall.SIGABRT, syscall.SIGSYS, syscall.SIGTRAP, syscall.SIGSEGV, syscall.SIGBUS}
	var kills strings.Builder
	for _, sig := range stray {
		kills.WriteString("kill -" + strconv.Itoa(int(sig)) + " 1 || exit 7; ")
	}
	dir := t.TempDir()
	marker, sigign := filepath.Join(dir, "term"), filepath.Join(dir, "sigign")
	sock := filepath.Join(dir, "run", "agent.sock")
	cmd := exec.Command(testutil.InitBinary(t), "--listen", sock, "--", "/bin/sh", "-c",
		"trap 'echo got > "+marker+"; exit 0' TERM; "+kills.String()+
			"grep SigIgn /proc/self/status > "+sigign+".new; mv "+sigign+".new "+sigign+"; while :; do sleep 0.05; done")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
	})
	poll(t, 5*time.Second, "init's socket", func() bool { return listening(sock) })
	conn, err := net.Dial("unix", sock) // a request starts the server
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("GET /envs HTTP/1.0\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	// The server sent every stray signal to init (its PID 1) before it
	// writes the file; the host sends them too.
	poll(t, 5*time.Second, "server's signals", func() bool { _, err := os.Stat(sigign); return err == nil })
	for _, sig := range stray {
		if err := cmd.Process.Signal(sig); err != nil {
			t.Fatalf("send %v: %v", sig, err)
		}
	}
	st, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	caught := statusMask(t, string(st), "SigCgt:")
	for sig, want := range map[syscall.Signal]bool{syscall.SIGHUP: false, syscall.SIGUSR1: false, syscall.SIGPIPE: false,
		syscall.SIGSEGV: false, syscall.SIGTERM: true, syscall.SIGCHLD: true} {
		if got := caught&(1<<(uint(sig)-1)) != 0; got != want {
			t.Errorf("init as PID 1 catches %v: %v, want %v", sig, got, want)
		}
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		done <- err // for the cleanup
		if err != nil {
			t.Fatalf("init after stray signals: %v (stderr %q)", err, stderr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("init did not exit after SIGTERM")
	}
	if b, _ := os.ReadFile(marker); string(b) != "got\n" {
		t.Fatalf("server did not get SIGTERM (marker %q)", b)
	}
	b, err := os.ReadFile(sigign)
	if err != nil {
		t.Fatal(err)
	}
	ign := statusMask(t, string(b), "SigIgn:")
	for _, sig := range stray {
		if ign&(1<<(uint(sig)-1)) != 0 {
			t.Errorf("the server inherits %v ignored (SigIgn %x)", sig, ign)
		}
	}
}

// statusMask returns the hex mask on /proc/PID/status's line key.
func statusMask(t *testing.T, status, key string) uint64 {
	t.Helper()
	v := statusField(t, status, key)
	m, err := strconv.ParseUint(v, 16, 64)
	if err != nil {
		t.Fatalf("%s %q: %v", key, v, err)
	}
	return m
}

// statusField returns the value on /proc/PID/status's line key, trimmed.
func statusField(t *testing.T, status, key string) string {
	t.Helper()
	for _, l := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(l, key); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %s in %q", key, status)
	return ""
}

// TestInheritedListener: with --listen-fd, init serves on a socket the
// caller bound and listened on before starting it, and a connection made
// before init even ran is answered; the socket is not left open as fd 3 in
// init (it moved to a close-on-exec descriptor). A descriptor that is not
// a listening unix socket is refused at start.
func TestInheritedListener(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	lf, err := ln.File()
	if err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(lf.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	listener := "socket:[" + strconv.FormatUint(st.Ino, 10) + "]"
	ln.SetUnlinkOnClose(false)
	ln.Close() // lf keeps the socket listening
	// Connect before init runs: the connection waits in the backlog.
	early, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer early.Close()
	cmd := exec.Command(testutil.InitBinary(t), "--listen-fd", "3", "--", testutil.AgentBinary(t), "--log-level", "warn")
	cmd.ExtraFiles = []*os.File{lf}
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lf.Close()
	cmd.WaitDelay = 5 * time.Second
	t.Cleanup(func() {
		for _, c := range children(cmd.Process.Pid) {
			syscall.Kill(c, syscall.SIGKILL)
		}
		cmd.Process.Kill()
		cmd.Wait()
	})
	early.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := early.Write([]byte("GET /health HTTP/1.0\r\nHost: agent\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, err := early.Read(buf)
	if err != nil || !strings.HasPrefix(string(buf[:n]), "HTTP/1.0 204") && !strings.HasPrefix(string(buf[:n]), "HTTP/1.0 200") {
		t.Fatalf("early connection: %q, %v; init stderr: %s", buf[:n], err, stderr.String())
	}
	// (Init may hold another descriptor numbered 3 meanwhile: the
	// connection it accepted and is closing.)
	if l, err := os.Readlink("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/fd/3"); err == nil && l == listener {
		t.Errorf("init still holds the listening socket as fd 3; it must move to a close-on-exec descriptor")
	}

	// A pipe is not a listening socket.
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	bad := exec.Command(testutil.InitBinary(t), "--listen-fd", "3", "--", testutil.AgentBinary(t))
	bad.ExtraFiles = []*os.File{r}
	out, err := bad.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "--listen-fd 3: not a socket") {
		t.Fatalf("init with a pipe as --listen-fd: %v, %q; want a refusal naming --listen-fd", err, out)
	}
	// A unix socket that does not listen.
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	sp := os.NewFile(uintptr(fds[0]), "sp")
	defer sp.Close()
	defer syscall.Close(fds[1])
	bad = exec.Command(testutil.InitBinary(t), "--listen-fd", "3", "--", testutil.AgentBinary(t))
	bad.ExtraFiles = []*os.File{sp}
	out, err = bad.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "not listening") {
		t.Fatalf("init with a connected socket as --listen-fd: %v, %q; want a refusal", err, out)
	}
}

// TestEnvFile: the --env-file's entries are the server's whole environment
// (init's own is not passed on), and the file is gone once read; a file
// with an entry that is not K=V stops init with an error naming it; a
// missing file means init's own environment.
func TestEnvFile(t *testing.T) {
	dir := t.TempDir()
	server := filepath.Join(dir, "server")
	out := filepath.Join(dir, "env.out")
	// The "server" writes its environment and exits 0 at once.
	if err := os.WriteFile(server, []byte("#!/bin/sh\nenv > "+out+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	envFile := filepath.Join(dir, "agent.env")
	if err := os.WriteFile(envFile, []byte("A=1\x00B=two words\x00PATH=/usr/bin:/bin\x00"), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "s.sock")
	cmd := exec.Command(testutil.InitBinary(t), "--listen", sock, "--env-file", envFile, "--", server)
	cmd.Env = []string{"INIT_ONLY=x", "PATH=/usr/bin:/bin"}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	poll(t, 5*time.Second, "init's socket", func() bool { return listening(sock) })
	// A request starts the server; its answer is a 503 (the server exits
	// before serving), which proves nothing here: the env it wrote does.
	if got := request(t, sock, "/envs"); !strings.HasPrefix(got, "HTTP/1.1 503") {
		t.Fatalf("GET /envs with a server that exits at once: %q", got)
	}
	poll(t, 10*time.Second, "server's env written", func() bool {
		b, err := os.ReadFile(out)
		return err == nil && strings.Contains(string(b), "PATH=")
	})
	b, _ := os.ReadFile(out)
	got := string(b)
	if !strings.Contains(got, "A=1\n") || !strings.Contains(got, "B=two words\n") || strings.Contains(got, "INIT_ONLY") {
		t.Fatalf("server env:\n%s\nwant A and B from the env file and nothing of init's own", got)
	}
	if _, err := os.Stat(envFile); !os.IsNotExist(err) {
		t.Fatalf("env file still there after boot: %v", err)
	}

	if err := os.WriteFile(envFile, []byte("A=1\x00junk\x00"), 0o600); err != nil {
		t.Fatal(err)
	}
	bad := exec.Command(testutil.InitBinary(t), "--listen", filepath.Join(dir, "s2.sock"), "--env-file", envFile, "--", server)
	msg, err := bad.CombinedOutput()
	if err == nil || !strings.Contains(string(msg), `entry "junk" is not K=V`) {
		t.Fatalf("init with a bad env file: %v, %q", err, msg)
	}
}

// threadSyscalls returns, for each thread of pid, the system call it is
// blocked in ("running" when it runs).
func threadSyscalls(t *testing.T, pid int) map[int]string {
	t.Helper()
	dir := "/proc/" + strconv.Itoa(pid) + "/task"
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]string{}
	for _, e := range ents {
		tid, _ := strconv.Atoi(e.Name())
		b, err := os.ReadFile(dir + "/" + e.Name() + "/syscall")
		if err != nil {
			continue // the thread ended
		}
		nr, _, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
		out[tid] = nr
	}
	return out
}

// TestIdleThreads: an idle init (after the node's first GET /health, no
// server running) is one thread asleep in epoll_pwait (init's one wait:
// socket, signals, timeouts). Every thread costs each later container
// create on the host (crun's pivot_root walks them all): the Go init it
// replaces kept three, and six or seven before that.
func TestIdleThreads(t *testing.T) {
	cmd, sock, stderr := startInit(t, testutil.AgentBinary(t))
	if code, _ := get(t, unixClient(sock), "/health", stderr); code != http.StatusNoContent {
		t.Fatalf("health: %d", code)
	}
	epollPwait := strconv.Itoa(syscall.SYS_EPOLL_PWAIT)
	var last map[int]string
	idle := func() bool {
		last = threadSyscalls(t, cmd.Process.Pid)
		return len(last) == 1 && last[cmd.Process.Pid] == epollPwait
	}
	deadline := time.Now().Add(5 * time.Second)
	for !idle() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if !idle() {
		t.Fatalf("idle init: threads in system calls %v, want one thread in epoll_pwait (%s)", last, epollPwait)
	}
	if got := children(cmd.Process.Pid); len(got) != 0 {
		t.Fatalf("servers after /health only: %v, want none", got)
	}
	// Its own memory (anonymous: heap, stack, data), what each sandbox
	// adds: 40 kB with musl, 80 kB with glibc (the Go init had ~630 kB).
	// Its binary's pages are the page cache's, shared by every sandbox.
	st, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	if anon := statusKB(t, string(st), "RssAnon:"); anon > 256 {
		t.Fatalf("idle init's anonymous memory: %d kB, want under 256 kB", anon)
	}
}

// statusKB returns the kB count on /proc/PID/status's line key.
func statusKB(t *testing.T, status, key string) int {
	t.Helper()
	v := statusField(t, status, key)
	n, err := strconv.Atoi(strings.TrimSuffix(v, " kB"))
	if err != nil {
		t.Fatalf("%s %q: %v", key, v, err)
	}
	return n
}

// TestOrphansReapedAsPID1: as in a sandbox, init is PID 1 of a PID
// namespace and every orphan there becomes its child: each one that exits
// is reaped (no zombie stays), while the server runs.
func TestOrphansReapedAsPID1(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("a PID namespace needs root")
	}
	dir := t.TempDir()
	marker := filepath.Join(dir, "spawned")
	sock := filepath.Join(dir, "run", "agent.sock")
	// Each ( ... & ) leaves a sleep whose parent exits at once: an orphan,
	// reparented to init, that exits a moment later.
	cmd := exec.Command(testutil.InitBinary(t), "--listen", sock, "--", "/bin/sh", "-c",
		"for i in 1 2 3 4 5 6 7 8; do (sleep 0.2 &); done; touch "+marker+"; while :; do sleep 0.05; done")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	poll(t, 5*time.Second, "init's socket", func() bool { return listening(sock) })
	conn, err := net.Dial("unix", sock) // a request starts the server
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("GET /envs HTTP/1.0\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	poll(t, 5*time.Second, "orphans spawned", func() bool { _, err := os.Stat(marker); return err == nil })
	orphans := func() (n, zombies int) {
		for _, c := range allChildren(cmd.Process.Pid) {
			if c.state == "Z" {
				zombies++
			}
			if c.comm == "sleep" {
				n++
			}
		}
		return n, zombies
	}
	if n, _ := orphans(); n == 0 {
		t.Fatalf("no orphan became init's child (init stderr %q)", stderr)
	}
	// The orphans exit after 0.2s; reaped, they leave no trace.
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, z := orphans()
		if n == 0 && z == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("init has %d orphans, %d zombies 10s on: not reaped", n, z)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if cmd.ProcessState != nil {
		t.Fatal("init exited")
	}
}

type child struct{ comm, state string }

// allChildren lists the processes whose parent is pid, zombies included.
func allChildren(pid int) []child {
	var out []child
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		i, j := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
		if i < 0 || j < i {
			continue
		}
		f := bytes.Fields(b[j+1:])
		if len(f) > 1 && string(f[1]) == strconv.Itoa(pid) {
			out = append(out, child{comm: string(b[i+1 : j]), state: string(f[0])})
		}
	}
	return out
}
