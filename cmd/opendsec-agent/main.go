// Command opendsec-agent runs inside every sandbox (PID 1 in containers) and
// serves E2B's envd protocol on a unix socket or a TCP address.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kernflux/opendsec/internal/agent"
	"github.com/kernflux/opendsec/internal/log"
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
	// First: nothing the agent starts, nor the agent once it serves
	// requests, may run without the sandbox's filter.
	if *seccompF != "" {
		if err := agent.InstallSeccompFilter(*seccompF); err != nil {
			return err
		}
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
	a, err := agent.New(ctx, cfg)
	if err != nil {
		return fmt.Errorf("configure agent: %w", err)
	}
	defer a.Close()

	ln, err := listenOn(*listen)
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler:           a.Handler(),
		ReadHeaderTimeout: 30 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	logger.Info("agent listening", "addr", *listen, "version", version.Version, "pid1", cfg.Init)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	logger.Info("agent shutting down")
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("shut down: %w", err)
	}
	return nil
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
