package e2b

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

func (f *fakeAPI) setState(id string, st v1.SandboxState) (*v1.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sbs[id]
	if !ok {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "sandbox not found"))
	}
	sb.State = st
	return sb, nil
}

func (f *fakeAPI) PauseSandbox(_ context.Context, r *connect.Request[v1.PauseSandboxRequest]) (*connect.Response[v1.PauseSandboxResponse], error) {
	if f.noFSPause && r.Msg.GetFilesystemOnly() {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrUnimplemented, "backend microvm cannot pause a sandbox keeping only its files (filesystem_only); pause it with its memory, or run it on a backend that can (container)"))
	}
	sb, err := f.setState(r.Msg.GetId(), v1.SandboxState_SANDBOX_STATE_PAUSED)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.pauses = append(f.pauses, r.Msg)
	sb.PausedFilesystem = sb.PausedFilesystem || r.Msg.GetFilesystemOnly()
	f.mu.Unlock()
	return connect.NewResponse(&v1.PauseSandboxResponse{Sandbox: sb}), nil
}

func (f *fakeAPI) ResumeSandbox(_ context.Context, r *connect.Request[v1.ResumeSandboxRequest]) (*connect.Response[v1.ResumeSandboxResponse], error) {
	sb, err := f.setState(r.Msg.GetId(), v1.SandboxState_SANDBOX_STATE_RUNNING)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	sb.ExpiresAt = timestamppb.New(time.Now().Add(time.Duration(r.Msg.GetTimeoutSeconds()) * time.Second))
	sb.PausedFilesystem = false
	f.mu.Unlock()
	return connect.NewResponse(&v1.ResumeSandboxResponse{Sandbox: sb}), nil
}

func (f *fakeAPI) GetSandboxMetrics(_ context.Context, r *connect.Request[v1.GetSandboxMetricsRequest]) (*connect.Response[v1.GetSandboxMetricsResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.sbs[r.Msg.GetId()]; !ok {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "sandbox not found"))
	}
	return connect.NewResponse(&v1.GetSandboxMetricsResponse{Metrics: &v1.SandboxMetrics{
		Timestamp: timestamppb.Now(), CpuCount: 0.5, CpuUsedPct: 12.345, MemUsedBytes: 3 << 20, MemTotalBytes: 512 << 20,
		MemCacheBytes: 1 << 20, DiskUsedBytes: 4096, DiskTotalBytes: 1 << 30,
	}}), nil
}

