//go:build linux

package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// e2bGet is GET path on the E2B gateway with key: status and body.
func (s *system) e2bGet(t *testing.T, key, path string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+s.E2BAddr()+path, nil)
	req.Header.Set("X-API-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// TestE2BSandboxLogs: through a real system, an E2B sandbox's logs (v1
// and v2) hold its start and the commands run in it, read from the node's
// trajectory log as the key's principal; another principal gets 404, and
// GET /teams names only the key's own team.
func TestE2BSandboxLogs(t *testing.T) {
	s := newSystem(t)
	s.Start()
	key, other := s.E2BKey(t, "team-logs"), s.E2BKey(t, "team-other")
	id := s.e2bCreate(t, key, "")
	if r := s.shell(t, id, "echo logs-e2e-marker; exit 3"); r.exit.GetExitCode() != 3 {
		t.Fatalf("exec: %+v", r)
	}
	code, body := s.e2bGet(t, key, "/v2/sandboxes/"+id+"/logs")
	var v2 struct {
		Logs []struct {
			Level, Message string
			Fields         map[string]string
		}
	}
	if code != 200 || json.Unmarshal(body, &v2) != nil || len(v2.Logs) < 3 {
		t.Fatalf("v2 logs: %d %s", code, body)
	}
	var started, ended bool
	for _, e := range v2.Logs {
		started = started || strings.Contains(e.Message, "logs-e2e-marker") && strings.HasSuffix(e.Message, " started")
		ended = ended || strings.Contains(e.Message, "logs-e2e-marker") && strings.HasSuffix(e.Message, "ended with exit code 3") && e.Fields["exitCode"] == "3"
	}
	if !strings.HasPrefix(v2.Logs[0].Message, "sandbox started from template root/busybox") || !started || !ended {
		var direct []string
		if st, err := s.Processes().GetTrajectory(t.Context(), connect.NewRequest(&opendsecv1.GetTrajectoryRequest{SandboxId: id, WithoutOutput: true})); err == nil {
			for st.Receive() {
				direct = append(direct, st.Msg().String())
			}
			direct = append(direct, fmt.Sprint(st.Err()))
		}
		t.Fatalf("v2 logs lack the start or the command: %s\nthe API's trajectory: %q", body, direct)
	}
	code, body = s.e2bGet(t, key, "/sandboxes/"+id+"/logs?limit=1")
	if code != 200 || !strings.Contains(string(body), `\"message\":\"sandbox started from template root/busybox\"`) || !strings.Contains(string(body), `"logEntries":[{`) {
		t.Fatalf("v1 logs: %d %s", code, body)
	}
	for _, path := range []string{"/v2/sandboxes/" + id + "/logs", "/sandboxes/" + id + "/logs"} {
		if code, body := s.e2bGet(t, other, path); code != 404 || strings.Contains(string(body), "marker") {
			t.Fatalf("another principal: %s: %d %s", path, code, body)
		}
	}
	code, body = s.e2bGet(t, other, "/teams")
	if code != 200 || !strings.Contains(string(body), `"teamID":"team-other"`) || strings.Contains(string(body), "team-logs") {
		t.Fatalf("teams: %d %s", code, body)
	}
}
