package e2b

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

func (f *fakeAPI) ForkSandbox(_ context.Context, r *connect.Request[v1.ForkSandboxRequest]) (*connect.Response[v1.ForkSandboxResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	src, ok := f.sbs[r.Msg.GetSandboxId()]
	if !ok {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "sandbox_id: sandbox not found"))
	}
	f.forks = append(f.forks, r.Msg)
	out := &v1.ForkSandboxResponse{}
	for range r.Msg.GetCount() {
		sb := proto.Clone(src).(*v1.Sandbox)
		sb.Id, sb.ParentId = sandboxid.New("n001"), src.GetId()
		sb.Spec.TimeoutSeconds = r.Msg.GetTimeoutSeconds()
		f.sbs[sb.Id] = sb
		out.Forks = append(out.Forks, &v1.ForkResult{Sandbox: sb})
	}
	return connect.NewResponse(out), nil
}

func TestFork(t *testing.T) {
	h := newHarness(t)
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"k":"v"}}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("create: %d %v", w.Code, m)
	}
	id := m["sandboxID"].(string)
	fork := func(key, id, body string) (int, []map[string]map[string]any, string) {
		w, _ := h.do(key, "POST", "/sandboxes/"+id+"/fork", body)
		var out []map[string]map[string]any
		if w.Code == http.StatusCreated {
			if err := json.Unmarshal(w.Body.Bytes(), &out); err != nil {
				t.Fatalf("fork answer %s: %v", w.Body, err)
			}
		}
		return w.Code, out, w.Body.String()
	}
	// Defaults: one fork, 15 s.
	code, out, body := fork(h.keyA, id, "")
	if code != http.StatusCreated || len(out) != 1 || out[0]["error"] != nil {
		t.Fatalf("fork with defaults: %d %s", code, body)
	}
	f0 := out[0]["sandbox"]
	if f0["sandboxID"] == id || f0["templateID"] != "base" || f0["envdAccessToken"] == nil || f0["envdVersion"] != EnvdVersion {
		t.Fatalf("fork sandbox %v", f0)
	}
	if got := h.api.forks[0]; got.GetCount() != 1 || got.GetTimeoutSeconds() != 15 || got.GetRequestId() == "" {
		t.Fatalf("fork request %v", got)
	}
	// The fork is the caller's: it can get it.
	if w, _ := h.do(h.keyA, "GET", "/sandboxes/"+f0["sandboxID"].(string), ""); w.Code != http.StatusOK {
		t.Fatalf("get the fork: %d", w.Code)
	}
	code, out, body = fork(h.keyA, id, `{"count":4,"timeout":60}`)
	if code != http.StatusCreated || len(out) != 4 || h.api.forks[1].GetTimeoutSeconds() != 60 {
		t.Fatalf("fork of 4: %d %s", code, body)
	}
	for _, c := range []struct{ body, mention string }{
		{`{"count":0}`, "count"},
		{`{"count":65}`, "at most 64"},
		{`{"count":101}`, "count"},
		{`{"timeout":0}`, "Timeout must be greater than 0"},
		{`{"count":"x"}`, "JSON"},
	} {
		if code, _, body := fork(h.keyA, id, c.body); code != http.StatusBadRequest || !strings.Contains(body, c.mention) {
			t.Errorf("fork %s: %d %s, want 400 mentioning %q", c.body, code, body, c.mention)
		}
	}
	if code, _, body := fork(h.keyB, id, ""); code != http.StatusNotFound {
		t.Errorf("another team forks it: %d %s, want 404", code, body)
	}
	if code, _, body := fork(h.keyA, "nosuch", ""); code != http.StatusNotFound {
		t.Errorf("fork of an unknown sandbox: %d %s, want 404", code, body)
	}
	if n := len(h.api.forks); n != 2 {
		t.Fatalf("%d fork calls reached the API, want 2 (bad input stops at the gateway)", n)
	}
}
