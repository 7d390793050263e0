package e2b

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerfile/shell"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// fakeBuilder plays the image service's build: each Dockerfile line is a
// step; a RUN whose command contains "exit 3" prints "boom" and fails.
type fakeBuilder struct {
	mu      sync.Mutex
	reqs    []ImageBuildRequest
	context [][]byte
	images  map[string]bool
	removed []string
}

func (f *fakeBuilder) BuildImage(_ context.Context, req ImageBuildRequest, emit func(BuildEvent)) error {
	var ctxb []byte
	if req.Context != nil {
		ctxb, _ = io.ReadAll(req.Context)
	}
	f.mu.Lock()
	f.reqs = append(f.reqs, req)
	f.context = append(f.context, ctxb)
	f.mu.Unlock()
	lines := strings.Split(strings.TrimSpace(req.Dockerfile), "\n")
	if strings.Contains(lines[0], "unreachable") {
		return fmt.Errorf("dial tcp 10.1.2.3:7001: connection refused")
	}
	if strings.Contains(lines[0], "no-such-image") {
		emit(BuildEvent{Step: 1, Steps: len(lines), Instruction: lines[0]})
		return errdefs.Invalid("dockerfile", "line 1: FROM no-such-image: no such image in the store and no earlier stage of that name; import it first (`opendsecctl image import`)")
	}
	for i, l := range lines {
		emit(BuildEvent{Step: i + 1, Steps: len(lines), Instruction: l})
		if strings.HasPrefix(l, "RUN") && strings.Contains(l, "exit 3") {
			emit(BuildEvent{Step: i + 1, Stream: "stderr", Data: []byte("bo")})
			emit(BuildEvent{Step: i + 1, Stream: "stderr", Data: []byte("om\n")})
			return errdefs.Invalid("dockerfile", "line %d: %s: the command exited with code 3; its output ended with:\nboom", i+1, l)
		}
		emit(BuildEvent{Step: i + 1, Steps: len(lines), Instruction: l, Done: true})
	}
	f.mu.Lock()
	if f.images == nil {
		f.images = map[string]bool{}
	}
	f.images[req.Name] = true
	f.mu.Unlock()
	return nil
}

func (f *fakeBuilder) RemoveImage(_ context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.removed = append(f.removed, name)
	delete(f.images, name)
	return nil
}

func (f *fakeBuilder) last() (ImageBuildRequest, []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reqs[len(f.reqs)-1], f.context[len(f.context)-1]
}

func newBuildHarness(t *testing.T) (*harness, *fakeBuilder) {
	t.Helper()
	h := newHarness(t)
	fb := &fakeBuilder{}
	h.gw.cfg.Builder = fb
	h.gw.cfg.StateDir = t.TempDir()
	h.gw.api = h.gw.apiMux()
	// Builds write the template store: done before the test's dirs go.
	t.Cleanup(h.gw.builds.Wait)
	// The fake API starts the images template builds make.
	return h, fb
}

// sdkFilesHash is the Python SDK's calculate_files_hash over dir (the
// context), for the files under src: an independent copy of its rules.
func sdkFilesHash(t *testing.T, dir, src, dest string) string {
	t.Helper()
	return sdkFilesHashDirSize(t, dir, src, dest, -1)
}

