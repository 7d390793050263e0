package daemon

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/testutil"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// ownerSystem is `opendsec up` in this process with the real agent and a
// busybox image, the issuer, and SDK clients for an admin and two users.
type ownerSystem struct {
	*upSystem
	iss               *auth.Issuer
	admin, alice, bob *opendsec.Client
}

func startOwnerSystem(t *testing.T) *ownerSystem {
	t.Helper()
	testutil.RequiresRoot(t)
	agent := testutil.AgentBinary(t)
	rootfs := testutil.BusyboxRootfs(t)
	s := startUpWith(t, false, func(cfg *config.Config) {
		cfg.Node.AgentPath = agent
		cfg.Node.WarmPool.Size = 0
		store, err := image.Open(cfg.Node.ImageDir)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := store.ImportDir(t.Context(), "root/busybox", rootfs, image.Config{}); err != nil {
			t.Fatal(err)
		}
	})
	t.Cleanup(func() { s.stop(t) })
	iss, err := loadIssuer(t.Context(), s.cfg)
	if err != nil {
		t.Fatal(err)
	}
	adminTok, err := EnsureBootstrapToken(s.cfg, iss)
	if err != nil {
		t.Fatal(err)
	}
	client := func(tok string) *opendsec.Client {
		c, err := opendsec.New("http://"+s.api, opendsec.WithToken(tok))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	user := func(name string) *opendsec.Client {
		tok, err := iss.Issue(name, auth.ScopeUser, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		return client(tok)
	}
	o := &ownerSystem{upSystem: s, iss: iss, admin: client(adminTok), alice: user("alice"), bob: user("bob")}
	return o
}

// stopAll stops every sandbox: Up leaves them running at shutdown. Tests
// defer it (t.Context, and with it Up, ends before cleanups run).
func (o *ownerSystem) stopAll(t *testing.T) {
	ctx := context.WithoutCancel(t.Context())
	list, err := o.admin.ListSandboxes(ctx, opendsec.ListFilter{})
	if err != nil {
		t.Errorf("list sandboxes left: %v", err)
	}
	for _, sb := range list {
		if err := o.admin.StopSandbox(ctx, sb.GetId()); err != nil {
			t.Errorf("stop %s: %v", sb.GetId(), err)
		}
	}
}

func ids(sbs []*opendsec.Sandbox) []string {
	var out []string
	for _, sb := range sbs {
		out = append(out, sb.GetId())
	}
	return out
}

// A user token sees and acts on only its own sandboxes: bob cannot get,
// list, exec in, time out, pause (alone or by selector), read the metrics
// of, or stop alice's sandbox, each answering not_found as for a sandbox
// that does not exist; alice can, and an admin sees and stops it. The
// sandbox records alice as its owner.
func TestUserSeesOnlyOwnSandboxes(t *testing.T) {
	s := startOwnerSystem(t)
	defer s.stopAll(t)
	ctx := t.Context()
	sb, err := s.alice.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox", TimeoutSeconds: 300})
	if err != nil {
		t.Fatal(err)
	}
	id := sb.GetId()
	if sb.GetOwner() != "alice" || sb.GetProject() != "" {
		t.Fatalf("owner %q project %q, want alice and no project", sb.GetOwner(), sb.GetProject())
	}

	notFound := func(what string, err error) {
		t.Helper()
		if !opendsec.IsNotFound(err) {
			t.Errorf("bob %s alice's sandbox: err = %v, want not_found", what, err)
		}
	}
	out, err := s.bob.PauseSandboxes(ctx, opendsec.Selector{IDs: []string{id}})
	if err != nil || len(out.Sandboxes) != 0 {
		t.Errorf("bob pauses by selector: %v (%v), want nothing paused", out, err)
	}
	_, err = s.bob.GetSandbox(ctx, id)
	notFound("gets", err)
	_, err = s.bob.RunShell(ctx, id, "echo hi")
	notFound("execs in", err)
	_, err = s.bob.SetTimeout(ctx, id, time.Hour)
	notFound("sets the timeout of", err)
	_, err = s.bob.SandboxMetrics(ctx, id)
	notFound("reads metrics of", err)
	_, err = s.bob.PauseSandbox(ctx, id)
	notFound("pauses", err)
	err = s.bob.StopSandbox(ctx, id)
	notFound("stops", err)
	list, err := s.bob.ListSandboxes(ctx, opendsec.ListFilter{})
	if err != nil || len(list) != 0 {
		t.Errorf("bob lists %v (%v), want nothing", ids(list), err)
	}

	// alice's sandbox is untouched and hers to use.
	got, err := s.alice.GetSandbox(ctx, id)
	if err != nil || got.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("alice gets her sandbox: %v, %v; want it running", got.GetState(), err)
	}
	res, err := s.alice.RunShell(ctx, id, "echo hi")
	if err != nil || strings.TrimSpace(res.Stdout) != "hi" {
		t.Fatalf("alice execs: %+v, %v", res, err)
	}
	list, err = s.alice.ListSandboxes(ctx, opendsec.ListFilter{})
	if err != nil || !slices.Equal(ids(list), []string{id}) {
		t.Fatalf("alice lists %v (%v), want [%s]", ids(list), err, id)
	}

	// An admin sees everyone's.
	list, err = s.admin.ListSandboxes(ctx, opendsec.ListFilter{})
	if err != nil || !slices.Contains(ids(list), id) {
		t.Fatalf("admin lists %v (%v), want %s among them", ids(list), err, id)
	}
	if got, err := s.admin.GetSandbox(ctx, id); err != nil || got.GetOwner() != "alice" {
		t.Fatalf("admin gets: owner %q, %v", got.GetOwner(), err)
	}
	if err := s.admin.StopSandbox(ctx, id); err != nil {
		t.Fatalf("admin stops: %v", err)
	}
}

// The node verifies with the public key only: a token signed by another
// ed25519 key, an old HMAC token, or a forged on-behalf-of claim is
// refused, and a forwarded user claim is held to that user's sandboxes.
func TestNodeRefusesUnverifiableTokens(t *testing.T) {
	s := startOwnerSystem(t)
	defer s.stopAll(t)
	ctx := t.Context()
	sb, err := s.alice.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox", TimeoutSeconds: 300})
	if err != nil {
		t.Fatal(err)
	}
	other, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	svc, _ := s.iss.Issue("svc", auth.ScopeNode, time.Hour)
	forgedSvc, _ := other.Issue("svc", auth.ScopeNode, time.Hour)
	forgedAdmin, _ := other.Issue("root", auth.ScopeAdmin, time.Hour)
	bob, _ := s.iss.Issue("bob", auth.ScopeUser, time.Hour)
	hmacTok := legacyHMACToken(t, "svc", auth.ScopeNode)
	hc := h2cClient()
	get := func(bearer, obo string) error {
		req := connect.NewRequest(&nodev1.GetSandboxRequest{SandboxId: sb.GetId()})
		req.Header().Set("Authorization", "Bearer "+bearer)
		if obo != "" {
			req.Header().Set(auth.OnBehalfHeader, obo)
		}
		_, err := nodev1connect.NewNodeServiceClient(hc, "http://"+s.node).GetSandbox(ctx, req)
		return err
	}
	for name, c := range map[string]struct {
		bearer, obo string
		code        connect.Code
	}{
		"other key":          {forgedSvc, "", connect.CodeUnauthenticated},
		"hmac":               {hmacTok, "", connect.CodeUnauthenticated},
		"forged admin claim": {svc, forgedAdmin, connect.CodeUnauthenticated},
		"hmac claim":         {svc, legacyHMACToken(t, "root", auth.ScopeAdmin), connect.CodeUnauthenticated},
		"user as bearer":     {bob, "", connect.CodePermissionDenied},
		"bob's claim":        {svc, bob, connect.CodeNotFound},
	} {
		if err := get(c.bearer, c.obo); connect.CodeOf(err) != c.code {
			t.Errorf("%s: err = %v, want %v", name, err, c.code)
		}
	}
	if err := get(svc, ""); err != nil {
		t.Fatalf("the node's own service token: %v", err)
	}
	// The agent path is held to the same owner.
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+s.node+"/agent/"+sb.GetId()+"/health", nil)
	req.Header.Set("Authorization", "Bearer "+svc)
	req.Header.Set(auth.OnBehalfHeader, bob)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("agent path on bob's behalf: status %d, want 404", resp.StatusCode)
	}
}

