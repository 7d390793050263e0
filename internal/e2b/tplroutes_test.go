package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// getList is h.do for a route answering a JSON array.
func (h *harness) getList(key, method, path string) (*http.Response, []map[string]any) {
	h.t.Helper()
	w, _ := h.do(key, method, path, "")
	var out []map[string]any
	if w.Code == http.StatusOK {
		if err := json.Unmarshal(w.Body.Bytes(), &out); err != nil {
			h.t.Fatalf("%s %s: body %q: %v", method, path, w.Body, err)
		}
	}
	return w.Result(), out
}

// wantStatus fails unless the answer is E2B's 400 naming want.
func wantStatus(t *testing.T, what string, code int, m map[string]any, status int, want string) {
	t.Helper()
	msg, _ := m["message"].(string)
	if code != status || m["code"] != float64(status) || !strings.Contains(msg, want) {
		t.Fatalf("%s: %d %v; want %d naming %q", what, code, m, status, want)
	}
}

// buildReadyTemplate builds name (one RUN step) with key A and returns its
// IDs.
func (h *harness) buildReadyTemplate(name string) (tid, bid string) {
	h.t.Helper()
	tid, bid, w, _ := h.startBuild(name, `{"fromImage":"root/busybox","steps":[{"type":"RUN","args":["echo hi"]}]}`)
	if w.Code != 202 {
		h.t.Fatalf("start %s: %d %s", name, w.Code, w.Body)
	}
	if st, _ := h.waitBuild(h.keyA, tid, bid); st["status"] != buildReady {
		h.t.Fatalf("build %s: %v", name, st)
	}
	return tid, bid
}

// GET /templates/{id} answers E2B's TemplateWithBuilds for the owner
// (by ID or name), builds newest first and paged; another principal and
// unknown templates get 404; bad paging is 400 naming the parameter.
func TestGetTemplateWithBuilds(t *testing.T) {
	h, _ := newBuildHarness(t)
	tid, b1 := h.buildReadyTemplate("web")
	_, b2 := h.buildReadyTemplate("web")
	w, m := h.do(h.keyA, "GET", "/templates/"+tid, "")
	if w.Code != 200 || m["templateID"] != tid || m["buildID"] != b2 || m["buildStatus"] != buildReady || m["public"] != false ||
		m["buildCount"] != float64(2) || !slices.Equal(toStrings(m["names"]), []string{"web"}) || m["envdVersion"] != EnvdVersion {
		t.Fatalf("get: %d %v", w.Code, m)
	}
	builds := m["builds"].([]any)
	if len(builds) != 2 || builds[0].(map[string]any)["buildID"] != b2 || builds[1].(map[string]any)["buildID"] != b1 {
		t.Fatalf("builds %v; want %s then %s", builds, b2, b1)
	}
	for _, k := range []string{"status", "createdAt", "updatedAt", "finishedAt", "cpuCount", "memoryMB"} {
		if _, ok := builds[0].(map[string]any)[k]; !ok {
			t.Fatalf("build lacks %s: %v", k, builds[0])
		}
	}
	if w, m := h.do(h.keyA, "GET", "/templates/web", ""); w.Code != 200 || m["templateID"] != tid {
		t.Fatalf("get by name: %d %v", w.Code, m)
	}
	w, m = h.do(h.keyA, "GET", "/templates/"+tid+"?limit=1", "")
	if w.Code != 200 || len(m["builds"].([]any)) != 1 || w.Header().Get("X-Next-Token") != "1" {
		t.Fatalf("page 1: %d %v next %q", w.Code, m, w.Header().Get("X-Next-Token"))
	}
	w, m = h.do(h.keyA, "GET", "/templates/"+tid+"?limit=1&nextToken=1", "")
	if bs := m["builds"].([]any); w.Code != 200 || len(bs) != 1 || bs[0].(map[string]any)["buildID"] != b1 || w.Header().Get("X-Next-Token") != "" {
		t.Fatalf("page 2: %d %v", w.Code, m)
	}
	for _, c := range []struct{ key, path, want string }{
		{h.keyB, "/templates/" + tid, "not found"},
		{h.keyB, "/templates/web", "not found"},
		{h.keyA, "/templates/nope", "not found"},
		{h.keyA, "/templates/base", "not found"},
	} {
		w, m := h.do(c.key, "GET", c.path, "")
		wantStatus(t, c.path, w.Code, m, 404, c.want)
	}
	for q, field := range map[string]string{"limit=0": "limit", "limit=101": "limit", "limit=x": "limit", "nextToken=zz": "nextToken", "nextToken=9": "nextToken"} {
		w, m := h.do(h.keyA, "GET", "/templates/"+tid+"?"+q, "")
		wantStatus(t, q, w.Code, m, 400, field)
	}
}

