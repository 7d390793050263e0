package agent

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/api/gen/filesystem/filesystemconnect"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/httphdr"
	"github.com/kernflux/opendsec/internal/log"
)

// Agent serves one sandbox. Build it with New, serve Handler, Close it on
// shutdown.
type Agent struct {
	cfg   Config
	users users
	procs *processes
	fs    *filesystem
	h     http.Handler
	idle  *idleTrimmer // nil when disabled
	ci    *codeInterpreter
	act   *activity // requests in flight, for idle exit
	// tunnelIdle bounds a half-closed tunnel's silence (defaultTunnelIdle;
	// tests shorten it before serving).
	tunnelIdle time.Duration
	// tunnels counts the port tunnels being served.
	tunnels atomic.Int64
}

// New returns an agent for cfg. With cfg.Init it also takes on PID 1's
// duties: it reaps every child of this process and brings up loopback.
// cfg.Subreaper makes this process a child subreaper first, so orphans of
// the processes it starts are reparented to it, and implies cfg.Init.
func New(ctx context.Context, cfg Config) (*Agent, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Subreaper {
		if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
			return nil, fmt.Errorf("become child subreaper: %w", err)
		}
		cfg.Init = true
	}
	if cfg.Env == nil {
		cfg.Env = os.Environ()
	}
	a := &Agent{cfg: cfg, users: users{dir: cfg.EtcDir}, tunnelIdle: defaultTunnelIdle}
	a.procs = newProcesses(&a.cfg)
	a.fs = newFilesystem(&a.cfg)
	a.ci = &codeInterpreter{a: a}
	if cfg.Init {
		theReaper.reapAll()
		if err := loopbackUp(); err != nil {
			log.G(ctx).Warn("bring up loopback", log.Err(err))
		}
		_ = os.WriteFile("/proc/self/oom_score_adj", []byte("-1000"), 0)
	}
	a.h = a.routes()
	if cfg.IdleTrimAfter > 0 {
		a.idle = newIdleTrimmer(cfg.IdleTrimAfter, freeOSMemory)
		a.h = a.idle.wrap(a.h)
	}
	a.act = &activity{}
	a.h = a.act.wrap(a.h)
	return a, nil
}

// Handler serves the envd protocol and the agent's own routes.
func (a *Agent) Handler() http.Handler { return a.h }

// Close sends SIGKILL to every process the agent started.
func (a *Agent) Close() error {
	a.procs.signalAll(unix.SIGKILL)
	a.fs.closeWatchers()
	a.ci.stop()
	if a.idle != nil {
		a.idle.stop()
	}
	return nil
}

func (a *Agent) routes() http.Handler {
	mux := http.NewServeMux()
	// Process output is never compressed: flow control counts bytes on the
	// wire, and `yes` compresses 300-fold, so compressed output let the
	// transport windows between here and a slow reader hold hundreds of MiB
	// that neither held the process back nor could be skipped: the exit
	// waited behind all of it (issue 11). Requests may still be gzip.
	mux.Handle(processconnect.NewProcessHandler(a.procs, connect.WithCompressMinBytes(math.MaxInt)))
	mux.Handle(filesystemconnect.NewFilesystemHandler(a.fs, connect.WithCompressMinBytes(1024)))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("GET /envs", a.serveEnvs)
	mux.HandleFunc("GET /files", a.serveDownload)
	mux.HandleFunc("POST /files", a.serveUpload)
	mux.HandleFunc("GET /_opendsec/port/{port}", a.serveTunnel)
	return a.withAuth(withCORS(mux))
}

func withCORS(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Access-Control-Allow-Origin", "*")
		if r.Method == http.MethodOptions {
			w.Header().Set("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
			w.Header().Set("Access-Control-Allow-Headers", "*")
			w.Header().Set("Access-Control-Expose-Headers", "*")
			w.Header().Set("Access-Control-Max-Age", "7200")
			w.WriteHeader(http.StatusNoContent)
			return
		}
		next.ServeHTTP(w, r)
	})
}

const unauthorizedMsg = "unauthorized access, please provide a valid access token or method signing if supported"

