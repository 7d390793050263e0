package interpreter

import (
	"bufio"
	"bytes"
	"context"
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
	"time"
)

// runner is interpreter.py served by the machine's python3 on a free port.
type runner struct{ base string }

func startRunner(t *testing.T) *runner {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is needed to test the runner: %v", err)
	}
	p := filepath.Join(t.TempDir(), "interpreter.py")
	if err := os.WriteFile(p, Source, 0o444); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	cmd := exec.Command(py, p, "--port", fmt.Sprint(port))
	cmd.Dir = t.TempDir()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	r := &runner{base: fmt.Sprintf("http://127.0.0.1:%d", port)}
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get(r.base + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return r
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("runner not healthy after 10s: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *runner) call(t *testing.T, method, path string, body any) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if s, ok := body.(string); ok {
		rd = strings.NewReader(s)
	} else if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequestWithContext(context.Background(), method, r.base+path, rd)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

// execution is what one POST /execute streamed.
type execution struct {
	stdout, stderr string
	results        []map[string]any
	errs           []map[string]any
	count          float64
	ended          bool
}

func (r *runner) exec(t *testing.T, body map[string]any) execution {
	t.Helper()
	status, b := r.call(t, "POST", "/execute", body)
	if status != 200 {
		t.Fatalf("execute %v: %d %s", body, status, b)
	}
	var x execution
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		var ev map[string]any
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		switch ev["type"] {
		case "stdout", "stderr":
			if _, ok := ev["timestamp"].(string); !ok {
				t.Errorf("%v has no timestamp", ev)
			}
			if ev["type"] == "stdout" {
				x.stdout += ev["text"].(string)
			} else {
				x.stderr += ev["text"].(string)
			}
		case "result":
			x.results = append(x.results, ev)
		case "error":
			x.errs = append(x.errs, ev)
		case "number_of_executions":
			x.count = ev["execution_count"].(float64)
		case "end_of_execution":
			x.ended = true
		}
	}
	if !x.ended {
		t.Fatalf("no end_of_execution in %s", b)
	}
	return x
}

func code(s string) map[string]any { return map[string]any{"code": s} }

func TestExecuteKeepsStateAndReturnsLastExpression(t *testing.T) {
	r := startRunner(t)
	x := r.exec(t, code("x = 1\nprint('out')\nimport sys; print('err', file=sys.stderr)"))
	if x.stdout != "out\n" || x.stderr != "err\n" || len(x.results) != 0 || len(x.errs) != 0 {
		t.Fatalf("first execution: %+v", x)
	}
	x2 := r.exec(t, code("x + 1"))
	if len(x2.results) != 1 || x2.results[0]["text"] != "2" || x2.results[0]["is_main_result"] != true {
		t.Fatalf("x + 1: %+v", x2)
	}
	if x2.count != x.count+1 {
		t.Fatalf("execution count %v after %v", x2.count, x.count)
	}
	// None is no result; a statement last is no result.
	if x3 := r.exec(t, code("None")); len(x3.results) != 0 {
		t.Fatalf("None gave %v", x3.results)
	}
}

func TestExecuteError(t *testing.T) {
	r := startRunner(t)
	x := r.exec(t, code("print('before')\ndef f():\n    raise ValueError('bad value')\nf()"))
	if len(x.errs) != 1 {
		t.Fatalf("errors %v", x.errs)
	}
	e := x.errs[0]
	tb, _ := e["traceback"].(string)
	if e["name"] != "ValueError" || e["value"] != "bad value" || !strings.Contains(tb, "raise ValueError('bad value')") || strings.Contains(tb, "interpreter.py") {
		t.Fatalf("error %v", e)
	}
	if x.stdout != "before\n" {
		t.Fatalf("stdout before the error: %q", x.stdout)
	}
	x = r.exec(t, code("1 +"))
	if len(x.errs) != 1 || x.errs[0]["name"] != "SyntaxError" {
		t.Fatalf("syntax error: %v", x.errs)
	}
	// The context survives both.
	if x = r.exec(t, code("2 * 21")); len(x.results) != 1 || x.results[0]["text"] != "42" {
		t.Fatalf("after errors: %+v", x)
	}
}

