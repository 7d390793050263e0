package node

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// agentGet sends GET /agent/<id>/<sub> through the node's agent proxy and
// returns the status and body. A paused fake agent holds requests, so a
// call that did not resume the sandbox runs into the client's timeout.
func agentGet(t *testing.T, srv *httptest.Server, id, sub string) (int, string) {
	t.Helper()
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(srv.URL + AgentPrefix + id + "/" + sub)
	if err != nil {
		t.Errorf("GET %s of %s: %v", sub, id, err)
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func autoResumes(n *Node) float64 { return promtest.ToFloat64(n.metrics.autoResumes) }

// Twenty calls into a paused sandbox at once resume it exactly once: they
// all wait on the same resume, the backend resumes once, the metric says 1,
// and every call is answered.
func TestAutoResumeConcurrentCallsResumeOnce(t *testing.T) {
	f := newFakeNode(t)
	rec := f.create(t, specRecord{TimeoutSec: 600})
	if err := runtimeWrite(t, f, rec.ID, "/data", "kept"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	f.rt.Hook(runtimefake.OpResume, func(ctx context.Context, _ string) error {
		<-release
		return nil
	})
	srv := httptest.NewServer(f.AgentProxy())
	defer srv.Close()
	const callers = 20
	codes := make([]int, callers)
	bodies := make([]string, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			sub := "health"
			if i%2 == 1 {
				sub = "files?path=/data"
			}
			codes[i], bodies[i] = agentGet(t, srv, rec.ID, sub)
		})
	}
	// Hold the resume until every caller waits on it.
	sb, _ := f.get(rec.ID)
	waitResumeWaiters(t, f.Node, sb, callers, func() { close(release); wg.Wait() })
	close(release)
	wg.Wait()
	for i := range callers {
		want := http.StatusNoContent
		if i%2 == 1 {
			want = http.StatusOK
		}
		if codes[i] != want || (i%2 == 1 && bodies[i] != "kept") {
			t.Fatalf("call %d into the paused sandbox: %d %q, want %d", i, codes[i], bodies[i], want)
		}
	}
	if got := f.rt.Calls(runtimefake.OpResume); got != 1 {
		t.Fatalf("backend resumed %d times, want 1", got)
	}
	if got := autoResumes(f.Node); got != 1 {
		t.Fatalf("opendsec_node_auto_resumes_total = %v, want 1", got)
	}
	if got := stateOf(t, f.Node, rec.ID); got != stateRunning {
		t.Fatalf("state after the calls = %s, want running", got)
	}
	mustBackendState(t, f.rt, rec.ID, runtime.StateRunning)
	// Recorded: a restart finds it running.
	recs, err := f.table.all()
	if err != nil || len(recs) != 1 || recs[0].State != stateRunning {
		t.Fatalf("table after the auto-resume: %+v %v, want one running record", recs, err)
	}
	// A call into a running sandbox resumes nothing.
	if code, _ := agentGet(t, srv, rec.ID, "health"); code != http.StatusNoContent {
		t.Fatalf("health after resume: %d", code)
	}
	if got := autoResumes(f.Node); got != 1 {
		t.Fatalf("opendsec_node_auto_resumes_total after a call into a running sandbox = %v, want 1", got)
	}
}

func runtimeWrite(t *testing.T, f *fakeNode, id, path, data string) error {
	t.Helper()
	srv := httptest.NewServer(f.AgentProxy())
	defer srv.Close()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+AgentPrefix+id+"/files?path="+path, strings.NewReader(data))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("write %s: status %d", path, resp.StatusCode)
	}
	return nil
}

