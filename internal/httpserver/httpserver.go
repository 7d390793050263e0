// Package httpserver serves OpenDsec's HTTP endpoints: HTTP/1.1 and
// unencrypted HTTP/2 on one listener (so gRPC clients such as grpc.aio work
// without TLS), or HTTP/1.1 and HTTP/2 over TLS (ServeTLS), with graceful
// shutdown when the context ends.
package httpserver

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/log"
)

// Listen listens on addr: host:port, or unix:///path for a unix socket (a
// stale socket file is removed first).
func Listen(addr string) (net.Listener, error) {
	network, address := "tcp", addr
	if p, ok := strings.CutPrefix(addr, "unix://"); ok {
		network, address = "unix", p
		_ = os.Remove(p)
	}
	ln, err := net.Listen(network, address)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	return ln, nil
}

// Serve serves h on ln until ctx ends, then shuts down gracefully (10 s).
// name is used in errors and logs.
func Serve(ctx context.Context, name string, ln net.Listener, h http.Handler) error {
	return serve(ctx, name, ln, h, nil)
}

// ServeTLS is Serve over TLS with cfg: HTTP/2 (negotiated by ALPN) and
// HTTP/1.1. A handler that aborts a response (panics with
// http.ErrAbortHandler, as httputil.ReverseProxy does when its upstream
// breaks mid-body) resets its HTTP/2 stream (RST_STREAM) and leaves the
// connection's other streams alone.
func ServeTLS(ctx context.Context, name string, ln net.Listener, h http.Handler, cfg *tls.Config) error {
	return serve(ctx, name, ln, h, cfg)
}

func serve(ctx context.Context, name string, ln net.Listener, h http.Handler, tlsCfg *tls.Config) error {
	var p http.Protocols
	p.SetHTTP1(true)
	if tlsCfg != nil {
		p.SetHTTP2(true)
	} else {
		p.SetUnencryptedHTTP2(true)
	}
	srv := &http.Server{
		TLSConfig: tlsCfg,
		Handler:   h,
		Protocols: &p,
		// One gRPC channel multiplexes every exec and file stream of a
		// client; the default (100-250) would queue RL workloads.
		HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: 4096},
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return context.WithoutCancel(ctx) },
		ErrorLog:          slog.NewLogLogger(log.G(ctx).Handler(), slog.LevelWarn),
	}
	errc := make(chan error, 1)
	go func() {
		if tlsCfg != nil {
			errc <- srv.ServeTLS(ln, "", "")
			return
		}
		errc <- srv.Serve(ln)
	}()
	select {
	case err := <-errc:
		return fmt.Errorf("serve %s: %w", name, err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		srv.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve %s: %w", name, err)
	}
	return nil
}

// CompressMinBytes is the smallest answer OpenDsec's Connect services
// compress for a caller that accepts it. Most answers are small (a
// sandbox, a status): gzip would cost both ends more CPU than it saves
// bytes; lists of many sandboxes still go compressed.
const CompressMinBytes = 16 << 10
