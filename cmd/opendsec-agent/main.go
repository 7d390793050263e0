// Command opendsec-agent runs inside every sandbox and serves E2B's envd
// protocol on a unix socket or a TCP address. In containers it runs under
// opendsec-init (PID 1), which hands it the listening socket (--listen-fd)
// and starts it again on demand after it exits idle (--idle-exit).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kernflux/opendsec/internal/agent"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/seccompbpf"
	"github.com/kernflux/opendsec/internal/version"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "opendsec-agent:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		listen    = flag.String("listen", "/run/opendsec/agent.sock", "unix socket path, or tcp:HOST:PORT")
		cfg       agent.Config
		tokenFile = flag.String("access-token-file", "", "file holding the envd access token (empty: no token, routes are open)")
		logLevel  = flag.String("log-level", "info", "debug, info, warn or error")
		showVer   = flag.Bool("version", false, "print the version and exit")
		seccompF  = flag.String("seccomp-filter", "", "install this seccomp BPF program (no_new_privs, all threads) before anything else; the agent exits if it cannot")
		listenFD  = flag.Int("listen-fd", -1, "serve on this inherited listening socket (from opendsec-init) instead of --listen; makes the agent a child subreaper")
		connFD    = flag.Int("conn-fd", -1, "with --listen-fd: an accepted connection opendsec-init took from the socket; served first")
		readyFD   = flag.Int("ready-fd", -1, "with --listen-fd: write one byte on this pipe and close it once serving (opendsec-init answers the --conn-fd connection itself if the agent dies before)")
		idleExit  = flag.Duration("idle-exit", 0, "exit cleanly after this long without requests, child processes or watchers (0: never); needs --listen-fd")
		envFile   = flag.String("env-file", "", "KEY=VALUE lines set in the agent's environment (and so every process's) at start, over what it was given; a missing file sets nothing (the gvisor backend's Launch writes it)")
		dial      = flag.String("dial", "", "proxy mode: connect to this tcp:HOST:PORT, copy stdin to it and it to stdout, then exit (the gvisor backend reaches the agent this way through `runsc exec`)")
	)
	flag.StringVar(&cfg.DefaultUser, "default-user", agent.DefaultUser, "user for requests that name none")
	flag.StringVar(&cfg.DefaultWorkdir, "default-workdir", "", "cwd for processes started without one (default: the user's home)")
	flag.IntVar(&cfg.MaxOutputBytes, "max-output-bytes", agent.DefaultMaxOutputBytes, "output retained per process; older output is dropped")
	flag.Int64Var(&cfg.MaxUploadBytes, "max-upload-bytes", agent.DefaultMaxUploadBytes, "largest file accepted by POST /files")
	flag.DurationVar(&cfg.IdleTrimAfter, "idle-trim-after", agent.DefaultIdleTrimAfter, "return freed memory to the OS once no request ran for this long after some work (negative: never)")
	flag.Parse()
	if *showVer {
		fmt.Println(version.Version)
		return nil
	}
	if *dial != "" {
		return proxyStdio(*dial)
	}
	// First: nothing the agent starts, nor the agent once it serves
	// requests, may run without the sandbox's filter.
	if *seccompF != "" {
		if err := seccompbpf.Install(*seccompF); err != nil {
			return err
		}
	}
	if *envFile != "" {
		if err := loadEnvFile(*envFile); err != nil {
			return err
		}
	}
	if *idleExit < 0 {
		return fmt.Errorf("--idle-exit: %s is negative; give 0 (never) or a duration like 30s", *idleExit)
	}
	if *idleExit > 0 && *listenFD < 0 {
		return fmt.Errorf("--idle-exit needs --listen-fd: only a socket kept open by opendsec-init survives the exit")
	}
	if (*connFD >= 0 || *readyFD >= 0) && *listenFD < 0 {
		return fmt.Errorf("--conn-fd and --ready-fd need --listen-fd: they come from opendsec-init")
	}
	logger := log.New(log.Options{Level: *logLevel})
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx = log.WithLogger(ctx, logger)

	if *tokenFile != "" {
		b, err := os.ReadFile(*tokenFile)
		if err != nil {
			return fmt.Errorf("read access token: %w", err)
		}
		cfg.AccessToken = strings.TrimSpace(string(b))
	}
	cfg.Init = os.Getpid() == 1
	// Under opendsec-init, orphans of user processes come to the server
	// (it reaps them like PID 1) rather than to init.
	cfg.Subreaper = *listenFD >= 0 && !cfg.Init
	a, err := agent.New(ctx, cfg)
	if err != nil {
		return fmt.Errorf("configure agent: %w", err)
	}
	defer a.Close()

	listenFn := func() (net.Listener, error) { return listenOn(*listen) }
	addr := *listen
	if *listenFD >= 0 {
		addr = "fd " + strconv.Itoa(*listenFD)
		// Init passes the socket without close-on-exec; set it, or every
		// process the agent starts inherits it and could accept the node's
		// requests to the agent.
		syscall.CloseOnExec(*listenFD)
		// Held for the process's life: its finalizer would close the fd.
		f := os.NewFile(uintptr(*listenFD), "listen-fd")
		if f == nil {
			return fmt.Errorf("--listen-fd %d: not an open file descriptor", *listenFD)
		}
		defer f.Close()
		var first net.Conn
		if *connFD >= 0 {
			c, err := inheritedConn(*connFD)
			if err != nil {
				return err
			}
			first = c
		}
		listenFn = func() (net.Listener, error) {
			ln, err := inheritedListener(f)
			if err != nil || first == nil {
				return ln, err
			}
			// Only the first listener serves the connection init took.
			c := first
			first = nil
			return &firstConnListener{Listener: ln, first: c}, nil
		}
	}
	ready := func() {}
	if *readyFD >= 0 {
		syscall.CloseOnExec(*readyFD)
		fd := *readyFD
		ready = func() {
			if fd < 0 {
				return
			}
			_, _ = syscall.Write(fd, []byte{1})
			syscall.Close(fd)
			fd = -1
		}
	}
	logger.Info("agent listening", "addr", addr, "version", version.Version, "pid1", cfg.Init, "subreaper", cfg.Subreaper, "idle_exit", *idleExit)
	for {
		again, err := serve(ctx, a, listenFn, ready, *idleExit)
		if err != nil || !again {
			return err
		}
	}
}

