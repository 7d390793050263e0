package node

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// nothingLeft fails t when the node holds a sandbox, a sandbox dir or an
// image hold.
func nothingLeft(t *testing.T, f *fixture, n *Node) {
	t.Helper()
	if _, _, c := n.Usage(); c != 0 {
		t.Fatalf("%d sandboxes after bad input", c)
	}
	if ents, _ := os.ReadDir(filepath.Join(f.cfg.StateDir, "sandboxes")); len(ents) != 0 {
		t.Fatalf("sandbox dirs left behind: %v", ents)
	}
	if h := f.cfg.Images.(images).held(); h != 0 {
		t.Fatalf("%d image holds left behind", h)
	}
}

func wantFieldErr(t *testing.T, what string, err error, field, mention string) {
	t.Helper()
	var fe *errdefs.FieldError
	if !errors.As(err, &fe) || fe.Field != field || !strings.Contains(err.Error(), mention) {
		t.Errorf("%s: got %v, want invalid_argument naming %s and %q", what, err, field, mention)
	}
}

// TestSecurityBadInputRequestID: a request_id over the limit is refused
// naming it, before the sandbox table sees it (a 100 KB key was
// "internal: record sandbox: key too large"); a batch item's key (the
// public limit plus "-<index>") is accepted.
func TestSecurityBadInputRequestID(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	_, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), RequestID: strings.Repeat("r", 100<<10), Spec: specRecord{Image: "x"}})
	wantFieldErr(t, "100 KB request_id", err, "request_id", "at most 144")
	_, err = n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), RequestID: "a\x00b", Spec: specRecord{Image: "x"}})
	wantFieldErr(t, "request_id with NUL", err, "request_id", "control character")
	nothingLeft(t, f, n)
	rid := strings.Repeat("r", sandboxspec.MaxRequestIDLen) + "-32767"
	if _, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), RequestID: rid, Spec: specRecord{Image: "x"}}); err != nil {
		t.Fatalf("batch item key of %d bytes: %v", len(rid), err)
	}
}

// TestSecurityBadInputUnknownUser: a user the image does not have is
// refused at create, naming user (it was accepted, and every exec failed
// later), and the create leaves nothing behind.
func TestSecurityBadInputUnknownUser(t *testing.T) {
	f := newFakeFixture(t)
	layer := f.cfg.Images.(images).layer
	if err := os.MkdirAll(filepath.Join(layer, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(layer, "etc", "passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	n := f.open(t)
	_, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "x", User: "nosuchuser"}})
	wantFieldErr(t, "unknown user", err, "user", `"nosuchuser" does not exist in image x (not in its /etc/passwd)`)
	nothingLeft(t, f, n)
	for _, u := range []string{"user", "root", ""} {
		if _, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "x", User: u}}); err != nil {
			t.Errorf("user %q the image has: %v", u, err)
		}
	}
}

