//go:build linux

package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/interpreter"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// pyRootfs is deploy/images/build.sh's cached Debian + python3 root.
func pyRootfs(t *testing.T) string {
	t.Helper()
	cache := os.Getenv("OPENDSEC_CACHE")
	if cache == "" {
		cache = "/var/cache/opendsec"
	}
	dir := filepath.Join(cache, "rootfs", "py-3.11")
	if _, err := os.Stat(filepath.Join(dir, "usr", "bin", "python3")); err != nil {
		t.Fatalf("the py-3.11 root filesystem is needed: %v; build it with `make base-images` (make test does)", err)
	}
	return dir
}

// TestInterpreterIPythonShellLines sends IPython cells to the real code
// interpreter in a real container sandbox (agent started it on port 49999),
// as E2B's run_code does.
func TestInterpreterIPythonShellLines(t *testing.T) {
	s := newSystem(t)
	s.Run("image", "import-rootfs", "--name", "root/py:3.11", "--rootfs", pyRootfs(t))
	s.Start()
	sb := s.Create(t, &opendsecv1.SandboxSpec{Image: "root/py:3.11"})
	c := s.Client(t)
	run := func(code string) (stdout, stderr string, results, errs []map[string]any) {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"code": code})
		resp, err := c.HTTPRequest(t.Context(), sb.Id, opendsec.HTTPRequest{
			Port: interpreter.Port, Method: http.MethodPost, Path: "/execute",
			Header: http.Header{"Content-Type": {"application/json"}}, Body: body, Timeout: time.Minute,
		})
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("execute %q: %v %+v", code, err, resp)
		}
		sc := bufio.NewScanner(bytes.NewReader(resp.Body))
		for sc.Scan() {
			var ev map[string]any
			if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
				t.Fatalf("event %q: %v", sc.Text(), err)
			}
			switch ev["type"] {
			case "stdout":
				stdout += ev["text"].(string)
			case "stderr":
				stderr += ev["text"].(string)
			case "result":
				results = append(results, ev)
			case "error":
				errs = append(errs, ev)
			}
		}
		return
	}
	out, _, _, errs := run("!echo hi")
	if out != "hi\n" || len(errs) != 0 {
		t.Fatalf("!echo hi: stdout %q errors %v", out, errs)
	}
	// {expr} and $name are Python's; $$ passes a $ on to the shell.
	out, _, res, errs := run("who = !id -un\nif who:\n    !echo in $$PWD as {who[0]}\nwho.s")
	if len(errs) != 0 || len(res) != 1 || out != "in /home/user as "+strings.Trim(res[0]["text"].(string), "'")+"\n" {
		t.Fatalf("capture and expansion: stdout %q results %v errors %v", out, res, errs)
	}
	out, serr, _, errs := run("%%sh\necho cell\necho warn >&2")
	if out != "cell\n" || serr != "warn\n" || len(errs) != 0 {
		t.Fatalf("%%%%sh: %q %q %v", out, serr, errs)
	}
	// root/py:3.11 has no pip: python's own message, no SyntaxError.
	_, serr, _, errs = run("!pip install pillow numpy")
	if len(errs) != 0 || !strings.Contains(serr, "No module named pip") {
		t.Fatalf("!pip install: stderr %q errors %v", serr, errs)
	}
	if _, _, _, errs = run("%nosuch"); len(errs) != 1 || errs[0]["name"] != "UsageError" {
		t.Fatalf("unknown magic: %v", errs)
	}
}