func toStrings(v any) []string {
	var out []string
	for _, s := range v.([]any) {
		out = append(out, s.(string))
	}
	return out
}

// PATCH {public: true} lets every principal start the template by its ID
// (and build from it) and see it exist; it stays its owner's to read,
// patch and delete, and not by name. v1 answers 200 with no body, v2
// {names}. Bad bodies are 400 naming the field and change nothing.
func TestPatchTemplatePublic(t *testing.T) {
	h, _ := newBuildHarness(t)
	tid, bid := h.buildReadyTemplate("shared")
	img := tplImagePrefix + tid + ":" + bid
	h.api.extraImages = []string{img}
	if w, _ := h.do(h.keyB, "POST", "/v2/sandboxes", `{"templateID":"`+tid+`"}`); w.Code != 404 {
		t.Fatalf("another principal starts a private template: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyB, "GET", "/templates/aliases/"+tid, ""); w.Code != 404 {
		t.Fatalf("another principal sees a private template: %d", w.Code)
	}
	w, m := h.do(h.keyA, "PATCH", "/templates/"+tid, `{"public":"yes"}`)
	wantStatus(t, "patch with a string", w.Code, m, 400, "public")
	if w, m := h.do(h.keyB, "PATCH", "/v2/templates/"+tid, `{"public":true}`); w.Code != 404 {
		t.Fatalf("another principal patches it: %d %v", w.Code, m)
	}
	w, m = h.do(h.keyA, "PATCH", "/v2/templates/"+tid, `{"public":true}`)
	if w.Code != 200 || !slices.Equal(toStrings(m["names"]), []string{"shared"}) {
		t.Fatalf("patch v2: %d %s", w.Code, w.Body)
	}
	if _, m := h.do(h.keyA, "GET", "/templates/"+tid, ""); m["public"] != true {
		t.Fatalf("after patch: %v", m)
	}
	w, m = h.do(h.keyB, "GET", "/templates/aliases/"+tid, "")
	if w.Code != 200 || m["public"] != true {
		t.Fatalf("alias of a public template for another principal: %d %v", w.Code, m)
	}
	w, m = h.do(h.keyB, "POST", "/v2/sandboxes", `{"templateID":"`+tid+`"}`)
	if w.Code != 201 || h.api.sbs[m["sandboxID"].(string)].GetSpec().GetImage() != img {
		t.Fatalf("another principal starts a public template: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyB, "POST", "/v2/sandboxes", `{"templateID":"shared"}`); w.Code != 404 {
		t.Fatalf("a public template by its owner's name for another principal: %d", w.Code)
	}
	// Builds from it, never of it.
	_, _, w, _ = h.startBuild("derived-by-a", `{"fromTemplate":"`+tid+`"}`)
	if w.Code != 202 {
		t.Fatalf("owner builds from it: %d", w.Code)
	}
	w, m = h.do(h.keyB, "POST", "/v3/templates", `{"name":"derived"}`)
	if w.Code != 202 {
		t.Fatalf("request build: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyB, "POST", "/v2/templates/"+m["templateID"].(string)+"/builds/"+m["buildID"].(string), `{"fromTemplate":"`+tid+`"}`); w.Code != 202 {
		t.Fatalf("another principal builds from a public template: %d %s", w.Code, w.Body)
	}
	for _, c := range []struct{ method, path, body string }{
		{"GET", "/templates/" + tid, ""},
		{"DELETE", "/templates/" + tid, ""},
		{"GET", "/templates/" + tid + "/builds/" + bid + "/status", ""},
		{"GET", "/templates/" + tid + "/builds/" + bid + "/logs", ""},
		{"GET", "/templates/" + tid + "/tags", ""},
		{"PATCH", "/templates/" + tid, `{"public":false}`},
		{"POST", "/v2/templates/" + tid + "/builds/" + bid, `{"fromImage":"root/busybox"}`},
		{"GET", "/templates/" + tid + "/files/" + strings.Repeat("a", 64), ""},
	} {
		if w, _ := h.do(h.keyB, c.method, c.path, c.body); w.Code != 404 {
			t.Fatalf("another principal: %s %s: %d %s", c.method, c.path, w.Code, w.Body)
		}
	}
	// A name of the form of a template ID could shadow one.
	w, m = h.do(h.keyB, "POST", "/v3/templates", `{"name":"`+tid+`"}`)
	wantStatus(t, "a name that is a template ID", w.Code, m, 400, "name")
	if w, _ := h.do(h.keyB, "POST", "/templates/tags", `{"target":"`+tid+`:default","tags":["mine"]}`); w.Code != 404 {
		t.Fatalf("another principal tags a public template: %d %s", w.Code, w.Body)
	}
	if w, m := h.do(h.keyB, "POST", "/v3/templates", `{"name":"shared"}`); w.Code != 202 || m["templateID"] == tid {
		t.Fatalf("another principal's build of the same name must make its own template: %d %v", w.Code, m)
	}
	if _, list := h.getList(h.keyB, "GET", "/v2/templates"); slices.ContainsFunc(list, func(m map[string]any) bool { return m["templateID"] == tid }) {
		t.Fatalf("another principal lists it: %v", list)
	}
	w, _ = h.do(h.keyA, "PATCH", "/templates/"+tid, `{"public":false}`)
	if w.Code != 200 || w.Body.Len() != 0 {
		t.Fatalf("patch v1: %d %q", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyB, "POST", "/v2/sandboxes", `{"templateID":"`+tid+`"}`); w.Code != 404 {
		t.Fatalf("private again, another principal starts it: %d", w.Code)
	}
	if w, m := h.do(h.keyA, "PATCH", "/v2/templates/nope", `{"public":true}`); w.Code != 404 || m["code"] != float64(404) {
		t.Fatalf("patch unknown: %d %v", w.Code, m)
	}
	// Kept across a restart of the gateway (the builds above write the
	// store: they end first).
	h.gw.builds.Wait()
	h.gw.tpls.path = filepath.Join(t.TempDir(), "templates.json")
	if w, _ := h.do(h.keyA, "PATCH", "/templates/"+tid, `{"public":true}`); w.Code != 200 {
		t.Fatalf("patch: %d", w.Code)
	}
	s2, err := newTplStore(h.gw.tpls.path)
	if err != nil {
		t.Fatal(err)
	}
	if _, b, ok := s2.resolveStart("team-b", tid); !ok || b.ID != bid {
		t.Fatalf("public after a restart: %v %v", b, ok)
	}
}

// GET /v2/templates is E2B's Template[] of the caller's templates, paged;
// a teamID that is not the caller's is 403, bad paging 400.
func TestListTemplatesV2(t *testing.T) {
	h, _ := newBuildHarness(t)
	t1, _ := h.buildReadyTemplate("one")
	t2, _ := h.buildReadyTemplate("two")
	resp, list := h.getList(h.keyA, "GET", "/v2/templates")
	if resp.StatusCode != 200 || len(list) != 2 || list[0]["templateID"] != t1 || list[1]["templateID"] != t2 || list[0]["buildStatus"] != buildReady {
		t.Fatalf("list: %d %v", resp.StatusCode, list)
	}
	for _, k := range []string{"buildID", "cpuCount", "memoryMB", "diskSizeMB", "public", "aliases", "names", "createdAt", "updatedAt", "createdBy", "lastSpawnedAt", "spawnCount", "buildCount", "envdVersion"} {
		if _, ok := list[0][k]; !ok {
			t.Fatalf("template lacks %s: %v", k, list[0])
		}
	}
	resp, list = h.getList(h.keyA, "GET", "/v2/templates?limit=1")
	if len(list) != 1 || resp.Header.Get("X-Next-Token") == "" {
		t.Fatalf("page 1: %v next %q", list, resp.Header.Get("X-Next-Token"))
	}
	_, list2 := h.getList(h.keyA, "GET", "/v2/templates?limit=1&nextToken="+resp.Header.Get("X-Next-Token"))
	if len(list2) != 1 || list2[0]["templateID"] != t2 {
		t.Fatalf("page 2: %v", list2)
	}
	if _, list := h.getList(h.keyB, "GET", "/v2/templates"); len(list) != 0 {
		t.Fatalf("another principal's list: %v", list)
	}
	if _, list := h.getList(h.keyA, "GET", "/v2/templates?teamID=team-a"); len(list) != 2 {
		t.Fatalf("own teamID: %v", list)
	}
	w, m := h.do(h.keyA, "GET", "/v2/templates?teamID=team-b", "")
	wantStatus(t, "other teamID", w.Code, m, 403, "teamID")
	w, m = h.do(h.keyA, "GET", "/v2/templates?limit=-1", "")
	wantStatus(t, "bad limit", w.Code, m, 400, "limit")
	// A start counts in spawnCount and lastSpawnedAt.
	h.api.extraImages = []string{}
	for _, tm := range list {
		h.api.extraImages = append(h.api.extraImages, tplImagePrefix+tm["templateID"].(string)+":"+tm["buildID"].(string))
	}
	if w, _ := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"one"}`); w.Code != 201 {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	_, list = h.getList(h.keyA, "GET", "/v2/templates")
	if list[0]["spawnCount"] != float64(1) || list[0]["lastSpawnedAt"] == nil || list[1]["lastSpawnedAt"] != nil {
		t.Fatalf("after a start: %v", list)
	}
}

// The build logs route pages the build's stored log by E2B's cursor,
// direction, level and limit; bad parameters are 400 naming them.
func TestTemplateBuildLogsRoute(t *testing.T) {
	h, _ := newBuildHarness(t)
	tid, bid, w, _ := h.startBuild("logs", `{"fromImage":"root/busybox","steps":[{"type":"RUN","args":["echo one"]},{"type":"RUN","args":["echo no; exit 3"]}]}`)
	if w.Code != 202 {
		t.Fatalf("start: %d", w.Code)
	}
	_, all := h.waitBuild(h.keyA, tid, bid)
	path := "/templates/" + tid + "/builds/" + bid + "/logs"
	logsOf := func(q string) []map[string]any {
		t.Helper()
		w, m := h.do(h.keyA, "GET", path+q, "")
		if w.Code != 200 {
			t.Fatalf("logs%s: %d %s", q, w.Code, w.Body)
		}
		var out []map[string]any
		for _, e := range m["logs"].([]any) {
			out = append(out, e.(map[string]any))
		}
		return out
	}
	got := logsOf("")
	if len(got) != min(len(all), 100) || got[0]["message"] != all[0]["message"] || got[len(got)-1]["message"] != all[len(got)-1]["message"] {
		t.Fatalf("logs %v; want the status route's %v", got, all)
	}
	if back := logsOf("?direction=backward&limit=2"); len(back) != 2 || back[0]["message"] != all[len(all)-1]["message"] || back[1]["message"] != all[len(all)-2]["message"] {
		t.Fatalf("backward: %v", back)
	}
	errs := logsOf("?level=error&source=persistent")
	if len(errs) == 0 {
		t.Fatalf("no error entries in %v", all)
	}
	for _, e := range errs {
		if e["level"] != "error" {
			t.Fatalf("level=error kept %v", e)
		}
	}
	warnUp := logsOf("?level=warn")
	if len(warnUp) < len(errs) || len(warnUp) >= len(all) {
		t.Fatalf("level=warn kept %d of %d (errors %d)", len(warnUp), len(all), len(errs))
	}
	future := time.Now().Add(time.Hour).UnixMilli()
	if l := logsOf(fmt.Sprintf("?cursor=%d", future)); len(l) != 0 {
		t.Fatalf("forward from the future: %v", l)
	}
	if l := logsOf(fmt.Sprintf("?cursor=%d&direction=backward", future)); len(l) != len(all) {
		t.Fatalf("backward from the future: %d of %d", len(l), len(all))
	}
	if l := logsOf("?cursor=0&limit=1"); len(l) != 1 || l[0]["message"] != all[0]["message"] {
		t.Fatalf("forward from 0, limit 1: %v", l)
	}
	for q, field := range map[string]string{
		"?direction=up": "direction", "?level=trace": "level", "?source=disk": "source",
		"?cursor=x": "cursor", "?cursor=-5": "cursor", "?limit=0": "limit", "?limit=1001": "limit",
	} {
		w, m := h.do(h.keyA, "GET", path+q, "")
		wantStatus(t, q, w.Code, m, 400, field)
	}
	for _, c := range []struct{ key, path string }{
		{h.keyB, path},
		{h.keyA, "/templates/" + tid + "/builds/00000000-0000-4000-8000-000000000000/logs"},
		{h.keyA, "/templates/nope/builds/" + bid + "/logs"},
	} {
		w, m := h.do(c.key, "GET", c.path, "")
		wantStatus(t, c.path, w.Code, m, 404, "not found")
	}
}

// GET /teams is the key's principal and nothing else.
func TestTeams(t *testing.T) {
	h := newHarness(t)
	for key, team := range map[string]string{h.keyA: "team-a", h.keyB: "team-b"} {
		resp, list := h.getList(key, "GET", "/teams")
		if resp.StatusCode != 200 || len(list) != 1 || list[0]["teamID"] != team || list[0]["name"] != team || list[0]["apiKey"] != key || list[0]["isDefault"] != true {
			t.Fatalf("teams of %s: %d %v", team, resp.StatusCode, list)
		}
	}
	if w, _ := h.do("", "GET", "/teams", ""); w.Code != 401 {
		t.Fatalf("teams without a key: %d", w.Code)
	}
}

// Secrets and volumes answer 501 saying what to use instead.
func TestSecretsVolumesSayWhatInstead(t *testing.T) {
	h := newHarness(t)
	for path, want := range map[string]string{"/secrets": "envVars", "/secrets/s1": "envVars", "/volumes": "snapshot", "/volumes/v1": "snapshot"} {
		w, m := h.do(h.keyA, "GET", path, "")
		wantStatus(t, path, w.Code, m, 501, want)
	}
}

// The sandbox logs routes answer E2B's SandboxLogs and
// SandboxLogsV2Response from the sandbox's start and its trajectory log's
// calls, with E2B's query parameters; another principal's or an unknown
// sandbox is 404, bad parameters 400 naming them.
func TestSandboxLogs(t *testing.T) {
	h := newHarness(t)
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if w.Code != 201 {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	id := m["sandboxID"].(string)
	t0 := h.api.sbs[id].GetCreatedAt().AsTime()
	ts := func(s int) *timestamppb.Timestamp { return timestamppb.New(t0.Add(time.Duration(s) * time.Second)) }
	calls := []*v1.TrajectoryEntry{
		{CallId: "c1", Kind: "exec", State: "done", Command: []string{"/bin/sh", "-c", "echo hi"}, User: "user", Cwd: "/home/user", Pid: 42, Started: ts(1), Ended: ts(2), ExitCode: 0},
		{CallId: "c2", Kind: "file_write", State: "done", Path: "/home/user/a.txt", Size: 5, Started: ts(3), Ended: ts(3)},
		{CallId: "c3", Kind: "exec", State: "done", Command: []string{"sleep", "99"}, Started: ts(4), Ended: ts(5), ErrorCode: "deadline_exceeded", Error: "the command timed out"},
		{CallId: "c4", Kind: "code", State: "running", Started: ts(6)},
	}
	var asked []string
	h.gw.trajectory = func(ctx context.Context, sid string) ([]*v1.TrajectoryEntry, bool, error) {
		asked = append(asked, principal(ctx)+" "+sid)
		return calls, true, nil
	}
	get := func(key, q string) (int, map[string]any) {
		t.Helper()
		w, m := h.do(key, "GET", q, "")
		return w.Code, m
	}
	code, m := get(h.keyA, "/v2/sandboxes/"+id+"/logs")
	logs := m["logs"].([]any)
	var msgs []string
	for _, l := range logs {
		e := l.(map[string]any)
		if _, ok := e["fields"].(map[string]any); !ok || e["timestamp"] == nil || e["level"] == nil {
			t.Fatalf("entry %v", e)
		}
		msgs = append(msgs, e["message"].(string))
	}
	want := []string{
		"sandbox started from template base",
		`process "/bin/sh -c echo hi" started`, `process "/bin/sh -c echo hi" ended with exit code 0`,
		"file write /home/user/a.txt started", "file write /home/user/a.txt done (5 bytes)",
		`process "sleep 99" started`, `process "sleep 99" failed: the command timed out`,
		"code execution started",
	}
	if code != 200 || !slices.Equal(msgs, want) {
		t.Fatalf("v2 logs: %d\n got %q\nwant %q", code, msgs, want)
	}
	if f := logs[2].(map[string]any)["fields"].(map[string]any); f["exitCode"] != "0" || f["pid"] != "42" || f["user"] != "user" || f["callID"] != "c1" {
		t.Fatalf("fields %v", f)
	}
	if len(asked) != 1 || asked[0] != "team-a "+id {
		t.Fatalf("trajectory read as %q", asked)
	}
	if _, m := get(h.keyA, "/v2/sandboxes/"+id+"/logs?level=error"); len(m["logs"].([]any)) != 1 {
		t.Fatalf("level=error: %v", m)
	}
	_, m = get(h.keyA, "/v2/sandboxes/"+id+"/logs?direction=backward&limit=2")
	if l := m["logs"].([]any); len(l) != 2 || l[0].(map[string]any)["message"] != want[7] || l[1].(map[string]any)["message"] != want[6] {
		t.Fatalf("backward limit 2: %v", m)
	}
	_, m = get(h.keyA, fmt.Sprintf("/v2/sandboxes/%s/logs?cursor=%d", id, t0.Add(4*time.Second).UnixMilli()))
	if l := m["logs"].([]any); len(l) != 3 || l[0].(map[string]any)["message"] != want[5] {
		t.Fatalf("cursor: %v", m)
	}
	_, m = get(h.keyA, "/v2/sandboxes/"+id+"/logs?search=a.txt")
	if l := m["logs"].([]any); len(l) != 2 {
		t.Fatalf("search: %v", m)
	}
	code, m = get(h.keyA, fmt.Sprintf("/sandboxes/%s/logs?start=%d&limit=2", id, t0.Add(time.Second).UnixMilli()))
	ll, le := m["logs"].([]any), m["logEntries"].([]any)
	if code != 200 || len(ll) != 2 || len(le) != 2 || le[1].(map[string]any)["message"] != want[2] {
		t.Fatalf("v1 logs: %d %v", code, m)
	}
	// A v1 line is a JSON object (the e2b CLI parses it): level, logger,
	// message and the fields.
	var line map[string]string
	if err := json.Unmarshal([]byte(ll[0].(map[string]any)["line"].(string)), &line); err != nil || line["message"] != want[1] ||
		line["level"] != "info" || line["logger"] != "opendsec" || line["callID"] != "c1" {
		t.Fatalf("v1 line %v: %v", ll[0], err)
	}
	for _, c := range []struct{ key, path string }{
		{h.keyB, "/v2/sandboxes/" + id + "/logs"},
		{h.keyB, "/sandboxes/" + id + "/logs"},
		{h.keyA, "/v2/sandboxes/n001aaaaaaaaaaaaaaaa/logs"},
		{h.keyA, "/sandboxes/n001aaaaaaaaaaaaaaaa/logs"},
	} {
		code, m := get(c.key, c.path)
		wantStatus(t, c.path, code, m, 404, "not found")
	}
	for q, field := range map[string]string{
		"/v2/sandboxes/%s/logs?direction=sideways": "direction", "/v2/sandboxes/%s/logs?level=loud": "level",
		"/v2/sandboxes/%s/logs?cursor=soon": "cursor", "/v2/sandboxes/%s/logs?limit=5000": "limit",
		"/sandboxes/%s/logs?start=-1": "start", "/sandboxes/%s/logs?limit=x": "limit",
	} {
		code, m := get(h.keyA, fmt.Sprintf(q, id))
		wantStatus(t, q, code, m, 400, field)
	}
	if len(asked) != 6 {
		t.Fatalf("the trajectory was read %d times; refused requests must not read it", len(asked))
	}
	// A log that cannot be read now: the start and a warning, not a 500.
	h.gw.trajectory = func(context.Context, string) ([]*v1.TrajectoryEntry, bool, error) {
		return nil, false, errors.New("dial tcp 10.9.9.9:7001: connection refused")
	}
	code, m = get(h.keyA, "/v2/sandboxes/"+id+"/logs")
	if l := m["logs"].([]any); code != 200 || len(l) != 2 || !strings.Contains(fmt.Sprint(l), "level:warn") || strings.Contains(fmt.Sprint(m), "10.9.9.9") {
		t.Fatalf("unreadable trajectory: %d %v", code, m)
	}
}