// E2B API keys of different principals act through the API as those
// principals: key B cannot get, list, connect to, pause or kill key A's
// sandbox, and the sandbox belongs to A's principal for the public API too
// (alice's user token sees it, bob's does not).
func TestE2BKeysActAsTheirPrincipal(t *testing.T) {
	s := startOwnerSystem(t)
	defer s.stopAll(t)
	ctx := t.Context()
	keyA, err := e2bKeys(s.cfg).Create("alice")
	if err != nil {
		t.Fatal(err)
	}
	keyB, err := e2bKeys(s.cfg).Create("bob")
	if err != nil {
		t.Fatal(err)
	}
	do := func(key, method, path, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, method, "http://"+s.e2b+path, strings.NewReader(body))
		req.Header.Set("X-API-Key", key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	st, body := do(keyA, http.MethodPost, "/sandboxes", `{"templateID":"root/busybox","timeout":300}`)
	if st != http.StatusCreated {
		t.Fatalf("create with key A: %d %s", st, body)
	}
	var created struct {
		SandboxID string `json:"sandboxID"`
	}
	if err := json.Unmarshal([]byte(body), &created); err != nil || created.SandboxID == "" {
		t.Fatalf("create answer %s: %v", body, err)
	}
	id := created.SandboxID

	if sb, err := s.alice.GetSandbox(ctx, id); err != nil || sb.GetOwner() != "alice" {
		t.Fatalf("alice's SDK view of her E2B sandbox: %v, %v; want owner alice", sb.GetOwner(), err)
	}
	if _, err := s.bob.GetSandbox(ctx, id); !opendsec.IsNotFound(err) {
		t.Fatalf("bob's SDK view of alice's E2B sandbox: %v, want not_found", err)
	}

	for _, c := range []struct{ method, path, body string }{
		{http.MethodGet, "/sandboxes/" + id, ""},
		{http.MethodPost, "/sandboxes/" + id + "/connect", `{"timeout":60}`},
		{http.MethodPost, "/sandboxes/" + id + "/pause", ""},
		{http.MethodPost, "/sandboxes/" + id + "/timeout", `{"timeout":60}`},
		{http.MethodDelete, "/sandboxes/" + id, ""},
	} {
		if st, body := do(keyB, c.method, c.path, c.body); st != http.StatusNotFound {
			t.Errorf("key B %s %s: %d %s, want 404", c.method, c.path, st, body)
		}
	}
	if st, body := do(keyB, http.MethodGet, "/v2/sandboxes", ""); st != http.StatusOK || strings.Contains(body, id) {
		t.Errorf("key B lists: %d %s, want its own (none)", st, body)
	}
	if st, body := do(keyA, http.MethodGet, "/v2/sandboxes", ""); st != http.StatusOK || !strings.Contains(body, id) {
		t.Errorf("key A lists: %d %s, want %s", st, body, id)
	}
	if st, body := do(keyA, http.MethodDelete, "/sandboxes/"+id, ""); st != http.StatusNoContent {
		t.Fatalf("key A kills its sandbox: %d %s", st, body)
	}
}

// legacyHMACToken is a token as OpenDsec signed them before ed25519: the
// same claims with an HMAC-SHA256 over them.
func legacyHMACToken(t *testing.T, sub, scope string) string {
	t.Helper()
	now := time.Now()
	payload, _ := json.Marshal(map[string]any{"sub": sub, "scope": scope, "exp": now.Add(time.Hour).Unix(), "iat": now.Unix(), "jti": "x"})
	signed := auth.Prefix + base64.RawURLEncoding.EncodeToString(payload)
	m := hmac.New(sha256.New, make([]byte, 32))
	m.Write([]byte(signed))
	return signed + "." + base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}
