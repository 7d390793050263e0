//go:build linux

package security

import (
	"bytes"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/envdsig"
)

// e2bSandbox is a sandbox made through the E2B gateway's REST API.
type e2bSandbox struct {
	id, accessToken string
}

// e2bCreate makes an E2B sandbox of e's key (secure: envd calls need its
// access token) and stops it when the test ends.
func (e *env) e2bCreate(t *testing.T, secure bool) e2bSandbox {
	t.Helper()
	body := `{"templateID":"root/busybox","timeout":300,"secure":` + strconv.FormatBool(secure) + `}`
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+e.E2BAddr()+"/sandboxes", strings.NewReader(body))
	req.Header.Set("X-API-Key", e.e2bKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("E2B create: %d %s", resp.StatusCode, b)
	}
	var c struct {
		SandboxID       string `json:"sandboxID"`
		EnvdAccessToken string `json:"envdAccessToken"`
	}
	if err := json.Unmarshal(b, &c); err != nil || c.SandboxID == "" {
		t.Fatalf("E2B create answer %s: %v", b, err)
	}
	if secure && c.EnvdAccessToken == "" {
		t.Fatalf("secure E2B sandbox without an envdAccessToken: %s", b)
	}
	t.Cleanup(func() { e.c.StopSandbox(t.Context(), c.SandboxID) })
	return e2bSandbox{c.SandboxID, c.EnvdAccessToken}
}

// envd sends a request to sandbox sb's envd (port 49983) through the
// gateway, with the access token tok when not empty, and returns the status
// and body.
func (e *env) envd(t *testing.T, sb e2bSandbox, method, pathAndQuery, tok, contentType string, body io.Reader) (int, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), method, "http://"+e.E2BAddr()+pathAndQuery, body)
	req.Header.Set("E2b-Sandbox-Id", sb.id)
	req.Header.Set("E2b-Sandbox-Port", "49983")
	if tok != "" {
		req.Header.Set("X-Access-Token", tok)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, pathAndQuery, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, string(b)
}

// envdUpload POSTs data as a multipart upload to /files?<q>.
func (e *env) envdUpload(t *testing.T, sb e2bSandbox, q url.Values, tok string, data string) (int, string) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	fw, _ := mw.CreateFormFile("file", "upload")
	io.WriteString(fw, data)
	mw.Close()
	return e.envd(t, sb, http.MethodPost, "/files?"+q.Encode(), tok, mw.FormDataContentType(), &buf)
}

// Held in the red-team pass: envd calls to a secure E2B sandbox need the
// sandbox's own access token, for every route but /health. Package tests:
// internal/e2b (proxy_test.go), internal/agent (withAuth).
func checkE2BAccessToken(t *testing.T, e *env) {
	a, b := e.e2bCreate(t, true), e.e2bCreate(t, true)
	list := func(tok string) (int, string) {
		return e.envd(t, a, http.MethodPost, "/process.Process/List", tok, "application/json", strings.NewReader("{}"))
	}
	if st, body := list(a.accessToken); st != http.StatusOK {
		t.Fatalf("process list with the access token: %d %s", st, body)
	}
	for name, tok := range map[string]string{"none": "", "wrong": "not-the-token", "another sandbox's": b.accessToken} {
		if st, body := list(tok); st != http.StatusUnauthorized {
			t.Errorf("process list with %s token: %d %s, want 401", name, st, body)
		}
		if st, body := e.envd(t, a, http.MethodGet, "/files?path=/etc/hostname", tok, "", nil); st != http.StatusUnauthorized {
			t.Errorf("file read with %s token: %d %s, want 401", name, st, body)
		}
		if st, body := e.envdUpload(t, a, url.Values{"path": {"/tmp/x"}}, tok, "x"); st != http.StatusUnauthorized {
			t.Errorf("file write with %s token: %d %s, want 401", name, st, body)
		}
	}
	if st, body := e.envd(t, a, http.MethodGet, "/health", "", "", nil); st != http.StatusOK && st != http.StatusNoContent {
		t.Errorf("health without a token: %d %s, want it open", st, body)
	}
	// Nothing was written by the refused upload.
	if out := e.sh(t, a.id, "ls /tmp/x 2>/dev/null; echo done"); out != "done\n" {
		t.Errorf("refused upload left a file: %q", out)
	}
}

// Held in the red-team pass: a signed /files URL works only as signed —
// not expired, for its path, operation and user, under the sandbox's own
// token. Package tests: internal/envdsig, internal/e2b.
func checkE2BSignedURL(t *testing.T, e *env) {
	a := e.e2bCreate(t, true)
	e.sh(t, a.id, "echo secret > /tmp/f")
	future := strconv.FormatInt(time.Now().Add(time.Hour).Unix(), 10)
	past := strconv.FormatInt(time.Now().Add(-time.Minute).Unix(), 10)
	signed := func(path, op, user, tok, exp string) url.Values {
		q := url.Values{"path": {path}, "username": {user}, "signature": {envdsig.Sign(path, op, user, tok, exp)}}
		if exp != "" {
			q.Set("signature_expiration", exp)
		}
		return q
	}
	get := func(q url.Values) (int, string) {
		return e.envd(t, a, http.MethodGet, "/files?"+q.Encode(), "", "", nil)
	}
	if st, body := get(signed("/tmp/f", "read", "root", a.accessToken, future)); st != http.StatusOK || body != "secret\n" {
		t.Fatalf("valid signed read: %d %q", st, body)
	}
	tampered := signed("/tmp/f", "read", "root", a.accessToken, future)
	tampered.Set("path", "/etc/shadow")
	wrongOp := signed("/tmp/f", "write", "root", a.accessToken, future)
	longer := signed("/tmp/f", "read", "root", a.accessToken, future)
	longer.Set("signature_expiration", strconv.FormatInt(time.Now().Add(48*time.Hour).Unix(), 10))
	badSig := signed("/tmp/f", "read", "root", a.accessToken, future)
	badSig.Set("signature", "v1_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA")
	for name, q := range map[string]url.Values{
		"expired":          signed("/tmp/f", "read", "root", a.accessToken, past),
		"other path":       tampered,
		"write signature":  wrongOp,
		"moved expiration": longer,
		"forged signature": badSig,
		"signed by no one": signed("/tmp/f", "read", "root", "guessed-token", future),
		"other user": func() url.Values {
			q := signed("/tmp/f", "read", "root", a.accessToken, future)
			q.Set("username", "user")
			return q
		}(),
	} {
		if st, body := get(q); st != http.StatusUnauthorized && st != http.StatusForbidden {
			t.Errorf("%s: %d %q, want 401/403", name, st, body)
		}
	}
	// A signed upload with an expired signature writes nothing.
	if st, body := e.envdUpload(t, a, signed("/tmp/up", "write", "root", a.accessToken, past), "", "x"); st != http.StatusUnauthorized {
		t.Errorf("expired signed upload: %d %s, want 401", st, body)
	}
	if out := e.sh(t, a.id, "ls /tmp/up 2>/dev/null; echo done"); out != "done\n" {
		t.Errorf("refused signed upload left a file: %q", out)
	}
}