func TestPauseResumeConnect(t *testing.T) {
	h := newHarness(t)
	w, m := h.do(h.keyA, "POST", "/sandboxes", `{"templateID":"base","autoPause":true}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("create with autoPause: %d %v", w.Code, m)
	}
	id := m["sandboxID"].(string)
	if got := h.api.sbs[id].GetSpec().GetOnTimeout(); got != "pause" {
		t.Fatalf("autoPause passed on as on_timeout %q, want pause", got)
	}
	if _, m := h.do(h.keyA, "GET", "/sandboxes/"+id, ""); m["lifecycle"].(map[string]any)["onTimeout"] != "pause" || m["lifecycle"].(map[string]any)["autoResume"] != true {
		t.Fatalf("lifecycle of an autoPause sandbox: %v", m["lifecycle"])
	}
	_, m = h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","autoPause":true,"autoResume":{"enabled":true}}`)
	if m["sandboxID"] == nil {
		t.Fatalf("create with autoPause and autoResume: %v", m)
	}
	h.do(h.keyA, "DELETE", "/sandboxes/"+m["sandboxID"].(string), "")
	_, m = h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if got := h.api.sbs[m["sandboxID"].(string)].GetSpec().GetOnTimeout(); got != "stop" {
		t.Fatalf("create without autoPause: on_timeout %q, want stop", got)
	}
	h.do(h.keyA, "DELETE", "/sandboxes/"+m["sandboxID"].(string), "")
	if w, m := h.do(h.keyA, "POST", "/sandboxes/"+id+"/pause", ``); w.Code != http.StatusNoContent {
		t.Fatalf("pause: %d %v", w.Code, m)
	}
	if w, m := h.do(h.keyA, "POST", "/sandboxes/"+id+"/pause", `{}`); w.Code != http.StatusConflict || m["code"] != float64(409) {
		t.Fatalf("second pause: %d %v, want 409", w.Code, m)
	}
	if _, m := h.do(h.keyA, "GET", "/sandboxes/"+id, ""); m["state"] != "paused" {
		t.Fatalf("state after pause: %v", m["state"])
	}
	if _, list := h.doList(h.keyA, "/v2/sandboxes?state=paused"); len(list) != 1 || list[0]["sandboxID"] != id {
		t.Fatalf("list state=paused: %v", list)
	}
	if _, list := h.doList(h.keyA, "/v2/sandboxes?state=running"); len(list) != 0 {
		t.Fatalf("list state=running shows a paused sandbox: %v", list)
	}
	// Another team cannot resume it.
	if w, _ := h.do(h.keyB, "POST", "/sandboxes/"+id+"/connect", `{"timeout":60}`); w.Code != http.StatusNotFound {
		t.Fatalf("connect by another team: %d", w.Code)
	}
	// connect resumes: 201, same ID, lifetime restarted.
	w, m = h.do(h.keyA, "POST", "/sandboxes/"+id+"/connect", `{"timeout":60}`)
	if w.Code != http.StatusCreated || m["sandboxID"] != id {
		t.Fatalf("connect to a paused sandbox: %d %v, want 201", w.Code, m)
	}
	if st := h.api.sbs[id].GetState(); st != v1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("state after connect: %s", st)
	}
	if w, _ := h.do(h.keyA, "POST", "/v2/sandboxes/"+id+"/connect", `{}`); w.Code != http.StatusOK {
		t.Fatalf("connect to a running sandbox: %d, want 200", w.Code)
	}
	if w, m := h.do(h.keyA, "POST", "/sandboxes/"+id+"/resume", `{}`); w.Code != http.StatusConflict {
		t.Fatalf("resume of a running sandbox: %d %v, want 409", w.Code, m)
	}
	h.do(h.keyA, "POST", "/sandboxes/"+id+"/pause", ``)
	if w, m := h.do(h.keyA, "POST", "/sandboxes/"+id+"/resume", `{"timeout":30}`); w.Code != http.StatusCreated || m["sandboxID"] != id {
		t.Fatalf("deprecated resume: %d %v", w.Code, m)
	}
	if w, _ := h.do(h.keyA, "POST", "/sandboxes/n001aaaaaaaaaaaaaaaa/pause", ``); w.Code != http.StatusNotFound {
		t.Fatalf("pause unknown: %d", w.Code)
	}
	if w, m := h.do(h.keyA, "POST", "/sandboxes", `{"templateID":"base","autoPauseMemory":false}`); w.Code != http.StatusBadRequest {
		t.Fatalf("autoPauseMemory without autoPause: %d %v", w.Code, m)
	}
}

