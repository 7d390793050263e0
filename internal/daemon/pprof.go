package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/kernflux/opendsec/internal/log"
)

// startPprof serves Go's profiles at http://<addr>/debug/pprof/ until ctx
// ends, when addr (debug.pprof_listen, loopback only: config.Validate) is
// set; it returns the address it listens on ("" when off). Its own mux:
// nothing of the daemons serves http.DefaultServeMux, where importing
// net/http/pprof registers the same handlers.
func startPprof(ctx context.Context, addr string) (string, error) {
	if addr == "" {
		return "", nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", fmt.Errorf("debug.pprof_listen: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.G(ctx).Warn("profiling endpoint stopped", "listen", addr, "error", err)
		}
	}()
	log.G(ctx).Warn("serving Go profiles without authentication (debug.pprof_listen)", "listen", ln.Addr().String())
	return ln.Addr().String(), nil
}
