package agent

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/interpreter"
)

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func interpreterFile(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "interpreter.py")
	if err := os.WriteFile(p, interpreter.Source, 0o444); err != nil {
		t.Fatal(err)
	}
	return p
}

// execThroughTunnel opens the agent's tunnel to port and sends one
// POST /execute over it, returning the JSON-line events.
func execThroughTunnel(t *testing.T, e *env, port int, code string) []map[string]any {
	t.Helper()
	c, err := net.Dial("unix", e.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /_opendsec/port/%d HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n", port)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 101 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("tunnel: %s %s", resp.Status, b)
	}
	body, _ := json.Marshal(map[string]any{"code": code})
	fmt.Fprintf(c, "POST /execute HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("execute: %s", resp.Status)
	}
	var evs []map[string]any
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var ev map[string]any
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			t.Fatalf("event %q: %v", sc.Text(), err)
		}
		evs = append(evs, ev)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return evs
}

func TestInterpreterStartsOnDemand(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Fatalf("python3 is needed for this test: %v", err)
	}
	port := freePort(t)
	e := newEnv(t, Config{InterpreterPath: interpreterFile(t), InterpreterPort: port})
	if c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err == nil {
		c.Close()
		t.Fatal("something listens before the first tunnel")
	}
	execThroughTunnel(t, e, port, "x = 41")
	evs := execThroughTunnel(t, e, port, "print('hi')\nx + 1")
	var stdout, result string
	for _, ev := range evs {
		switch ev["type"] {
		case "stdout":
			stdout += ev["text"].(string)
		case "result":
			result, _ = ev["text"].(string)
		}
	}
	if stdout != "hi\n" || result != "42" {
		t.Fatalf("events %v: stdout %q result %q, want hi and 42 (state kept)", evs, stdout, result)
	}
	e.agent.Close()
	r := e.agent.ci.current()
	<-r.exited // SIGKILL to the group: Close ends the runner
}

func TestInterpreterUnavailable(t *testing.T) {
	port := freePort(t)
	for name, cfg := range map[string]Config{
		"no python3": {InterpreterPath: interpreterFile(t), InterpreterPort: port, Env: []string{"PATH=/nonexistent"}},
		"no runner":  {InterpreterPath: filepath.Join(t.TempDir(), "missing.py"), InterpreterPort: port},
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, cfg)
			r, b := e.do(t, "GET", fmt.Sprintf("%s/_opendsec/port/%d", base, port), nil, map[string]string{"Connection": "Upgrade", "Upgrade": "tcp"})
			if r.StatusCode != 503 || !strings.Contains(string(b), "code interpreter") {
				t.Fatalf("%s %s, want 503 naming the code interpreter", r.Status, b)
			}
			if e.agent.ci.current() != nil {
				t.Fatal("a runner was started")
			}
		})
	}
}