// TestFilesystemOnlyPause: E2B's memory false (pause body, connect and the
// deprecated resume's reboot) and autoPauseMemory false reach the API as
// filesystem_only pauses and on_timeout "pause_filesystem".
func TestFilesystemOnlyPause(t *testing.T) {
	h := newHarness(t)
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","autoPause":true,"autoPauseMemory":false}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("create with autoPauseMemory false: %d %v", w.Code, m)
	}
	id := m["sandboxID"].(string)
	if got := h.api.sbs[id].GetSpec().GetOnTimeout(); got != "pause_filesystem" {
		t.Fatalf("autoPauseMemory false passed on as on_timeout %q, want pause_filesystem", got)
	}
	if _, m := h.do(h.keyA, "GET", "/sandboxes/"+id, ""); m["lifecycle"].(map[string]any)["onTimeout"] != "pause" {
		t.Fatalf("lifecycle of a filesystem auto-pause sandbox: %v", m["lifecycle"])
	}
	// The SDKs' pause({keepMemory:false}) / pause(mode="filesystem").
	if w, m := h.do(h.keyA, "POST", "/sandboxes/"+id+"/pause", `{"memory":false}`); w.Code != http.StatusNoContent {
		t.Fatalf("filesystem-only pause: %d %v", w.Code, m)
	}
	if n := len(h.api.pauses); n != 1 || !h.api.pauses[0].GetFilesystemOnly() {
		t.Fatalf("pause requests: %v, want one filesystem_only", h.api.pauses)
	}
	if w, m := h.do(h.keyA, "POST", "/sandboxes/"+id+"/pause", `{"memory":false}`); w.Code != http.StatusConflict {
		t.Fatalf("second filesystem-only pause: %d %v, want 409", w.Code, m)
	}
	if _, m := h.do(h.keyA, "GET", "/sandboxes/"+id, ""); m["state"] != "paused" {
		t.Fatalf("state after a filesystem-only pause: %v", m["state"])
	}
	// connect resumes it: 201, same ID.
	if w, m := h.do(h.keyA, "POST", "/v2/sandboxes/"+id+"/connect", `{"timeout":60}`); w.Code != http.StatusCreated || m["sandboxID"] != id {
		t.Fatalf("connect to a filesystem-paused sandbox: %d %v, want 201", w.Code, m)
	}
	if st := h.api.sbs[id].GetState(); st != v1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("state after connect: %s", st)
	}
	// onResume "reboot" (connect memory false) of a sandbox paused with its
	// memory: the memory is dropped, then it is resumed.
	h.api.pauses = nil
	h.do(h.keyA, "POST", "/sandboxes/"+id+"/pause", `{"memory":true}`)
	if w, m := h.do(h.keyA, "POST", "/v2/sandboxes/"+id+"/connect", `{"memory":false}`); w.Code != http.StatusCreated {
		t.Fatalf("connect with memory false: %d %v, want 201", w.Code, m)
	}
	if p := h.api.pauses; len(p) != 2 || p[0].GetFilesystemOnly() || !p[1].GetFilesystemOnly() {
		t.Fatalf("pause requests for a reboot: %v, want a memory pause then a filesystem_only one", p)
	}
	// The deprecated resume's memory false of a filesystem-paused sandbox
	// needs no further pause.
	h.api.pauses = nil
	h.do(h.keyA, "POST", "/sandboxes/"+id+"/pause", `{"memory":false}`)
	if w, m := h.do(h.keyA, "POST", "/sandboxes/"+id+"/resume", `{"timeout":30,"memory":false}`); w.Code != http.StatusCreated {
		t.Fatalf("deprecated resume with memory false: %d %v", w.Code, m)
	}
	if len(h.api.pauses) != 1 {
		t.Fatalf("pause requests: %v, want only the filesystem_only pause", h.api.pauses)
	}
	// E2B's infra refuses a filesystem auto-pause with autoResume.
	if w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base","autoPause":true,"autoPauseMemory":false,"autoResume":{"enabled":true}}`); w.Code != http.StatusBadRequest || !strings.Contains(fmt.Sprint(m["message"]), "autoResume") {
		t.Fatalf("autoPauseMemory false with autoResume: %d %v", w.Code, m)
	}
}

