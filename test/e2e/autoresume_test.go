//go:build linux

package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// nodeMetric reads one unlabelled metric from the node's /metrics.
func (s *system) nodeMetric(t *testing.T, name string) float64 {
	t.Helper()
	v, err := s.readNodeMetric(name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// tryNodeMetric is nodeMetric for a node that may not answer: ok is false
// when it does not (or has no such metric).
func (s *system) tryNodeMetric(name string) (float64, bool) {
	v, err := s.readNodeMetric(name)
	return v, err == nil
}

func (s *system) readNodeMetric(name string) (float64, error) {
	b, err := os.ReadFile(s.ConfigPath())
	if err != nil {
		return 0, err
	}
	var cfg struct {
		Node struct {
			Listen string `json:"listen"`
		} `json:"node"`
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		return 0, err
	}
	resp, err := http.Get("http://" + cfg.Node.Listen + "/metrics")
	if err != nil {
		return 0, fmt.Errorf("node metrics: %w", err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return 0, fmt.Errorf("%s: %q", name, v)
			}
			return f, nil
		}
	}
	return 0, fmt.Errorf("no %s in the node's metrics", name)
}

func (s *system) pause(t *testing.T, id string) {
	t.Helper()
	if _, err := s.Sandboxes().PauseSandbox(t.Context(), connect.NewRequest(&opendsecv1.PauseSandboxRequest{Id: id})); err != nil {
		t.Fatalf("pause %s: %v", id, err)
	}
	if st := s.state(t, id); st != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("%s is %s after the pause", id, st)
	}
}

func (s *system) mustRunning(t *testing.T, id, after string) {
	t.Helper()
	if st := s.state(t, id); st != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("%s is %s after %s, want running (auto-resumed)", id, st, after)
	}
}