// TestImageUserLayers: the user is looked up in /etc/passwd as the
// layers stack: the topmost layer that has the file decides.
func TestImageUserLayers(t *testing.T) {
	layer := func(files map[string]string) string {
		d := t.TempDir()
		for p, c := range files {
			if err := os.MkdirAll(filepath.Join(d, filepath.Dir(p)), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(d, p), []byte(c), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	img := func(dirs ...string) runtime.Image {
		var ls []runtime.Layer
		for _, d := range dirs {
			ls = append(ls, runtime.Layer{Format: runtime.LayerDir, Path: d})
		}
		return runtime.Image{Rootfs: runtime.Rootfs{Image: "img", Layers: ls}}
	}
	withAlice := layer(map[string]string{"etc/passwd": "root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n"})
	withoutAlice := layer(map[string]string{"etc/passwd": "root:x:0:0::/root:/bin/sh\nbob:x:1001:1001::/home/bob:/bin/sh\n"})
	noEtc := layer(map[string]string{"bin/sh": ""})
	etcFile := layer(map[string]string{"etc": "not a dir"})
	for _, tc := range []struct {
		name string
		img  runtime.Image
		user string
		ok   bool
	}{
		{"in passwd", img(withAlice), "alice", true},
		{"not in passwd", img(withAlice), "carol", false},
		{"upper passwd decides", img(withoutAlice, withAlice), "alice", false},
		{"lower passwd shows through", img(noEtc, withAlice), "alice", true},
		{"no passwd: root only", img(noEtc), "alice", false},
		{"no passwd: root", img(noEtc), "root", true},
		{"etc hidden by a file", img(etcFile, withAlice), "alice", false},
	} {
		err := checkImageUser(t.Context(), tc.img, "h", tc.user)
		if tc.ok && err != nil || !tc.ok && !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: user %q: %v, want ok=%v", tc.name, tc.user, err, tc.ok)
		}
	}
}

// TestSecurityBadInputUploadTooLarge: a POST /files (E2B's upload route)
// over the upload limit is 413 naming the limit, before any data reaches
// the agent; the agent, which answered without reading the body, made
// the proxy's write fail ("503 agent unreachable: broken pipe").
func TestSecurityBadInputUploadTooLarge(t *testing.T) {
	f := newFakeFixture(t)
	f.cfg.MaxUploadBytes = 1 << 20
	n := f.open(t)
	rec, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "x"}})
	if err != nil {
		t.Fatal(err)
	}
	body := &countingReader{n: 2 << 20}
	req := httptest.NewRequest(http.MethodPost, AgentPrefix+rec.ID+"/files?path=/tmp/big", body)
	req.ContentLength = 2 << 20
	w := httptest.NewRecorder()
	n.AgentProxy().ServeHTTP(w, req)
	if w.Code != http.StatusRequestEntityTooLarge || !strings.Contains(w.Body.String(), "upload of 2097152 bytes exceeds the limit of 1048576 bytes (node.max_upload_mb)") {
		t.Errorf("2 MiB POST /files: %d %s, want 413 naming the limit", w.Code, w.Body)
	}
	if body.read != 0 {
		t.Errorf("%d bytes of the refused upload were read", body.read)
	}
	// Within the limit it goes to the agent.
	req = httptest.NewRequest(http.MethodPost, AgentPrefix+rec.ID+"/files?path=/tmp/ok", strings.NewReader("hello"))
	w = httptest.NewRecorder()
	n.AgentProxy().ServeHTTP(w, req)
	if w.Code == http.StatusRequestEntityTooLarge {
		t.Errorf("5-byte POST /files refused: %d %s", w.Code, w.Body)
	}
}

type countingReader struct{ n, read int }

func (c *countingReader) Read(p []byte) (int, error) {
	if c.read >= c.n {
		return 0, io.EOF
	}
	k := min(len(p), c.n-c.read)
	c.read += k
	return k, nil
}

// TestAgentProxyUploadSendsNoInterimResponse: the proxy asks the agent for
// 100-continue on uploads; that interim answer is the proxy's own and must
// not reach a client that never asked (E2B's JS SDK failed every upload).
func TestAgentProxyUploadSendsNoInterimResponse(t *testing.T) {
	f := newFakeFixture(t)
	f.cfg.MaxUploadBytes = 1 << 20
	n := f.open(t)
	rec, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "x"}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(n.AgentProxy())
	defer srv.Close()
	var interim []int
	ctx := httptrace.WithClientTrace(t.Context(), &httptrace.ClientTrace{Got1xxResponse: func(code int, _ textproto.MIMEHeader) error {
		interim = append(interim, code)
		return nil
	}})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+AgentPrefix+rec.ID+"/files?path=/tmp/ok", strings.NewReader("hello"))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || len(interim) != 0 {
		t.Fatalf("upload: status %d, interim responses %v; want 200 and none", resp.StatusCode, interim)
	}
}
