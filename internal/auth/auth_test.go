package auth_test

import (
	"context"
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
)

func newIssuer(t *testing.T) *auth.Issuer {
	t.Helper()
	iss, err := auth.GenerateIssuer()
	if err != nil {
		t.Fatal(err)
	}
	return iss
}

func TestIssueVerify(t *testing.T) {
	iss := newIssuer(t)
	tok, err := iss.Issue("alice", auth.ScopeUser, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(tok, "odt_") || strings.Count(tok, ".") != 1 {
		t.Fatalf("token %q does not have the odt_<payload>.<sig> shape", tok)
	}
	c, err := auth.Verify(iss.PublicKey(), tok, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if c.Subject != "alice" || c.Scope != auth.ScopeUser || c.Project != "" || c.ID == "" || c.ExpiresAt-c.IssuedAt != 3600 {
		t.Fatalf("claims = %+v", c)
	}
	payload, _ := base64.RawURLEncoding.DecodeString(strings.TrimPrefix(strings.Split(tok, ".")[0], "odt_"))
	for _, k := range []string{`"sub"`, `"scope"`, `"exp"`, `"iat"`, `"jti"`} {
		if !strings.Contains(string(payload), k) {
			t.Errorf("claims %s lack %s", payload, k)
		}
	}
	tok, _, err = iss.IssueClaims(auth.Claims{Subject: "bob", Scope: auth.ScopeUser, Project: "p1"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if c, err := auth.Verify(iss.PublicKey(), tok, time.Now()); err != nil || c.Project != "p1" {
		t.Fatalf("project claim: %+v, %v", c, err)
	}
}

// hmacToken is a token in the format before ed25519: the same claims with
// an HMAC-SHA256 over them.
func hmacToken(key []byte, sub, scope string) string {
	now := time.Now()
	payload := fmt.Sprintf(`{"sub":%q,"exp":%d,"iat":%d,"jti":"x","scope":%q}`, sub, now.Add(time.Hour).Unix(), now.Unix(), scope)
	signed := "odt_" + base64.RawURLEncoding.EncodeToString([]byte(payload))
	m := hmac.New(sha256.New, key)
	m.Write([]byte(signed))
	return signed + "." + base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

func TestVerifyRejects(t *testing.T) {
	iss := newIssuer(t)
	other := newIssuer(t)
	key := iss.PublicKey()
	tok, err := iss.Issue("alice", auth.ScopeAdmin, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	payload, sig, _ := strings.Cut(tok, ".")
	forged := strings.Replace(payload, payload[4:10], base64.RawURLEncoding.EncodeToString([]byte("xxxx")), 1) + "." + sig
	for name, tc := range map[string]struct {
		key  ed25519.PublicKey
		tok  string
		now  time.Time
		want string
	}{
		"missing":   {key, "", time.Now(), "missing token: set OPENDSEC_TOKEN or pass --token"},
		"garbage":   {key, "hello", time.Now(), "invalid token"},
		"forged":    {key, forged, time.Now(), "invalid token"},
		"no sig":    {key, payload, time.Now(), "invalid token"},
		"other key": {other.PublicKey(), tok, time.Now(), "invalid token"},
		"hmac":      {key, hmacToken(make([]byte, 32), "alice", auth.ScopeAdmin), time.Now(), "invalid token: it is signed with the old shared HMAC key"},
		"expired":   {key, tok, time.Now().Add(2 * time.Minute), "token expired at "},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := auth.Verify(tc.key, tc.tok, tc.now)
			if !errors.Is(err, errdefs.ErrUnauthenticated) {
				t.Fatalf("err = %v, want unauthenticated", err)
			}
			if !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("err = %q, want prefix %q", err, tc.want)
			}
		})
	}
}

func TestIssueValidates(t *testing.T) {
	iss := newIssuer(t)
	for field, call := range map[string]func() error{
		"scope":       func() error { _, err := iss.Issue("a", "root", time.Hour); return err },
		"subject":     func() error { _, err := iss.Issue("", "user", time.Hour); return err },
		"ttl":         func() error { _, err := iss.Issue("a", "user", 0); return err },
		"private_key": func() error { _, err := auth.NewIssuer([]byte("short")); return err },
	} {
		var fe *errdefs.FieldError
		if err := call(); !errors.As(err, &fe) || fe.Field != field {
			t.Errorf("%s: err = %v, want a field error naming %s", field, err, field)
		}
	}
}

// Only the Issuer mints: a Verifier (all that apiservers and nodes hold)
// has no method that signs. Checked by reflection so adding one fails here.
func TestVerifierCannotMint(t *testing.T) {
	vt := reflect.TypeOf(&auth.Verifier{})
	for i := range vt.NumMethod() {
		if m := vt.Method(i).Name; strings.Contains(m, "Issue") || strings.Contains(m, "Sign") || strings.Contains(m, "Mint") {
			t.Errorf("Verifier has method %s", m)
		}
	}
	var v any = auth.NewVerifier(newIssuer(t).PublicKey())
	if _, ok := v.(auth.Minter); ok {
		t.Fatal("a Verifier is a Minter")
	}
}

func TestLoadOrCreateIssuer(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "d")
	priv, pub := filepath.Join(dir, "auth.ed25519"), filepath.Join(dir, "auth.ed25519.pub")
	i1, created, err := auth.LoadOrCreateIssuer(priv, pub)
	if err != nil || !created {
		t.Fatalf("first load: created %v, %v", created, err)
	}
	st, err := os.Stat(priv)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("private key file mode %v, want 0600", st.Mode().Perm())
	}
	i2, created, err := auth.LoadOrCreateIssuer(priv, pub)
	if err != nil || created {
		t.Fatalf("second load: created %v, %v", created, err)
	}
	if !i1.PublicKey().Equal(i2.PublicKey()) {
		t.Fatal("second load returned a different key")
	}
	pk, err := auth.LoadPublicKey(pub)
	if err != nil || !pk.Equal(i1.PublicKey()) {
		t.Fatalf("public key file: %v", err)
	}
	if _, err := auth.LoadIssuer(pub); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("public key read as private: err = %v, want invalid argument", err)
	}
	if _, err := auth.LoadIssuer(filepath.Join(dir, "missing")); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "only the issuer") {
		t.Fatalf("missing private key: err = %v", err)
	}
}