// The lifetime across an auto-resume: the clock starts again with what was
// left at the pause; a sandbox paused by its timeout (on_timeout "pause")
// gets a fresh full lifetime.
func TestAutoResumeLifetime(t *testing.T) {
	clk := &testClock{}
	f := newFakeNode(t, func(c *Config) { c.Clock = clk.now })
	srv := httptest.NewServer(f.AgentProxy())
	defer srv.Close()

	rec := f.create(t, specRecord{TimeoutSec: 600})
	clk.advance(100 * time.Second)
	if _, err := f.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	clk.advance(1000 * time.Second) // longer than its lifetime
	if code, _ := agentGet(t, srv, rec.ID, "health"); code != http.StatusNoContent {
		t.Fatalf("call into the paused sandbox: %d", code)
	}
	got, _, err := f.Get(t.Context(), rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if left := got.ExpiresAt.Sub(clk.now()); got.State != stateRunning || left > 500*time.Second || left < 499*time.Second {
		t.Fatalf("after auto-resume: state %s, lifetime left %s; want running with the 500s left at the pause", got.State, left)
	}

	timed := f.create(t, specRecord{TimeoutSec: 60, OnTimeout: sandboxspec.OnTimeoutPause})
	clk.advance(61 * time.Second)
	waitState(t, f.Node, timed.ID, statePaused)
	if code, _ := agentGet(t, srv, timed.ID, "health"); code != http.StatusNoContent {
		t.Fatalf("call into the timed-out paused sandbox: %d", code)
	}
	got, _, err = f.Get(t.Context(), timed.ID)
	if err != nil {
		t.Fatal(err)
	}
	if left := got.ExpiresAt.Sub(clk.now()); got.State != stateRunning || left > 60*time.Second || left < 59*time.Second {
		t.Fatalf("after auto-resume of a timed-out sandbox: state %s, lifetime left %s; want running with a fresh 60s", got.State, left)
	}
	if n := autoResumes(f.Node); n != 2 {
		t.Fatalf("opendsec_node_auto_resumes_total = %v, want 2", n)
	}
}

// waitState waits until id is in state want.
// waitResumeWaiters waits until want calls wait on sb's one resume; when
// they do not within 10 s it calls release (so a held resume and its
// callers end) and fails.
func waitResumeWaiters(t *testing.T, n *Node, sb *sandbox, want int, release func()) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n.mu.Lock()
		w := 0
		if sb.resuming != nil {
			w = sb.resuming.waiters
		}
		n.mu.Unlock()
		if w == want {
			return
		}
		if time.Now().After(deadline) {
			release()
			t.Fatalf("%d of %d calls wait on one resume after 10 s", w, want)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
}

func waitState(t *testing.T, n *Node, id, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for stateOf(t, n, id) != want {
		if time.Now().After(deadline) {
			t.Fatalf("%s not %s after 10 s (it is %s)", id, want, stateOf(t, n, id))
		}
		time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
	}
}

// A call that arrives while the sandbox is being paused waits for the pause
// to finish, then resumes it.
func TestAutoResumeWaitsForPauseInProgress(t *testing.T) {
	f := newFakeNode(t)
	rec := f.create(t, specRecord{TimeoutSec: 600})
	entered, release := make(chan struct{}), make(chan struct{})
	f.rt.Hook(runtimefake.OpPause, func(ctx context.Context, _ string) error {
		close(entered)
		<-release
		return nil
	})
	paused := make(chan error, 1)
	go func() {
		_, err := f.Pause(context.Background(), rec.ID)
		paused <- err
	}()
	<-entered
	srv := httptest.NewServer(f.AgentProxy())
	defer srv.Close()
	called := make(chan int, 1)
	go func() {
		code, _ := agentGet(t, srv, rec.ID, "health")
		called <- code
	}()
	// The call waits on a resume, which waits for the pause.
	sb, _ := f.get(rec.ID)
	waitResumeWaiters(t, f.Node, sb, 1, func() { close(release) })
	close(release)
	if err := <-paused; err != nil {
		t.Fatalf("pause: %v", err)
	}
	if code := <-called; code != http.StatusNoContent {
		t.Fatalf("call during the pause: %d, want 204 after the resume", code)
	}
	if got := stateOf(t, f.Node, rec.ID); got != stateRunning {
		t.Fatalf("state = %s, want running (paused, then resumed by the call)", got)
	}
	if p, r := f.rt.Calls(runtimefake.OpPause), f.rt.Calls(runtimefake.OpResume); p != 1 || r != 1 {
		t.Fatalf("backend paused %d and resumed %d times, want 1 and 1", p, r)
	}
}

// A sandbox paused longer than max_paused is not resumed by a call: it is
// due to be stopped. A call into a stopped one finds nothing.
func TestAutoResumeRefusedPastMaxPaused(t *testing.T) {
	clk := &testClock{}
	f := newFakeNode(t, func(c *Config) {
		c.Clock = clk.now
		c.MaxPaused = time.Hour
		c.ReapInterval = time.Hour // the reaper does not get to it first
	})
	srv := httptest.NewServer(f.AgentProxy())
	defer srv.Close()
	rec := f.create(t, specRecord{TimeoutSec: 600})
	if _, err := f.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	clk.advance(61 * time.Minute)
	code, body := agentGet(t, srv, rec.ID, "health")
	if code != errdefs.HTTPStatus(errdefs.ErrNotFound) || !strings.Contains(body, "max_paused") {
		t.Fatalf("call into a sandbox paused past max_paused: %d %s, want 404 naming max_paused", code, body)
	}
	if got := stateOf(t, f.Node, rec.ID); got != statePaused {
		t.Fatalf("state = %s, want still paused (for the reaper to stop)", got)
	}
	if n := f.rt.Calls(runtimefake.OpResume); n != 0 || autoResumes(f.Node) != 0 {
		t.Fatalf("backend resumed %d times, metric %v; want none", n, autoResumes(f.Node))
	}
	if err := f.Stop(t.Context(), rec.ID, "max_paused"); err != nil {
		t.Fatal(err)
	}
	if code, _ := agentGet(t, srv, rec.ID, "health"); code != http.StatusNotFound {
		t.Fatalf("call into the stopped sandbox: %d, want 404", code)
	}
}

// A resume that fails in the backend fails the call with the reason and
// leaves the sandbox paused; the next call tries again.
func TestAutoResumeFailureReported(t *testing.T) {
	f := newFakeNode(t)
	srv := httptest.NewServer(f.AgentProxy())
	defer srv.Close()
	rec := f.create(t, specRecord{TimeoutSec: 600})
	if _, err := f.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	f.rt.Hook(runtimefake.OpResume, func(context.Context, string) error {
		return errdefs.New(errdefs.ErrUnavailable, "thaw refused")
	})
	code, body := agentGet(t, srv, rec.ID, "health")
	if code != errdefs.HTTPStatus(errdefs.ErrUnavailable) || !strings.Contains(body, "thaw refused") {
		t.Fatalf("call with a failing resume: %d %s", code, body)
	}
	if got := stateOf(t, f.Node, rec.ID); got != statePaused {
		t.Fatalf("state after a failed auto-resume = %s, want paused", got)
	}
	f.rt.Hook(runtimefake.OpResume, nil)
	if code, _ := agentGet(t, srv, rec.ID, "health"); code != http.StatusNoContent {
		t.Fatalf("call after the backend recovered: %d", code)
	}
	if autoResumes(f.Node) != 1 {
		t.Fatalf("metric = %v, want 1 (only the resume that happened)", autoResumes(f.Node))
	}
}

// A call with NoAutoResumeHeader into a paused sandbox is refused (failed
// precondition, the header in the answer) and leaves it paused; the same
// call without it resumes the sandbox. The header is the one nodeclient
// sends.
func TestAutoResumeRefusedOnRequest(t *testing.T) {
	if NoAutoResumeHeader != nodeclient.NoAutoResumeHeader {
		t.Fatalf("node.NoAutoResumeHeader %q != nodeclient.NoAutoResumeHeader %q", NoAutoResumeHeader, nodeclient.NoAutoResumeHeader)
	}
	f := newFakeNode(t)
	srv := httptest.NewServer(f.AgentProxy())
	defer srv.Close()
	rec := f.create(t, specRecord{TimeoutSec: 600})
	if _, err := f.Pause(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, srv.URL+AgentPrefix+rec.ID+"/health", nil)
	req.Header.Set(NoAutoResumeHeader, "1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != errdefs.HTTPStatus(errdefs.ErrFailedPrecondition) || resp.Header.Get(NoAutoResumeHeader) == "" ||
		!strings.Contains(string(b), "failed_precondition") {
		t.Fatalf("call asking not to resume: %d %v %s; want failed precondition with the header", resp.StatusCode, resp.Header, b)
	}
	if got := stateOf(t, f.Node, rec.ID); got != statePaused || f.rt.Calls(runtimefake.OpResume) != 0 {
		t.Fatalf("state %s after %d backend resumes, want paused and none", got, f.rt.Calls(runtimefake.OpResume))
	}
	if code, _ := agentGet(t, srv, rec.ID, "health"); code != http.StatusOK && code != http.StatusNoContent {
		t.Fatalf("call without the header: %d, want it resumed and answered", code)
	}
	if got := stateOf(t, f.Node, rec.ID); got != stateRunning {
		t.Fatalf("state %s after a call without the header, want running", got)
	}
}