// TestE2BBackend: e2b.backend picks the backend of E2B's sandboxes (not of
// those from a snapshot, which keep their source's), and a backend's
// refusal of memory: false tells what the operator sets.
func TestE2BBackend(t *testing.T) {
	h := newHarness(t)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if got := h.api.sbs[m["sandboxID"].(string)].GetSpec().GetBackend(); got != "" {
		t.Fatalf("backend without e2b.backend: %q, want empty (the node's default)", got)
	}
	h.api.noFSPause = true
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/v2/sandboxes", `{"templateID":"base","autoPause":true,"autoPauseMemory":false}`},
		{"POST", "/sandboxes/" + m["sandboxID"].(string) + "/pause", `{"memory":false}`},
	} {
		w, m := h.do(h.keyA, c.method, c.path, c.body)
		if w.Code < 400 || !strings.Contains(fmt.Sprint(m["message"]), "e2b.backend: container") || !strings.Contains(fmt.Sprint(m["message"]), "node's default backend") {
			t.Fatalf("%s %s %s on a backend without filesystem pauses: %d %v, want the refusal naming e2b.backend", c.method, c.path, c.body, w.Code, m)
		}
	}
	h.api.noFSPause = false
	h.gw.cfg.Backend = "container"
	_, m = h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if got := h.api.sbs[m["sandboxID"].(string)].GetSpec().GetBackend(); got != "container" {
		t.Fatalf("backend with e2b.backend container: %q", got)
	}
}

func TestMetricsShapes(t *testing.T) {
	h := newHarness(t)
	_, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	id := m["sandboxID"].(string)
	now := time.Now().Unix()
	w, list := h.doList(h.keyA, fmt.Sprintf("/sandboxes/%s/metrics?start=%d&end=%d", id, now-60, now+5))
	if w.Code != http.StatusOK || len(list) != 1 {
		t.Fatalf("metrics: %d %v", w.Code, list)
	}
	got := list[0]
	for k, want := range map[string]any{"cpuCount": float64(1), "cpuUsedPct": 12.35, "memUsed": float64(3 << 20), "memTotal": float64(512 << 20),
		"memCache": float64(1 << 20), "diskUsed": float64(4096), "diskTotal": float64(1 << 30)} {
		if got[k] != want {
			t.Errorf("%s = %v, want %v", k, got[k], want)
		}
	}
	ts, err := time.Parse(time.RFC3339Nano, got["timestamp"].(string))
	if err != nil || ts.Unix() != int64(got["timestampUnix"].(float64)) || ts.Unix() < now-10 {
		t.Fatalf("timestamp %v / %v: %v", got["timestamp"], got["timestampUnix"], err)
	}
	// A window that ended before now: no samples.
	if _, list := h.doList(h.keyA, fmt.Sprintf("/sandboxes/%s/metrics?start=%d&end=%d", id, now-3600, now-1800)); len(list) != 0 {
		t.Fatalf("past window: %v", list)
	}
	if w, _ := h.do(h.keyA, "GET", "/sandboxes/"+id+"/metrics?start=abc", ""); w.Code != http.StatusBadRequest {
		t.Fatalf("bad start: %d", w.Code)
	}
	if w, _ := h.do(h.keyB, "GET", "/sandboxes/"+id+"/metrics", ""); w.Code != http.StatusNotFound {
		t.Fatalf("metrics of another team's sandbox: %d", w.Code)
	}
	w, m = h.do(h.keyA, "GET", "/sandboxes/metrics?sandbox_ids="+id+",n001aaaaaaaaaaaaaaaa", "")
	sbs, _ := m["sandboxes"].(map[string]any)
	if w.Code != http.StatusOK || len(sbs) != 1 || sbs[id] == nil {
		t.Fatalf("metrics of many: %d %v", w.Code, m)
	}
	if w, _ := h.do(h.keyA, "GET", "/sandboxes/metrics", ""); w.Code != http.StatusBadRequest {
		t.Fatalf("metrics of many without ids: %d", w.Code)
	}
}

// doList GETs path and decodes a JSON array answer.
func (h *harness) doList(key, path string) (*httptest.ResponseRecorder, []map[string]any) {
	h.t.Helper()
	req := httptest.NewRequest("GET", path, nil)
	req.Header.Set("X-API-Key", key)
	w := httptest.NewRecorder()
	h.gw.ServeHTTP(w, req)
	var out []map[string]any
	if strings.HasPrefix(strings.TrimSpace(w.Body.String()), "[") {
		if err := json.Unmarshal(w.Body.Bytes(), &out); err != nil {
			h.t.Fatalf("GET %s: body %q: %v", path, w.Body, err)
		}
	}
	return w, out
}