// TestAutoResumeOnCalls: a paused sandbox answers exec, a file read, an
// HTTP request into a port it serves and a ConnectPort without an explicit
// resume; each call resumes it, its processes carry on from where they
// were, and the node counts the resumes. Twenty calls at once into a
// paused sandbox resume it once.
func TestAutoResumeOnCalls(t *testing.T) {
	s := newSystem(t)
	s.Start()
	sb := s.create(t, &opendsecv1.SandboxSpec{TimeoutSeconds: 600})
	id := sb.GetId()
	s.shell(t, id, "mkdir -p /tmp/www && echo hello-paused > /tmp/www/index.html && echo kept > /tmp/f && httpd -p 0.0.0.0:8000 -h /tmp/www")
	s.shell(t, id, counterLoop)
	before := s.counterAtLeast(t, id, 1)
	base := s.nodeMetric(t, "opendsec_node_auto_resumes_total")

	// exec (run_shell)
	s.pause(t, id)
	if r := s.shell(t, id, "echo ok"); r.stdout != "ok\n" {
		t.Fatalf("exec in a paused sandbox: %q %q", r.stdout, r.stderr)
	}
	s.mustRunning(t, id, "an exec")
	if after := s.counter(t, id); after < before || after-before > 25 {
		t.Fatalf("counter went %d -> %d across pause and auto-resume: want it kept and not run while paused", before, after)
	}

	// a file read
	s.pause(t, id)
	c := s.client(t)
	var buf bytes.Buffer
	if _, err := c.ReadFile(t.Context(), id, "/tmp/f", &buf); err != nil || buf.String() != "kept\n" {
		t.Fatalf("file read from a paused sandbox: %q %v", buf.String(), err)
	}
	s.mustRunning(t, id, "a file read")

	// an HTTP request into a port the sandbox serves
	s.pause(t, id)
	resp, err := s.ports().HTTPRequest(t.Context(), connect.NewRequest(&opendsecv1.HTTPRequestRequest{SandboxId: id, Port: 8000, Path: "/index.html"}))
	if err != nil || resp.Msg.GetStatus() != 200 || string(resp.Msg.GetBody()) != "hello-paused\n" {
		t.Fatalf("HTTPRequest into a paused sandbox: %v %v", resp, err)
	}
	s.mustRunning(t, id, "an HTTP request")

	// a raw ConnectPort
	s.pause(t, id)
	pc, err := c.ConnectPort(t.Context(), id, 8000)
	if err != nil {
		t.Fatalf("ConnectPort into a paused sandbox: %v", err)
	}
	fmt.Fprint(pc, "GET /index.html HTTP/1.0\r\n\r\n")
	pc.CloseWrite()
	raw, err := io.ReadAll(pc)
	pc.Close()
	if err != nil || !bytes.HasSuffix(raw, []byte("\r\n\r\nhello-paused\n")) {
		t.Fatalf("ConnectPort into a paused sandbox: %q %v", raw, err)
	}
	s.mustRunning(t, id, "a ConnectPort")
	if got := s.nodeMetric(t, "opendsec_node_auto_resumes_total") - base; got != 4 {
		t.Fatalf("opendsec_node_auto_resumes_total grew by %v over four calls into a paused sandbox, want 4", got)
	}

	// Twenty at once: one resume.
	s.pause(t, id)
	var wg sync.WaitGroup
	errs := make([]error, 20)
	for i := range errs {
		wg.Go(func() {
			r, err := c.RunShell(t.Context(), id, "echo "+strconv.Itoa(i))
			if err == nil && r.Stdout != strconv.Itoa(i)+"\n" {
				err = fmt.Errorf("stdout %q", r.Stdout)
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("concurrent call %d into a paused sandbox: %v", i, err)
		}
	}
	if got := s.nodeMetric(t, "opendsec_node_auto_resumes_total") - base; got != 5 {
		t.Fatalf("twenty calls at once into a paused sandbox: %v auto-resumes in all, want 5 (one for the twenty)", got)
	}
	s.counterAtLeast(t, id, s.counter(t, id)+5) // it runs again
}

// TestOnTimeoutPauseThenCallResumes: on_timeout "pause" pauses the sandbox
// at its lifetime's end; a later exec resumes it with a fresh lifetime,
// files kept. A set_timeout while paused sets the lifetime it resumes with.
func TestOnTimeoutPauseThenCallResumes(t *testing.T) {
	s := newSystem(t)
	s.Start()
	sb := s.create(t, &opendsecv1.SandboxSpec{TimeoutSeconds: 1, OnTimeout: "pause"})
	if got := sb.GetSpec().GetOnTimeout(); got != "pause" || !sb.GetSpec().GetAutoPause() {
		t.Fatalf("spec after create: on_timeout %q auto_pause %v", got, sb.GetSpec().GetAutoPause())
	}
	s.shell(t, sb.GetId(), "echo kept > /f")
	deadline := time.Now().Add(15 * time.Second)
	for s.state(t, sb.GetId()) != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		if time.Now().After(deadline) {
			t.Fatalf("on_timeout pause: not paused 15 s after a 1 s lifetime")
		}
		time.Sleep(50 * time.Millisecond) // polling a condition with a deadline
	}
	c := s.client(t)
	if _, err := c.SetTimeout(t.Context(), sb.GetId(), 120*time.Second); err != nil {
		t.Fatalf("set_timeout on a paused sandbox: %v", err)
	}
	if st := s.state(t, sb.GetId()); st != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("set_timeout changed the state to %s", st)
	}
	if r := s.shell(t, sb.GetId(), "cat /f"); r.stdout != "kept\n" {
		t.Fatalf("after on_timeout pause and an auto-resume: %q", r.stdout)
	}
	got, err := c.GetSandbox(t.Context(), sb.GetId())
	if err != nil {
		t.Fatal(err)
	}
	if left := time.Until(got.GetExpiresAt().AsTime()); got.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING || left < 100*time.Second || left > 121*time.Second {
		t.Fatalf("after the auto-resume: %s, lifetime left %s; want running with the 120 s set while paused", got.GetState(), left)
	}
	_, err = c.CreateSandbox(t.Context(), &opendsec.SandboxSpec{Image: "root/busybox", OnTimeout: "stop", AutoPause: true})
	if !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "on_timeout") {
		t.Fatalf("create with on_timeout stop and auto_pause: %v, want invalid argument naming on_timeout", err)
	}
}