func TestExecuteRichResults(t *testing.T) {
	r := startRunner(t)
	x := r.exec(t, code(`class Rich:
    def _repr_html_(self): return "<b>rich</b>"
    def _repr_png_(self): return b"\x89PNG"
    def __repr__(self): return "Rich()"
display("shown")
Rich()`))
	if len(x.results) != 2 {
		t.Fatalf("results %v", x.results)
	}
	if d := x.results[0]; d["is_main_result"] != false || d["text"] != "'shown'" {
		t.Fatalf("display result %v", d)
	}
	m := x.results[1]
	if m["is_main_result"] != true || m["text"] != "Rich()" || m["html"] != "<b>rich</b>" || m["png"] != "iVBORw==" {
		t.Fatalf("main result %v", m)
	}
}

func TestExecuteEnvVarsAreRestored(t *testing.T) {
	r := startRunner(t)
	x := r.exec(t, map[string]any{"code": "import os; os.environ.get('ODS_T')", "env_vars": map[string]string{"ODS_T": "v"}})
	if len(x.results) != 1 || x.results[0]["text"] != "'v'" {
		t.Fatalf("with env_vars: %+v", x)
	}
	if x = r.exec(t, code("import os; os.environ.get('ODS_T')")); len(x.results) != 0 {
		t.Fatalf("env var kept after the execution: %+v", x.results)
	}
}

func TestContexts(t *testing.T) {
	r := startRunner(t)
	r.exec(t, code("shared = 'default'"))
	dir := t.TempDir()
	status, b := r.call(t, "POST", "/contexts", map[string]any{"language": "python", "cwd": dir})
	var ctx struct{ ID, Language, Cwd string }
	if err := json.Unmarshal(b, &ctx); status != 200 || err != nil || ctx.ID == "" || ctx.Language != "python" || ctx.Cwd != dir {
		t.Fatalf("create: %d %s", status, b)
	}
	x := r.exec(t, map[string]any{"code": "import os\nprint(os.getcwd())\n'shared' in globals()", "context_id": ctx.ID})
	if x.stdout != dir+"\n" || len(x.results) != 1 || x.results[0]["text"] != "False" {
		t.Fatalf("new context sees the default's variables or wrong cwd: %+v", x)
	}
	r.exec(t, map[string]any{"code": "y = 5", "context_id": ctx.ID})
	status, b = r.call(t, "GET", "/contexts", nil)
	if status != 200 || !strings.Contains(string(b), ctx.ID) || strings.Contains(string(b), `"default"`) {
		t.Fatalf("list: %d %s", status, b)
	}
	if status, b = r.call(t, "POST", "/contexts/"+ctx.ID+"/restart", nil); status != 200 {
		t.Fatalf("restart: %d %s", status, b)
	}
	x = r.exec(t, map[string]any{"code": "y", "context_id": ctx.ID})
	if len(x.errs) != 1 || x.errs[0]["name"] != "NameError" {
		t.Fatalf("restart kept variables: %+v", x)
	}
	if status, b = r.call(t, "DELETE", "/contexts/"+ctx.ID, nil); status != 200 {
		t.Fatalf("remove: %d %s", status, b)
	}
	status, b = r.call(t, "POST", "/execute", map[string]any{"code": "1", "context_id": ctx.ID})
	if status != 404 || string(b) != "Context "+ctx.ID+" not found" {
		t.Fatalf("removed context: %d %s", status, b)
	}
	for path, method := range map[string]string{"/contexts/nope/restart": "POST", "/contexts/nope": "DELETE"} {
		if status, b = r.call(t, method, path, nil); status != 404 {
			t.Fatalf("%s %s: %d %s", method, path, status, b)
		}
	}
}

func TestBadRequests(t *testing.T) {
	r := startRunner(t)
	for name, tc := range map[string]struct {
		path string
		body any
		want string
	}{
		"malformed json":   {"/execute", "{", "body"},
		"no code":          {"/execute", map[string]any{}, "code"},
		"context+language": {"/execute", map[string]any{"code": "1", "context_id": "a", "language": "python"}, "context_id"},
		"unknown language": {"/execute", map[string]any{"code": "1", "language": "cobol"}, "language"},
		"missing cwd":      {"/contexts", map[string]any{"cwd": "/nonexistent/dir"}, "cwd"},
		"js context":       {"/contexts", map[string]any{"language": "js"}, "language"},
	} {
		status, b := r.call(t, "POST", tc.path, tc.body)
		if status != 400 || !strings.HasPrefix(string(b), tc.want) {
			t.Errorf("%s: %d %s, want 400 naming %s", name, status, b, tc.want)
		}
	}
	if status, b := r.call(t, "GET", "/contexts", nil); status != 200 || string(b) != "[]" {
		t.Fatalf("bad requests made contexts: %s", b)
	}
}
