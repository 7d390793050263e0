package node

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/interpreter"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// fakeInterp is the code interpreter behind the agent's tunnel to
// interpreter.Port: POST /execute answers NDJSON lines, flushed one by
// one (code "steps" waits for step before each of its lines after the
// first), GET /contexts a JSON list.
type fakeInterp struct {
	mu      sync.Mutex
	execs   []string
	tunnels int
	step    chan struct{}
	conns   chan net.Conn
	closed  chan struct{}
}

func newFakeInterp(t *testing.T) *fakeInterp {
	fi := &fakeInterp{step: make(chan struct{}), conns: make(chan net.Conn), closed: make(chan struct{})}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /contexts", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `[{"id": "default", "language": "python"}]`)
	})
	mux.HandleFunc("POST /execute", func(w http.ResponseWriter, r *http.Request) {
		var b struct {
			Code      string `json:"code"`
			ContextID string `json:"context_id"`
		}
		if err := json.NewDecoder(r.Body).Decode(&b); err != nil {
			http.Error(w, "bad json", http.StatusBadRequest)
			return
		}
		if b.ContextID == "nope" {
			http.Error(w, "Context nope not found", http.StatusNotFound)
			return
		}
		fi.mu.Lock()
		fi.execs = append(fi.execs, b.Code)
		k := len(fi.execs)
		fi.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-ndjson")
		emit := func(s string) {
			io.WriteString(w, s+"\n")
			w.(http.Flusher).Flush()
		}
		emit(fmt.Sprintf(`{"type": "number_of_executions", "execution_count": %d}`, k))
		switch b.Code {
		case "1/0":
			emit(`{"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "Traceback"}`)
		case "steps":
			for i := range 3 {
				<-fi.step
				emit(fmt.Sprintf(`{"type": "stdout", "text": "line %d\n"}`, i))
			}
		default:
			emit(`{"type": "stdout", "text": "42\n"}`)
		}
		emit(`{"type": "end_of_execution"}`)
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(chanListener{fi.conns, fi.closed})
	t.Cleanup(func() {
		close(fi.closed)
		srv.Close()
	})
	return fi
}

// serveTunnel is the agent's GET /_opendsec/port/{port}: only the
// interpreter's port is open.
func (fi *fakeInterp) serveTunnel(w http.ResponseWriter, r *http.Request) {
	if r.PathValue("port") != fmt.Sprint(interpreter.Port) {
		http.Error(w, `{"code":502,"message":"port not open"}`, http.StatusBadGateway)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: tcp\r\nConnection: Upgrade\r\n\r\n")
	brw.Flush()
	fi.mu.Lock()
	fi.tunnels++
	fi.mu.Unlock()
	select {
	case fi.conns <- conn:
	case <-fi.closed:
		conn.Close()
	}
}

func (fi *fakeInterp) executions() []string {
	fi.mu.Lock()
	defer fi.mu.Unlock()
	return append([]string(nil), fi.execs...)
}

// codeTunnel opens a tunnel to the interpreter's port through the node, as
// nodeclient.DialPort does.
func (f *trajFixture) codeTunnel(t *testing.T, id string, port int) (net.Conn, *bufio.Reader, *http.Response) {
	t.Helper()
	conn, err := net.Dial("tcp", f.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	fmt.Fprintf(conn, "GET %s%s/_opendsec/port/%d HTTP/1.1\r\nHost: node\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n", AgentPrefix, id, port)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	return conn, br, resp
}

func executeReq(t *testing.T, code, callID string, extra map[string]any) *http.Request {
	t.Helper()
	body := map[string]any{"code": code}
	for k, v := range extra {
		body[k] = v
	}
	b, _ := json.Marshal(body)
	req, err := http.NewRequest(http.MethodPost, "http://localhost:49999/execute", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if callID != "" {
		req.Header.Set(CallIDHeader, callID)
	}
	return req
}

func roundTrip(t *testing.T, conn net.Conn, br *bufio.Reader, req *http.Request) *http.Response {
	t.Helper()
	if err := req.Write(conn); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return string(b)
}

// TestTrajectoryLogsCodeCalls: POST /execute through a tunnel to the
// interpreter's port is a "code" call, its lines streamed to the caller as
// they come and recorded in order; a repeated call ID is replayed from the
// log without running, with another request refused naming both; other
// requests pass through unlogged; one tunnel carries them all (keep-alive).
func TestTrajectoryLogsCodeCalls(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	fi := f.agent.interp

	conn, br, up := f.codeTunnel(t, id, interpreter.Port)
	if up.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("tunnel: %s", up.Status)
	}

	// Streamed: each line reaches the caller before the next is made.
	resp := roundTrip(t, conn, br, executeReq(t, "steps", "c1", map[string]any{"env_vars": map[string]string{"A": "1"}}))
	if resp.StatusCode != http.StatusOK || resp.Header.Get(CallSeqHeader) != "1" || resp.Header.Get(ReplayedHeader) != "" {
		t.Fatalf("execute: %s %v", resp.Status, resp.Header)
	}
	lines := bufio.NewReader(resp.Body)
	var got []string
	next := func() string {
		t.Helper()
		done := make(chan string, 1)
		go func() {
			l, _ := lines.ReadString('\n')
			done <- l
		}()
		select {
		case l := <-done:
			return l
		case <-time.After(5 * time.Second):
			t.Fatal("a line did not arrive: the answer is not streamed")
			return ""
		}
	}
	got = append(got, next())
	for range 3 {
		fi.step <- struct{}{}
		got = append(got, next())
	}
	got = append(got, next())
	if rest, _ := io.ReadAll(lines); len(rest) != 0 {
		t.Fatalf("after the end: %q", rest)
	}
	resp.Body.Close()
	want := `{"type": "number_of_executions", "execution_count": 1}
{"type": "stdout", "text": "line 0\n"}
{"type": "stdout", "text": "line 1\n"}
{"type": "stdout", "text": "line 2\n"}
{"type": "end_of_execution"}
`
	if strings.Join(got, "") != want {
		t.Fatalf("lines:\n%s\nwant\n%s", strings.Join(got, ""), want)
	}

	// Not /execute: through, unlogged, on the same tunnel.
	lr, _ := http.NewRequest(http.MethodGet, "http://localhost:49999/contexts", nil)
	resp = roundTrip(t, conn, br, lr)
	if body := readAll(t, resp); resp.StatusCode != http.StatusOK || !strings.Contains(body, `"default"`) || resp.Header.Get(CallSeqHeader) != "" {
		t.Fatalf("GET /contexts: %s %q", resp.Status, body)
	}

	// Replayed on the same tunnel: the recorded lines, nothing run.
	resp = roundTrip(t, conn, br, executeReq(t, "steps", "c1", map[string]any{"env_vars": map[string]string{"A": "1"}}))
	if body := readAll(t, resp); resp.StatusCode != http.StatusOK || resp.Header.Get(ReplayedHeader) != "true" ||
		resp.Header.Get(CallSeqHeader) != "1" || body != want {
		t.Fatalf("replay: %s %v %q", resp.Status, resp.Header, body)
	}
	// Replayed on a new tunnel too.
	conn2, br2, _ := f.codeTunnel(t, id, interpreter.Port)
	resp = roundTrip(t, conn2, br2, executeReq(t, "steps", "c1", map[string]any{"env_vars": map[string]string{"A": "1"}}))
	if body := readAll(t, resp); resp.Header.Get(ReplayedHeader) != "true" || body != want {
		t.Fatalf("replay on another tunnel: %s %q", resp.Status, body)
	}
	if ex := fi.executions(); len(ex) != 1 {
		t.Fatalf("executions %q; want the first only", ex)
	}

	// Another request under c1: refused, naming both.
	resp = roundTrip(t, conn2, br2, executeReq(t, "print(1)", "c1", nil))
	if body := readAll(t, resp); resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "failed_precondition") ||
		!strings.Contains(body, `\"steps\"`) || !strings.Contains(body, `\"print(1)\"`) {
		t.Fatalf("mismatch: %s %q", resp.Status, body)
	}
	if ex := fi.executions(); len(ex) != 1 {
		t.Fatalf("a refused call ran: %q", ex)
	}

	// An error line is the call's end; a refused execution keeps the
	// interpreter's answer; without a call ID every call runs.
	conn3, br3, _ := f.codeTunnel(t, id, interpreter.Port)
	resp = roundTrip(t, conn3, br3, executeReq(t, "1/0", "c2", nil))
	readAll(t, resp)
	resp = roundTrip(t, conn3, br3, executeReq(t, "x", "c3", map[string]any{"context_id": "nope"}))
	if body := readAll(t, resp); resp.StatusCode != http.StatusNotFound || !strings.Contains(body, "not found") {
		t.Fatalf("refused execution: %s %q", resp.Status, body)
	}
	resp = roundTrip(t, conn3, br3, executeReq(t, "x", "c3", map[string]any{"context_id": "nope"}))
	if body := readAll(t, resp); resp.StatusCode != http.StatusNotFound || resp.Header.Get(ReplayedHeader) != "true" || !strings.Contains(body, "not found") {
		t.Fatalf("replayed refusal: %s %q", resp.Status, body)
	}
	for range 2 {
		readAll(t, roundTrip(t, conn3, br3, executeReq(t, "print(6*7)", "", nil)))
	}
	if ex := fi.executions(); len(ex) != 4 {
		t.Fatalf("executions %q", ex)
	}

	_, calls, err := f.n.Trajectory(t.Context(), id)
	if err != nil || len(calls) != 5 {
		t.Fatalf("log: %d calls, %v", len(calls), err)
	}
	c := calls[0]
	if c.Req.Kind != trajectory.KindCode || c.Req.Code != "steps" || c.Req.Env["A"] != "1" || c.CallID != "c1" ||
		c.State != trajectory.StateDone || c.HTTPStatus != http.StatusOK || c.Status != "ok" || string(codeOutput(c)) != want {
		t.Fatalf("logged call %+v", c)
	}
	if c := calls[1]; c.Status != "error" || c.ExitErr != "ZeroDivisionError: division by zero" {
		t.Fatalf("logged error %+v", c)
	}
	if c := calls[2]; c.HTTPStatus != http.StatusNotFound || c.Req.ContextID != "nope" || len(c.Output) != 0 {
		t.Fatalf("logged refusal %+v", c)
	}
	if c := calls[4]; c.CallID != "" || c.Req.Code != "print(6*7)" || !strings.Contains(string(codeOutput(c)), "42") {
		t.Fatalf("logged call without ID %+v", c)
	}

	// Another port is still the agent's tunnel, its refusal as it gave it.
	_, _, other := f.codeTunnel(t, id, 8080)
	if other.StatusCode != http.StatusBadGateway {
		t.Fatalf("port 8080: %s", other.Status)
	}
}

// TestTrajectoryCodeCallJoined: a call ID still running is joined: the
// caller gets what was recorded, then the rest, and nothing runs again.
func TestTrajectoryCodeCallJoined(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	fi := f.agent.interp

	conn, br, _ := f.codeTunnel(t, id, interpreter.Port)
	first := roundTrip(t, conn, br, executeReq(t, "steps", "j1", nil))
	r1 := bufio.NewReader(first.Body)
	if l, _ := r1.ReadString('\n'); !strings.Contains(l, "number_of_executions") {
		t.Fatalf("first line %q", l)
	}
	conn2, br2, _ := f.codeTunnel(t, id, interpreter.Port)
	second := make(chan *http.Response, 1)
	go func() {
		req := executeReq(t, "steps", "j1", nil)
		req.Write(conn2)
		resp, _ := http.ReadResponse(br2, req)
		second <- resp
	}()
	var joined *http.Response
	select {
	case joined = <-second:
	case <-time.After(5 * time.Second):
		t.Fatal("the join did not answer while the call ran")
	}
	if joined == nil || joined.Header.Get(JoinedHeader) != "true" || joined.Header.Get(CallSeqHeader) != "1" {
		t.Fatalf("join: %+v", joined)
	}
	for range 3 {
		fi.step <- struct{}{}
	}
	a, _ := io.ReadAll(r1)
	b := readAll(t, joined)
	if !strings.HasSuffix(b, string(a)) || !strings.Contains(b, "number_of_executions") || !strings.Contains(b, "end_of_execution") {
		t.Fatalf("joined %q; first caller's rest %q", b, a)
	}
	if ex := fi.executions(); len(ex) != 1 {
		t.Fatalf("executions %q", ex)
	}
}

// TestTrajectoryCodeCallOneShot: a caller that sends one request with
// Connection: close and half-closes (the E2B gateway, HTTPRequest,
// ConnectPort) gets the whole answer, then the end of the stream.
func TestTrajectoryCodeCallOneShot(t *testing.T) {
	f := newTrajFixture(t)
	id := f.create(t)
	conn, br, _ := f.codeTunnel(t, id, interpreter.Port)
	req := executeReq(t, "print(6*7)", "", nil)
	req.Close = true
	if err := req.Write(conn); err != nil {
		t.Fatal(err)
	}
	conn.(*net.TCPConn).CloseWrite()
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); !strings.Contains(body, `"42\n"`) || !strings.Contains(body, "end_of_execution") {
		t.Fatalf("answer %q", body)
	}
	if rest, err := io.ReadAll(br); len(rest) != 0 || err != nil {
		t.Fatalf("after the answer: %q, %v", rest, err)
	}
	_, calls, err := f.n.Trajectory(t.Context(), id)
	if err != nil || len(calls) != 1 || calls[0].Req.Code != "print(6*7)" || calls[0].State != trajectory.StateDone {
		t.Fatalf("log: %+v, %v", calls, err)
	}
}