// sdkFilesHashDirSize is the JS SDK's rule when dirSize >= 0: directories'
// sizes are hashed too.
func sdkFilesHashDirSize(t *testing.T, dir, src, dest string, dirSize int64) string {
	t.Helper()
	h := sha256.New()
	fmt.Fprintf(h, "COPY %s %s", src, dest)
	var files []string
	root := filepath.Join(dir, src)
	_ = filepath.Walk(root, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, p)
		return nil
	})
	for _, f := range files {
		rel, _ := filepath.Rel(dir, f)
		h.Write([]byte(rel))
		fi, err := os.Lstat(f)
		if err != nil {
			t.Fatal(err)
		}
		mode := uint32(fi.Mode().Perm())
		switch {
		case fi.IsDir():
			h.Write([]byte(fmt.Sprint(0o040000 | mode)))
			if dirSize >= 0 {
				h.Write([]byte(fmt.Sprint(dirSize)))
			}
		case fi.Mode()&os.ModeSymlink != 0:
			target, _ := os.Readlink(f)
			h.Write([]byte(fmt.Sprint(0o120000 | 0o777)))
			h.Write([]byte(fmt.Sprint(fi.Size())))
			h.Write([]byte(target))
		default:
			h.Write([]byte(fmt.Sprint(0o100000 | mode)))
			h.Write([]byte(fmt.Sprint(fi.Size())))
			b, _ := os.ReadFile(f)
			h.Write(b)
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

// sdkTar is the SDK's upload: a gzipped tar of src's files, names
// relative to dir, directories with a trailing slash.
func sdkTar(t *testing.T, dir, src string) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	_ = filepath.Walk(filepath.Join(dir, src), func(p string, fi os.FileInfo, _ error) error {
		rel, _ := filepath.Rel(dir, p)
		link := ""
		if fi.Mode()&os.ModeSymlink != 0 {
			link, _ = os.Readlink(p)
		}
		hd, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			t.Fatal(err)
		}
		hd.Name = rel
		if fi.IsDir() {
			hd.Name += "/"
		}
		if err := tw.WriteHeader(hd); err != nil {
			t.Fatal(err)
		}
		if fi.Mode().IsRegular() {
			b, _ := os.ReadFile(p)
			_, _ = tw.Write(b)
		}
		return nil
	})
	_ = tw.Close()
	_ = zw.Close()
	return buf.Bytes()
}

func (h *harness) put(rawURL string, body []byte) *httptest.ResponseRecorder {
	h.t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		h.t.Fatal(err)
	}
	req := httptest.NewRequest("PUT", u.RequestURI(), bytes.NewReader(body))
	req.ContentLength = int64(len(body))
	w := httptest.NewRecorder()
	h.gw.ServeHTTP(w, req)
	return w
}

// waitBuild polls a build's status until it ends and returns the last
// answer and every log entry.
func (h *harness) waitBuild(key, tid, bid string) (map[string]any, []map[string]any) {
	h.t.Helper()
	var logs []map[string]any
	for i := 0; i < 500; i++ {
		w, m := h.do(key, "GET", fmt.Sprintf("/templates/%s/builds/%s/status?logsOffset=%d", tid, bid, len(logs)), "")
		if w.Code != 200 {
			h.t.Fatalf("status: %d %s", w.Code, w.Body)
		}
		for _, e := range m["logEntries"].([]any) {
			logs = append(logs, e.(map[string]any))
		}
		if s := m["status"]; s == buildReady || s == buildError {
			return m, logs
		}
		time.Sleep(10 * time.Millisecond)
	}
	h.t.Fatal("build did not end")
	return nil, nil
}