// drainTimeout bounds the wait for requests in flight at an idle exit or
// shutdown.
const drainTimeout = 5 * time.Second

// serve serves a until ctx ends (false) or, with idleExit, until a has been
// idle that long. Then it stops accepting (the inherited socket stays open,
// so new connections wait in its queue), lets requests in flight finish
// and, if the agent is still idle, returns false to exit; if something
// started meanwhile it returns true to serve again.
// ready is called once the listener is up, just before serving.
func serve(ctx context.Context, a *agent.Agent, listen func() (net.Listener, error), ready func(), idleExit time.Duration) (again bool, err error) {
	ln, err := listen()
	if err != nil {
		return false, err
	}
	ready()
	srv := &http.Server{
		Handler:           a.Handler(),
		ReadHeaderTimeout: 30 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	var idle chan error
	ictx, icancel := context.WithCancel(ctx)
	defer icancel()
	if idleExit > 0 {
		idle = make(chan error, 1)
		go func() { idle <- a.WaitIdle(ictx, idleExit) }()
	}
	logger := log.G(ctx)
	select {
	case err := <-errc:
		return false, fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
		logger.Info("agent shutting down")
	case <-idle:
		// Nil unless ctx ended, which Shutdown below handles the same way.
		logger.Debug("agent idle: stopping", "after", idleExit)
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), drainTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return false, fmt.Errorf("shut down: %w", err)
	}
	if ctx.Err() != nil {
		return false, nil
	}
	if why := a.Busy(); why != "" {
		logger.Debug("agent busy again: serving", "why", why)
		return true, nil
	}
	logger.Info("agent idle: exiting", "after", idleExit)
	return false, nil
}