// A node's verifier (AcceptOnBehalf) serves a service's call as the caller
// whose signed token it forwards, and refuses a forwarded token it cannot
// verify with its public key, or a forward by a user token.
func TestOnBehalf(t *testing.T) {
	iss, other := newIssuer(t), newIssuer(t)
	v := auth.NewVerifier(iss.PublicKey(), auth.ScopeNode, auth.ScopeAdmin).AcceptOnBehalf()
	svc, _ := iss.Issue("apiserver", auth.ScopeNode, time.Hour)
	alice, _ := iss.Issue("alice", auth.ScopeUser, time.Hour)
	forged, _ := other.Issue("alice", auth.ScopeAdmin, time.Hour)
	node, _ := iss.Issue("n", auth.ScopeNode, time.Hour)
	h := func(bearer, obo string) http.Header {
		h := http.Header{}
		h.Set("Authorization", "Bearer "+bearer)
		if obo != "" {
			h.Set(auth.OnBehalfHeader, obo)
		}
		return h
	}
	if c, err := v.Authenticate(h(svc, "")); err != nil || c.Subject != "apiserver" {
		t.Fatalf("service alone: %+v, %v", c, err)
	}
	if c, err := v.Authenticate(h(svc, alice)); err != nil || c.Subject != "alice" || c.Scope != auth.ScopeUser {
		t.Fatalf("on behalf of alice: %+v, %v", c, err)
	}
	for name, hd := range map[string]http.Header{
		"forged claim":  h(svc, forged),
		"hmac claim":    h(svc, hmacToken(make([]byte, 32), "alice", auth.ScopeAdmin)),
		"forged bearer": h(forged, ""),
		"hmac bearer":   h(hmacToken(make([]byte, 32), "x", auth.ScopeNode), ""),
		"node as claim": h(svc, node),
		"garbage claim": h(svc, "odt_x.y"),
	} {
		if _, err := v.Authenticate(hd); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// A verifier without AcceptOnBehalf ignores the header.
	plain := auth.NewVerifier(iss.PublicKey())
	if c, err := plain.Authenticate(h(svc, alice)); err != nil || c.Subject != "apiserver" {
		t.Fatalf("plain verifier: %+v, %v", c, err)
	}
}

// Outgoing calls made in a verified caller's context forward its token in
// OnBehalfHeader; WithBearer replaces the client's own token.
func TestForwardsCaller(t *testing.T) {
	iss := newIssuer(t)
	svc, _ := iss.Issue("apiserver", auth.ScopeNode, time.Hour)
	alice, _ := iss.Issue("alice", auth.ScopeUser, time.Hour)
	var got http.Header
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got = r.Header.Clone() }))
	t.Cleanup(srv.Close)
	front := auth.NewVerifier(iss.PublicKey()).Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, _ := http.NewRequestWithContext(r.Context(), http.MethodGet, srv.URL, nil)
		resp, err := auth.Client(srv.Client(), svc).Do(req)
		if err == nil {
			resp.Body.Close()
		}
	}))
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	req.Header.Set("Authorization", "Bearer "+alice)
	front.ServeHTTP(httptest.NewRecorder(), req)
	if got.Get("Authorization") != "Bearer "+svc || got.Get(auth.OnBehalfHeader) != alice {
		t.Fatalf("forwarded Authorization %q, on-behalf %q", got.Get("Authorization"), got.Get(auth.OnBehalfHeader))
	}
	req2, _ := http.NewRequestWithContext(auth.WithBearer(t.Context(), alice), http.MethodGet, srv.URL, nil)
	resp, err := auth.Client(srv.Client(), svc).Do(req2)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if got.Get("Authorization") != "Bearer "+alice || got.Get(auth.OnBehalfHeader) != "" {
		t.Fatalf("WithBearer: Authorization %q, on-behalf %q", got.Get("Authorization"), got.Get(auth.OnBehalfHeader))
	}
}