func TestTemplateBuildEndToEnd(t *testing.T) {
	h, fb := newBuildHarness(t)
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "app", "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "app", "sub", "hello.txt"), []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("sub/hello.txt", filepath.Join(dir, "app", "link")); err != nil {
		t.Fatal(err)
	}
	hash := sdkFilesHash(t, dir, "app", "/opt/app/")

	w, m := h.do(h.keyA, "POST", "/v3/templates", `{"name":"my-tpl","cpuCount":2,"memoryMB":1024}`)
	if w.Code != http.StatusAccepted {
		t.Fatalf("request build: %d %s", w.Code, w.Body)
	}
	tid, bid := m["templateID"].(string), m["buildID"].(string)
	if m["public"] != false || fmt.Sprint(m["names"]) != "[my-tpl]" || fmt.Sprint(m["tags"]) != "[default]" || len(bid) != 36 {
		t.Fatalf("request build: %v", m)
	}
	// Another principal sees nothing of it.
	if w, _ := h.do(h.keyB, "GET", "/templates/"+tid+"/files/"+hash, ""); w.Code != 404 {
		t.Fatalf("files as B: %d", w.Code)
	}
	w, m = h.do(h.keyA, "GET", "/templates/"+tid+"/files/"+hash, "")
	if w.Code != http.StatusCreated || m["present"] != false || m["url"] == nil {
		t.Fatalf("files: %d %s", w.Code, w.Body)
	}
	up := m["url"].(string)
	if pw := h.put(strings.Replace(up, "signature=", "signature=0", 1), sdkTar(t, dir, "app")); pw.Code != http.StatusForbidden {
		t.Fatalf("put with a bad signature: %d %s", pw.Code, pw.Body)
	}
	if pw := h.put(up, []byte("not a tar at all, not at all, not at all................")); pw.Code != http.StatusBadRequest {
		t.Fatalf("put of garbage: %d %s", pw.Code, pw.Body)
	}
	if pw := h.put(up, sdkTar(t, dir, "app")); pw.Code != http.StatusOK {
		t.Fatalf("put: %d %s", pw.Code, pw.Body)
	}
	if _, m := h.do(h.keyA, "GET", "/templates/"+tid+"/files/"+hash, ""); m["present"] != true {
		t.Fatalf("files after upload: %v", m)
	}
	// Not started yet: waiting.
	if _, m := h.do(h.keyA, "GET", "/templates/"+tid+"/builds/"+bid+"/status", ""); m["status"] != buildWaiting {
		t.Fatalf("status before start: %v", m)
	}
	body := fmt.Sprintf(`{"fromTemplate":"base","force":false,"steps":[
		{"type":"RUN","args":["echo hi && mkdir -p /opt/app","root"],"force":false},
		{"type":"COPY","args":["app","/opt/app/","",""],"filesHash":%q,"force":false},
		{"type":"ENV","args":["GREETING","hello \"world\" $HOME","B","2"],"force":false},
		{"type":"WORKDIR","args":["/opt/app"],"force":false},
		{"type":"USER","args":["root"],"force":false}]}`, hash)
	if w, _ := h.do(h.keyB, "POST", "/v2/templates/"+tid+"/builds/"+bid, body); w.Code != 404 {
		t.Fatalf("start as B: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "POST", "/v2/templates/"+tid+"/builds/"+bid, body); w.Code != http.StatusAccepted {
		t.Fatalf("start: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "POST", "/v2/templates/"+tid+"/builds/"+bid, body); w.Code != http.StatusConflict {
		t.Fatalf("second start: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyB, "GET", "/templates/"+tid+"/builds/"+bid+"/status", ""); w.Code != 404 {
		t.Fatalf("status as B: %d %s", w.Code, w.Body)
	}
	st, logs := h.waitBuild(h.keyA, tid, bid)
	if st["status"] != buildReady {
		t.Fatalf("build: %v %v", st, logs)
	}
	req, ctxTar := fb.last()
	if req.Name != tplImagePrefix+tid+":"+bid || req.StartCmd != "" {
		t.Fatalf("build request %+v", req)
	}
	// The generated Dockerfile parses with BuildKit's parser into what the
	// steps said.
	res, err := parser.Parse(strings.NewReader(req.Dockerfile))
	if err != nil {
		t.Fatal(err)
	}
	stages, _, err := instructions.Parse(res.AST, nil)
	if err != nil {
		t.Fatalf("%v\n%s", err, req.Dockerfile)
	}
	if stages[0].BaseName != DefaultImage {
		t.Fatalf("FROM %s", stages[0].BaseName)
	}
	var env *instructions.EnvCommand
	var wd *instructions.WorkdirCommand
	for _, c := range stages[0].Commands {
		switch c := c.(type) {
		case *instructions.EnvCommand:
			env = c
		case *instructions.WorkdirCommand:
			wd = c
		}
	}
	if env == nil || env.Env[0].Key != "GREETING" || wd == nil {
		t.Fatalf("Dockerfile:\n%s", req.Dockerfile)
	}
	if !strings.Contains(req.Dockerfile, `COPY --chown=user ["files/`+hash+`/app","/opt/app/"]`) ||
		!strings.Contains(req.Dockerfile, "USER root\nRUN [\"/bin/sh\",\"-c\",\"echo hi \\u0026\\u0026 mkdir -p /opt/app\"]\nUSER user\n") {
		t.Fatalf("Dockerfile:\n%s", req.Dockerfile)
	}
	// The context holds the upload under files/<hash>/.
	names := map[string]bool{}
	tr := tar.NewReader(bytes.NewReader(ctxTar))
	for {
		hd, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names[hd.Name] = true
	}
	if !names["files/"+hash+"/app/sub/hello.txt"] || !names["files/"+hash+"/app/link"] {
		t.Fatalf("context: %v", names)
	}
	var sawStep bool
	for _, e := range logs {
		if e["step"] == "1" && strings.Contains(e["message"].(string), "RUN") {
			sawStep = true
		}
	}
	if !sawStep {
		t.Fatalf("logs: %v", logs)
	}

	// Sandboxes of it: its image, user and workdir.
	h.api.extraImages = []string{req.Name}
	for _, ref := range []string{"my-tpl", "my-tpl:default", tid} {
		w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"`+ref+`"}`)
		if w.Code != http.StatusCreated {
			t.Fatalf("create from %s: %d %s", ref, w.Code, w.Body)
		}
		spec := h.api.sbs[m["sandboxID"].(string)].GetSpec()
		if spec.GetImage() != req.Name || spec.GetWorkdir() != "/opt/app" || spec.GetUser() != "root" || spec.GetCpu() != 2 || spec.GetMemoryMb() != 1024 {
			t.Fatalf("spec %v", spec)
		}
	}
	// Not for another principal, by name or by image.
	for _, ref := range []string{"my-tpl", req.Name, tid} {
		if w, _ := h.do(h.keyB, "POST", "/v2/sandboxes", `{"templateID":"`+ref+`"}`); w.Code != 404 {
			t.Fatalf("create from %s as B: %d %s", ref, w.Code, w.Body)
		}
		if w, _ := h.do(h.keyB, "GET", "/templates/aliases/"+url.PathEscape(ref), ""); w.Code != 404 {
			t.Fatalf("alias %s as B: %d", ref, w.Code)
		}
	}
	if w, m := h.do(h.keyA, "GET", "/templates/aliases/my-tpl", ""); w.Code != 200 || m["public"] != false {
		t.Fatalf("alias: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "GET", "/templates/aliases/base", ""); w.Code != 200 {
		t.Fatalf("alias base: %d", w.Code)
	}

	// Tags.
	if w, m := h.do(h.keyA, "POST", "/templates/tags", `{"target":"my-tpl:default","tags":["v1","prod"]}`); w.Code != 201 || m["buildID"] != bid {
		t.Fatalf("assign tags: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyB, "POST", "/templates/tags", `{"target":"my-tpl:default","tags":["x"]}`); w.Code != 404 {
		t.Fatalf("assign tags as B: %d", w.Code)
	}
	w, _ = h.do(h.keyA, "GET", "/templates/my-tpl/tags", "")
	if w.Code != 200 || !strings.Contains(w.Body.String(), `"tag":"prod"`) || !strings.Contains(w.Body.String(), `"tag":"v1"`) {
		t.Fatalf("tags: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"my-tpl:v1"}`); w.Code != 201 {
		t.Fatalf("create from my-tpl:v1: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "DELETE", "/templates/tags", `{"name":"my-tpl","tags":["v1"]}`); w.Code != 204 {
		t.Fatalf("delete tag: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"my-tpl:v1"}`); w.Code != 404 {
		t.Fatalf("create from a removed tag: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "DELETE", "/templates/tags", `{"name":"my-tpl","tags":["nope"]}`); w.Code != 404 {
		t.Fatalf("delete unknown tag: %d", w.Code)
	}

	// List: only the owner's.
	if w, _ := h.do(h.keyA, "GET", "/templates", ""); w.Code != 200 || !strings.Contains(w.Body.String(), tid) {
		t.Fatalf("list: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyB, "GET", "/templates", ""); w.Code != 200 || strings.TrimSpace(w.Body.String()) != "[]" {
		t.Fatalf("list as B: %d %s", w.Code, w.Body)
	}

	// A second build of the name takes the default tag; the first build's
	// image stays while tags name it.
	w, m = h.do(h.keyA, "POST", "/v3/templates", `{"name":"my-tpl"}`)
	if w.Code != 202 || m["templateID"] != tid {
		t.Fatalf("rebuild: %d %s", w.Code, w.Body)
	}
	bid2 := m["buildID"].(string)
	if w, _ := h.do(h.keyA, "POST", "/v2/templates/"+tid+"/builds/"+bid2, `{"fromTemplate":"my-tpl","steps":[{"type":"RUN","args":["true"]}]}`); w.Code != 202 {
		t.Fatalf("start 2: %d %s", w.Code, w.Body)
	}
	if st, logs := h.waitBuild(h.keyA, tid, bid2); st["status"] != buildReady {
		t.Fatalf("build 2: %v %v", st, logs)
	}
	req2, _ := fb.last()
	if req.NoCache || req2.NoCache {
		t.Fatal("no step asked for force, yet the cache was bypassed")
	}
	if !strings.HasPrefix(req2.Dockerfile, "FROM "+req.Name+"\nRUN") {
		t.Fatalf("from a template of the caller's: its image, its user and workdir kept:\n%s", req2.Dockerfile)
	}
	if len(fb.removed) != 0 {
		t.Fatalf("removed %v while tag prod names it", fb.removed)
	}

	// Delete: B cannot; A removes the record and the images.
	if w, _ := h.do(h.keyB, "DELETE", "/templates/"+tid, ""); w.Code != 404 {
		t.Fatalf("delete as B: %d", w.Code)
	}
	if w, _ := h.do(h.keyA, "DELETE", "/templates/"+tid, ""); w.Code != 204 {
		t.Fatalf("delete: %d %s", w.Code, w.Body)
	}
	if len(fb.removed) != 2 {
		t.Fatalf("removed %v", fb.removed)
	}
	if w, _ := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"my-tpl"}`); w.Code != 404 {
		t.Fatalf("create from a deleted template: %d", w.Code)
	}
}

// start requests a build of name and starts it with body.
func (h *harness) startBuild(name, body string) (tid, bid string, w *httptest.ResponseRecorder, m map[string]any) {
	h.t.Helper()
	w, m = h.do(h.keyA, "POST", "/v3/templates", `{"name":"`+name+`"}`)
	if w.Code != 202 {
		h.t.Fatalf("request build: %d %s", w.Code, w.Body)
	}
	tid, bid = m["templateID"].(string), m["buildID"].(string)
	w, m = h.do(h.keyA, "POST", "/v2/templates/"+tid+"/builds/"+bid, body)
	return tid, bid, w, m
}

func TestTemplateBuildBadInput(t *testing.T) {
	h, fb := newBuildHarness(t)
	for _, c := range []struct{ body, want string }{
		{`{"fromImage":"root/busybox","fromTemplate":"base"}`, "exactly one of fromImage and fromTemplate"},
		{`{}`, "exactly one of fromImage and fromTemplate"},
		{`{"fromImage":"root/busybox","steps":[{"type":"FROBNICATE","args":["x"]}]}`, `steps[0]: type "FROBNICATE" is not a step type`},
		{`{"fromImage":"root/busybox","steps":[{"type":"ENV","args":["A"]}]}`, "steps[0]: ENV takes args"},
		{`{"fromImage":"root/busybox","steps":[{"type":"ENV","args":["1A","x"]}]}`, "is not a variable name"},
		{`{"fromImage":"root/busybox","steps":[{"type":"COPY","args":["a","/b"]}]}`, "COPY needs filesHash"},
		{`{"fromImage":"root/busybox","steps":[{"type":"COPY","args":["../a","/b"],"filesHash":"` + strings.Repeat("a", 64) + `"}]}`, "relative path in the context"},
		{`{"fromImage":"root/busybox","steps":[{"type":"COPY","args":["a","/b"],"filesHash":"` + strings.Repeat("a", 64) + `"}]}`, "were not uploaded"},
		{`{"fromImage":"root/busybox","steps":[{"type":"USER","args":["a b"]}]}`, "USER takes args"},
		{`{"fromImage":"root/busybox","fromImageRegistry":{"type":"registry","username":"u","password":"p"}}`, "fromImageRegistry"},
		{`{"fromImage":"e2b-tpl/x:y"}`, "fromImage"},
		{`{"fromImage":"root/busybox","startCmd":"a\nb"}`, "startCmd"},
	} {
		_, _, w, m := h.startBuild("bad", c.body)
		if w.Code != 400 || !strings.Contains(m["message"].(string), c.want) {
			t.Fatalf("%s: %d %s; want 400 with %q", c.body, w.Code, w.Body, c.want)
		}
	}
	// Unknown template or build: 404; a reserved name: 409.
	if w, _ := h.do(h.keyA, "POST", "/v2/templates/tpl-0000000000000000/builds/"+newBuildID(), `{"fromImage":"root/busybox"}`); w.Code != 404 {
		t.Fatalf("unknown template: %d", w.Code)
	}
	w, m := h.do(h.keyA, "POST", "/v3/templates", `{"name":"bad"}`)
	if w, _ := h.do(h.keyA, "POST", "/v2/templates/"+m["templateID"].(string)+"/builds/"+newBuildID(), `{"fromImage":"root/busybox"}`); w.Code != 404 {
		t.Fatalf("unknown build: %d", w.Code)
	}
	for _, body := range []string{`{"name":"base"}`, `{"name":"BAD NAME"}`, `{}`, `{"name":"x","tags":["a b"]}`} {
		if w, _ := h.do(h.keyA, "POST", "/v3/templates", body); w.Code != 400 && w.Code != 409 {
			t.Fatalf("request %s: %d %s", body, w.Code, w.Body)
		}
	}
	_ = w
	if len(fb.reqs) != 0 {
		t.Fatalf("a bad build reached the builder: %v", fb.reqs)
	}

	// A wrong files hash: 400, and the upload is dropped.
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f.txt"), []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	wrong := sdkFilesHash(t, dir, "f.txt", "/elsewhere")
	_, m = h.do(h.keyA, "POST", "/v3/templates", `{"name":"hashy"}`)
	tid, bid := m["templateID"].(string), m["buildID"].(string)
	_, m = h.do(h.keyA, "GET", "/templates/"+tid+"/files/"+wrong, "")
	if pw := h.put(m["url"].(string), sdkTar(t, dir, "f.txt")); pw.Code != 200 {
		t.Fatalf("put: %d %s", pw.Code, pw.Body)
	}
	w, m = h.do(h.keyA, "POST", "/v2/templates/"+tid+"/builds/"+bid,
		`{"fromImage":"root/busybox","steps":[{"type":"COPY","args":["f.txt","/dest"],"filesHash":"`+wrong+`"}]}`)
	if w.Code != 400 || !strings.Contains(m["message"].(string), "does not match the uploaded files") {
		t.Fatalf("wrong hash: %d %s", w.Code, w.Body)
	}
	if _, m := h.do(h.keyA, "GET", "/templates/"+tid+"/files/"+wrong, ""); m["present"] != false {
		t.Fatalf("the wrong upload was kept: %v", m)
	}
	if len(fb.reqs) != 0 {
		t.Fatalf("a bad build reached the builder")
	}
	// An upload over the bound is refused.
	h.gw.cfg.MaxTemplateUpload = 10
	_, m = h.do(h.keyA, "GET", "/templates/"+tid+"/files/"+wrong, "")
	if pw := h.put(m["url"].(string), sdkTar(t, dir, "f.txt")); pw.Code != http.StatusRequestEntityTooLarge {
		t.Fatalf("big put: %d %s", pw.Code, pw.Body)
	}
}

func TestTemplateBuildFailingStep(t *testing.T) {
	h, fb := newBuildHarness(t)
	tid, bid, w, _ := h.startBuild("failing", `{"fromImage":"root/busybox","steps":[
		{"type":"RUN","args":["echo ok"],"force":true},{"type":"RUN","args":["echo no; exit 3"]},{"type":"RUN","args":["echo never"]}]}`)
	if w.Code != 202 {
		t.Fatalf("start: %d %s", w.Code, w.Body)
	}
	st, logs := h.waitBuild(h.keyA, tid, bid)
	if req, _ := fb.last(); !req.NoCache {
		t.Fatal("a step's force did not bypass the build cache")
	}
	reason, _ := st["reason"].(map[string]any)
	if st["status"] != buildError || reason == nil || reason["step"] != "2" || !strings.HasPrefix(reason["message"].(string), "build step 2 failed: RUN echo no; exit 3: the command exited") ||
		!strings.Contains(reason["message"].(string), "exited with code 3") || strings.Contains(reason["message"].(string), "line ") {
		t.Fatalf("status %v", st)
	}
	var boom bool
	for _, e := range logs {
		if e["message"] == "boom" && e["step"] == "2" {
			boom = true
		}
	}
	if !boom {
		t.Fatalf("the failing step's output is not in the log: %v", logs)
	}
	if len(fb.images) != 0 {
		t.Fatalf("images %v", fb.images)
	}
	// Nothing to start: the tag names no build.
	if w, _ := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"failing"}`); w.Code != 404 {
		t.Fatalf("create from a failed build: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "GET", "/templates/aliases/failing", ""); w.Code != 404 {
		t.Fatalf("alias of a failed build: %d", w.Code)
	}
	// A failure that is not the build's: no internals.
	tid, bid, _, _ = h.startBuild("unreach", `{"fromImage":"unreachable"}`)
	st, _ = h.waitBuild(h.keyA, tid, bid)
	reason, _ = st["reason"].(map[string]any)
	if st["status"] != buildError || !strings.Contains(reason["message"].(string), "server error") || strings.Contains(reason["message"].(string), "10.1.2.3") {
		t.Fatalf("status %v", st)
	}
	// A base image the store lacks: the base step, a message without the
	// node's internals.
	tid, bid, _, _ = h.startBuild("nobase", `{"fromImage":"no-such-image"}`)
	st, _ = h.waitBuild(h.keyA, tid, bid)
	reason, _ = st["reason"].(map[string]any)
	if st["status"] != buildError || reason["step"] != stepBase || !strings.Contains(reason["message"].(string), "not in OpenDsec's image store") ||
		strings.Contains(reason["message"].(string), "`") {
		t.Fatalf("status %v", st)
	}
}

// The templates survive a restart of the gateway; a build it was running
// ends in error.
func TestTemplateStorePersists(t *testing.T) {
	dir := t.TempDir()
	s, err := newTplStore(filepath.Join(dir, "templates.json"))
	if err != nil {
		t.Fatal(err)
	}
	s.all["tpl-1"] = &tplRecord{ID: "tpl-1", Owner: "p", Name: "n", Builds: map[string]*tplBuild{
		"b1": {ID: "b1", Status: buildReady, Image: "e2b-tpl/tpl-1:b1"},
		"b2": {ID: "b2", Status: buildBuilding},
	}, Tags: map[string]tagRecord{"default": {BuildID: "b1"}}}
	if err := s.saveLocked(); err != nil {
		t.Fatal(err)
	}
	s2, err := newTplStore(filepath.Join(dir, "templates.json"))
	if err != nil {
		t.Fatal(err)
	}
	if _, b, ok := s2.resolve("p", "n"); !ok || b.Image != "e2b-tpl/tpl-1:b1" {
		t.Fatalf("resolve after restart: %v %v", b, ok)
	}
	if _, _, ok := s2.resolve("q", "n"); ok {
		t.Fatal("another principal resolves it")
	}
	if b := s2.all["tpl-1"].Builds["b2"]; b.Status != buildError || b.Reason == nil {
		t.Fatalf("interrupted build: %+v", b)
	}
}

// Both SDKs' rules verify; anything else does not.
func TestCheckFilesHash(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "d", "e"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "d", "e", "x"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	arch := filepath.Join(t.TempDir(), "a.tar")
	if err := os.WriteFile(arch, sdkTar(t, dir, "d"), 0o600); err != nil {
		t.Fatal(err)
	}
	open := func() (io.ReadCloser, error) { return os.Open(arch) }
	for _, c := range []struct {
		hash string
		ok   bool
	}{
		{sdkFilesHash(t, dir, "d", "/x/"), true},
		{sdkFilesHashDirSize(t, dir, "d", "/x/", 4096), true},
		{sdkFilesHashDirSize(t, dir, "d", "/x/", 17), false},
		{sdkFilesHash(t, dir, "d", "/y/"), false},
	} {
		if got := checkFilesHash(open, "d", "/x/", c.hash); got != c.ok {
			t.Fatalf("hash %s: %v, want %v", c.hash, got, c.ok)
		}
	}
}

// ENV values and WORKDIR paths come out of the builder's expansion as the
// caller wrote them.
func TestDockerfileQuoting(t *testing.T) {
	lex := shell.NewLex('\\')
	for _, v := range []string{`plain`, `a "b" $c`, `back\slash\\`, `${X:-y}`, "tab\there", `'single'`, ``, `\`} {
		res, err := parser.Parse(strings.NewReader("FROM x\nENV K=" + dfQuote(v) + "\nWORKDIR " + dfQuote("/w/"+v) + "\n"))
		if err != nil {
			t.Fatal(err)
		}
		stages, _, err := instructions.Parse(res.AST, nil)
		if err != nil {
			t.Fatalf("%q: %v", v, err)
		}
		env := stages[0].Commands[0].(*instructions.EnvCommand)
		got, _, err := lex.ProcessWord(env.Env[0].Value, shell.EnvsFromSlice([]string{"c=C", "X=Z"}))
		if err != nil || got != v {
			t.Fatalf("ENV %q came out as %q (%v)", v, got, err)
		}
		wd := stages[0].Commands[1].(*instructions.WorkdirCommand)
		got, _, err = lex.ProcessWord(wd.Path, shell.EnvsFromSlice(nil))
		if err != nil || got != "/w/"+v {
			t.Fatalf("WORKDIR %q came out as %q (%v)", "/w/"+v, got, err)
		}
	}
}

// A built template is its ID to E2B: the alias route answers the ID for the
// name (Mastra looks its template up by name, builds it when missing, then
// creates by the ID the build returned and later by the name), and its
// sandboxes report templateID = the ID and alias = the name however the
// create named it, in the create, the detail and the list. A configured
// template (base) is its own ID.
func TestTemplateIDAndAlias(t *testing.T) {
	h, fb := newBuildHarness(t)
	tid, bid, w, _ := h.startBuild("my-tpl", `{"fromImage":"root/busybox","steps":[{"type":"RUN","args":["echo ok"]}]}`)
	if w.Code != 202 {
		t.Fatalf("start: %d %s", w.Code, w.Body)
	}
	if st, _ := h.waitBuild(h.keyA, tid, bid); st["status"] != buildReady {
		t.Fatalf("status %v", st)
	}
	req, _ := fb.last()
	h.api.extraImages = []string{req.Name}
	for ref, want := range map[string]string{"my-tpl": tid, tid: tid, "base": "base"} {
		if w, m := h.do(h.keyA, "GET", "/templates/aliases/"+ref, ""); w.Code != 200 || m["templateID"] != want {
			t.Errorf("alias %s: %d %s, want templateID %s", ref, w.Code, w.Body, want)
		}
	}
	// Another principal learns nothing, not even the ID.
	if w, _ := h.do(h.keyB, "GET", "/templates/aliases/my-tpl", ""); w.Code != 404 || strings.Contains(w.Body.String(), tid) {
		t.Fatalf("alias as B: %d %s", w.Code, w.Body)
	}
	ids := map[string]string{} // sandbox → the alias it must report
	for _, c := range []struct{ ref, id, alias string }{
		{"my-tpl", tid, "my-tpl"}, {"my-tpl:default", tid, "my-tpl"}, {tid, tid, "my-tpl"}, {"base", "base", "base"},
	} {
		w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"`+c.ref+`"}`)
		if w.Code != http.StatusCreated || m["templateID"] != c.id || m["alias"] != c.alias {
			t.Fatalf("create from %s: %d %s, want templateID %s alias %s", c.ref, w.Code, w.Body, c.id, c.alias)
		}
		id := m["sandboxID"].(string)
		if w, m := h.do(h.keyA, "GET", "/sandboxes/"+id, ""); w.Code != 200 || m["templateID"] != c.id || m["alias"] != c.alias {
			t.Fatalf("detail of a sandbox from %s: %d %s", c.ref, w.Code, w.Body)
		}
		ids[id] = c.alias
	}
	_, list := h.doList(h.keyA, "/v2/sandboxes")
	if len(list) != len(ids) {
		t.Fatalf("list: %v", list)
	}
	for _, s := range list {
		alias := ids[s["sandboxID"].(string)]
		if s["alias"] != alias || (alias == "my-tpl") != (s["templateID"] == tid) {
			t.Fatalf("listed %v", s)
		}
	}
	// The list's template filter takes the name or the ID.
	for _, ref := range []string{"my-tpl", tid} {
		if _, l := h.doList(h.keyA, "/v2/sandboxes?template="+ref); len(l) != 3 {
			t.Fatalf("list of template %s: %v", ref, l)
		}
	}
	if _, l := h.doList(h.keyA, "/v2/sandboxes?template=base"); len(l) != 1 {
		t.Fatalf("list of template base: %v", l)
	}
}
