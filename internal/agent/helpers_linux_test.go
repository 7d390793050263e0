package agent

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/filesystem/filesystemconnect"
	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/testutil"
)

// env is an agent served on a temp unix socket with SDK-like clients.
type env struct {
	agent *Agent
	sock  string
	http  *http.Client
	proc  processconnect.ProcessClient
	fs    filesystemconnect.FilesystemClient
}

const base = "http://agent"

func newEnv(t *testing.T, cfg Config) *env { return newEnvTB(t, cfg) }

func newEnvB(b *testing.B) *env { return newEnvTB(b, Config{}) }

func newEnvTB(t testing.TB, cfg Config) *env {
	t.Helper()
	// The agent acts as root in its sandbox: it starts processes as the
	// request's user (root by default) and chowns files to them.
	testutil.RequiresRoot(t)
	dir, err := os.MkdirTemp("", "ag")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "a.sock")
	a, err := New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: a.Handler()}
	go srv.Serve(ln)
	t.Cleanup(func() {
		a.Close()
		srv.Close()
	})
	hc := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
		DisableCompression: true,
	}}
	return &env{
		agent: a,
		sock:  sock,
		http:  hc,
		proc:  processconnect.NewProcessClient(hc, base, connect.WithProtoJSON()),
		fs:    filesystemconnect.NewFilesystemClient(hc, base, connect.WithProtoJSON()),
	}
}

// result is everything one process stream delivered.
type result struct {
	pid            uint32
	stdout, stderr bytes.Buffer
	pty            bytes.Buffer
	keepalives     int
	end            *process.ProcessEvent_EndEvent
	first          string // kind of the first event
}

type eventer interface{ GetEvent() *process.ProcessEvent }

// collect reads a Start or Connect stream to its end.
func collect[T any, PT interface {
	*T
	eventer
}](t *testing.T, s *connect.ServerStreamForClient[T]) *result {
	t.Helper()
	r := &result{}
	for s.Receive() {
		r.add(PT(s.Msg()).GetEvent())
	}
	if err := s.Err(); err != nil {
		t.Fatalf("stream: %v", err)
	}
	if r.first != "start" {
		t.Fatalf("first event is %q, want start", r.first)
	}
	if r.end == nil {
		t.Fatal("stream ended without an end event")
	}
	return r
}

func (r *result) add(ev *process.ProcessEvent) {
	kind := ""
	switch e := ev.GetEvent().(type) {
	case *process.ProcessEvent_Start:
		kind = "start"
		r.pid = e.Start.GetPid()
	case *process.ProcessEvent_Data:
		kind = "data"
		r.stdout.Write(e.Data.GetStdout())
		r.stderr.Write(e.Data.GetStderr())
		r.pty.Write(e.Data.GetPty())
	case *process.ProcessEvent_End:
		kind = "end"
		r.end = e.End
	case *process.ProcessEvent_Keepalive:
		kind = "keepalive"
		r.keepalives++
	}
	if r.first == "" {
		r.first = kind
	}
}

func startReq(cmd string, args ...string) *connect.Request[process.StartRequest] {
	f := false
	return connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: cmd, Args: args},
		Stdin:   &f,
	})
}

// run starts sh -c script and collects it.
func (e *env) run(t *testing.T, script string) *result {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	s, err := e.proc.Start(ctx, startReq("/bin/sh", "-c", script))
	if err != nil {
		t.Fatal(err)
	}
	return collect(t, s)
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func pid(n uint32) *process.ProcessSelector {
	return &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: n}}
}