type watcherSvc struct {
	watcherv1connect.UnimplementedWatcherServiceHandler
}

func (watcherSvc) ListNodes(ctx context.Context, _ *connect.Request[watcherv1.ListNodesRequest]) (*connect.Response[watcherv1.ListNodesResponse], error) {
	c, ok := auth.FromContext(ctx)
	if !ok {
		return nil, connect.NewError(connect.CodeInternal, errors.New("no claims in context"))
	}
	return connect.NewResponse(&watcherv1.ListNodesResponse{Nodes: []*watcherv1.NodeStatus{{NodeId: c.Subject}}}), nil
}

func TestInterceptor(t *testing.T) {
	iss := newIssuer(t)
	v := auth.NewVerifier(iss.PublicKey(), auth.ScopeNode)
	mux := http.NewServeMux()
	mux.Handle(watcherv1connect.NewWatcherServiceHandler(watcherSvc{}, connect.WithInterceptors(v.Interceptor())))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	call := func(c *http.Client, opts ...connect.ClientOption) (*watcherv1.ListNodesResponse, error) {
		resp, err := watcherv1connect.NewWatcherServiceClient(c, srv.URL, opts...).ListNodes(t.Context(), connect.NewRequest(&watcherv1.ListNodesRequest{}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	if _, err := call(srv.Client()); connect.CodeOf(err) != connect.CodeUnauthenticated || !strings.Contains(err.Error(), "missing token") {
		t.Fatalf("no token: err = %v", err)
	}
	userTok, _ := iss.Issue("bob", auth.ScopeUser, time.Hour)
	if _, err := call(auth.Client(srv.Client(), userTok)); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("user scope: err = %v, want permission denied", err)
	}
	nodeTok, _ := iss.Issue("apiserver", auth.ScopeNode, time.Hour)
	for name, c := range map[string]struct {
		client *http.Client
		opts   []connect.ClientOption
	}{
		"roundtripper": {auth.Client(srv.Client(), nodeTok), nil},
		"interceptor":  {srv.Client(), []connect.ClientOption{connect.WithInterceptors(auth.ClientInterceptor(nodeTok))}},
	} {
		msg, err := call(c.client, c.opts...)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if msg.Nodes[0].NodeId != "apiserver" {
			t.Fatalf("%s: handler saw subject %q", name, msg.Nodes[0].NodeId)
		}
	}
}

func TestMiddlewareAndTokenHeader(t *testing.T) {
	iss := newIssuer(t)
	v := auth.NewVerifier(iss.PublicKey())
	var sawAuth, sawToken string
	srv := httptest.NewServer(v.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sawAuth, sawToken = r.Header.Get("Authorization"), r.Header.Get(auth.TokenHeader)
		c, _ := auth.FromContext(r.Context())
		w.Write([]byte(c.Subject))
	})))
	t.Cleanup(srv.Close)

	resp, err := srv.Client().Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("no token: status %d, want 401", resp.StatusCode)
	}

	tok, _ := iss.Issue("svc", auth.ScopeNode, time.Hour)
	// The agent's user selection occupies Authorization: the token must
	// travel in TokenHeader and be stripped before the handler.
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, srv.URL, nil)
	req.Header.Set("Authorization", "Basic dXNlcjo=")
	resp, err = auth.Client(srv.Client(), tok).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("token in %s: status %d", auth.TokenHeader, resp.StatusCode)
	}
	if sawAuth != "Basic dXNlcjo=" || sawToken != "" {
		t.Fatalf("handler saw Authorization %q and token header %q", sawAuth, sawToken)
	}
}

// TestVerifierCacheKeepsChecks: a Verifier remembers tokens it verified,
// but a remembered token still expires, and a token differing from a
// remembered one only in its signature is refused.
func TestVerifierCacheKeepsChecks(t *testing.T) {
	iss := newIssuer(t)
	tok, err := iss.Issue("alice", auth.ScopeUser, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	v := auth.NewVerifier(iss.PublicKey())
	now := time.Now()
	v.Now = func() time.Time { return now }
	h := http.Header{"Authorization": {"Bearer " + tok}}
	for range 2 {
		if c, err := v.Authenticate(h); err != nil || c.Subject != "alice" {
			t.Fatalf("authenticate: %+v, %v", c, err)
		}
	}
	// Flip one signature character (not the last: its low bits may be padding).
	dot := strings.LastIndexByte(tok, '.')
	b := []byte(tok)
	if b[dot+2] == 'A' {
		b[dot+2] = 'B'
	} else {
		b[dot+2] = 'A'
	}
	if _, err := v.Authenticate(http.Header{"Authorization": {"Bearer " + string(b)}}); !errors.Is(err, errdefs.ErrUnauthenticated) {
		t.Fatalf("tampered signature: %v, want unauthenticated", err)
	}
	now = now.Add(2 * time.Minute)
	if _, err := v.Authenticate(h); !errors.Is(err, errdefs.ErrUnauthenticated) || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("remembered token after its expiry: %v, want expired", err)
	}
}