// inheritedListener serves on a dup of the listening socket fd. Closing the
// listener closes only the dup: fd stays open (and the socket file stays)
// for the next server opendsec-init starts.
func inheritedListener(f *os.File) (net.Listener, error) {
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("--listen-fd: not a listening socket: %w", err)
	}
	return ln, nil
}

// inheritedConn takes the connection init accepted (fd), leaving a
// close-on-exec dup of it in Go's poller.
func inheritedConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "conn-fd")
	if f == nil {
		return nil, fmt.Errorf("--conn-fd %d: not an open file descriptor", fd)
	}
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("--conn-fd %d: not a connected socket: %w", fd, err)
	}
	return c, nil
}

// firstConnListener returns first from its first Accept, then accepts
// from the socket.
type firstConnListener struct {
	net.Listener
	mu    sync.Mutex
	first net.Conn
}

func (l *firstConnListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	c := l.first
	l.first = nil
	l.mu.Unlock()
	if c != nil {
		return c, nil
	}
	return l.Listener.Accept()
}

// Close also closes a first connection never accepted.
func (l *firstConnListener) Close() error {
	l.mu.Lock()
	c := l.first
	l.first = nil
	l.mu.Unlock()
	if c != nil {
		c.Close()
	}
	return l.Listener.Close()
}

// listenOn listens on a unix socket path (removing a stale socket file) or
// on tcp:HOST:PORT.
func listenOn(addr string) (net.Listener, error) {
	if hp, ok := strings.CutPrefix(addr, "tcp:"); ok {
		ln, err := net.Listen("tcp", hp)
		if err != nil {
			return nil, fmt.Errorf("listen on %s: %w", hp, err)
		}
		return ln, nil
	}
	if err := os.MkdirAll(filepath.Dir(addr), 0o755); err != nil {
		return nil, fmt.Errorf("make socket directory: %w", err)
	}
	if st, err := os.Lstat(addr); err == nil {
		if st.Mode()&fs.ModeSocket == 0 {
			return nil, fmt.Errorf("listen: %s exists and is not a socket; remove it or pick another --listen", addr)
		}
		if err := os.Remove(addr); err != nil {
			return nil, fmt.Errorf("remove stale socket: %w", err)
		}
	}
	ln, err := net.Listen("unix", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	return ln, nil
}

// proxyStdio connects to addr (tcp:HOST:PORT) and copies stdin to it and
// its replies to stdout until the agent closes the connection.
func proxyStdio(addr string) error {
	hostPort, ok := strings.CutPrefix(addr, "tcp:")
	if !ok {
		return fmt.Errorf("--dial: %q must be tcp:HOST:PORT", addr)
	}
	c, err := net.Dial("tcp", hostPort)
	if err != nil {
		return fmt.Errorf("dial agent: %w", err)
	}
	defer c.Close()
	go func() {
		_, _ = io.Copy(c, os.Stdin)
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	}()
	_, err = io.Copy(os.Stdout, c)
	return err
}

// loadEnvFile sets the KEY=VALUE lines of path in the environment; a
// missing file sets nothing.
func loadEnvFile(path string) error {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("--env-file: %w", err)
	}
	for i, l := range strings.Split(string(b), "\n") {
		if l == "" {
			continue
		}
		k, v, ok := strings.Cut(l, "=")
		if !ok || k == "" {
			return fmt.Errorf("--env-file %s: line %d %q is not KEY=VALUE", path, i+1, l)
		}
		if err := os.Setenv(k, v); err != nil {
			return fmt.Errorf("--env-file %s: set %s: %w", path, k, err)
		}
	}
	return nil
}