// withAuth requires X-Access-Token when the agent has a token, except on
// /health and /files (which also accept a URL signature, checked there).
func (a *Agent) withAuth(next http.Handler) http.Handler {
	if a.cfg.AccessToken == "" {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" || r.URL.Path == "/files" || r.Method == http.MethodOptions {
			next.ServeHTTP(w, r)
			return
		}
		if !a.tokenOK(r.Header.Get("X-Access-Token")) {
			writeError(w, http.StatusUnauthorized, unauthorizedMsg)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (a *Agent) tokenOK(got string) bool {
	return subtle.ConstantTimeCompare([]byte(got), []byte(a.cfg.AccessToken)) == 1
}

// writeError writes envd's HTTP error body {"code":N,"message":"…"}.
func writeError(w http.ResponseWriter, status int, msg string) {
	b, _ := json.Marshal(struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}{status, msg})
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	w.Write(b)
}

// writeErr maps a categorized error to its HTTP status.
func writeErr(w http.ResponseWriter, err error) {
	writeError(w, errdefs.HTTPStatus(err), err.Error())
}

func (a *Agent) serveEnvs(w http.ResponseWriter, r *http.Request) {
	m := map[string]string{}
	for _, kv := range a.cfg.Env {
		for i := 0; i < len(kv); i++ {
			if kv[i] == '=' {
				m[kv[:i]] = kv[i+1:]
				break
			}
		}
	}
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(m)
}

// serveTunnel connects the caller to a TCP port inside the sandbox:
// GET /_opendsec/port/{port} with Upgrade: tcp → 101, then raw bytes.
func (a *Agent) serveTunnel(w http.ResponseWriter, r *http.Request) {
	port, err := strconv.Atoi(r.PathValue("port"))
	if err != nil || port < 1 || port > 65535 {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("port: %q is not a port number; use 1..65535", r.PathValue("port")))
		return
	}
	if !httphdr.HasToken(r.Header, "Connection", "upgrade") || !httphdr.HasToken(r.Header, "Upgrade", "tcp") {
		writeError(w, http.StatusBadRequest, "upgrade: send Connection: Upgrade and Upgrade: tcp")
		return
	}
	var d net.Dialer
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	var up net.Conn
	if port == a.cfg.InterpreterPort {
		// The code interpreter starts on demand.
		dctx, cancel := context.WithTimeout(r.Context(), interpreterStartTimeout)
		defer cancel()
		if up, err = a.ci.dial(dctx, addr); err != nil && errors.Is(err, errdefs.ErrUnavailable) {
			writeErr(w, err)
			return
		}
	} else {
		dctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
		defer cancel()
		up, err = d.DialContext(dctx, "tcp", addr)
	}
	if err != nil {
		msg := fmt.Sprintf("port %d is not open in the sandbox", port)
		if errors.Is(err, unix.ECONNREFUSED) {
			msg = fmt.Sprintf("connection refused in sandbox: port %d is not open (nothing listens on 127.0.0.1:%d or 0.0.0.0:%d)", port, port, port)
		}
		writeError(w, http.StatusBadGateway, msg)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		up.Close()
		writeError(w, http.StatusInternalServerError, "hijack connection: "+err.Error())
		return
	}
	_, err = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: tcp\r\nConnection: Upgrade\r\n\r\n")
	if err == nil {
		err = brw.Flush()
	}
	if err != nil {
		conn.Close()
		up.Close()
		return
	}
	// Bytes the client sent after its request may sit in brw's reader.
	var down io.Reader = conn
	if n := brw.Reader.Buffered(); n > 0 {
		buffered, _ := brw.Reader.Peek(n)
		down = io.MultiReader(bytesReader(buffered), conn)
	}
	a.tunnels.Add(1)
	defer a.tunnels.Add(-1)
	splice(conn, up, down, a.tunnelIdle)
}

// loopbackUp sets IFF_UP on lo (a fresh network namespace has it down).
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open socket: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return fmt.Errorf("ifreq lo: %w", err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get lo flags: %w", err)
	}
	flags := ifr.Uint16()
	if flags&unix.IFF_UP != 0 {
		return nil
	}
	ifr.SetUint16(flags | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}
