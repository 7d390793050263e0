package auth_test

import (
	"context"
	"encoding/base64"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
)

func newKey(t *testing.T) []byte {
	t.Helper()
	k, err := auth.LoadOrCreateKey(filepath.Join(t.TempDir(), "keys", "token.key"))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestIssueVerify(t *testing.T) {
	key := newKey(t)
	tok, err := auth.Issue(key, "alice", auth.ScopeUser, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(tok, "odt_") || strings.Count(tok, ".") != 1 {
		t.Fatalf("token %q does not have the odt_<payload>.<sig> shape", tok)
	}
	c, err := auth.Verify(key, tok, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if c.Subject != "alice" || c.Scope != auth.ScopeUser || c.ID == "" || c.ExpiresAt-c.IssuedAt != 3600 {
		t.Fatalf("claims = %+v", c)
	}
}

func TestVerifyRejects(t *testing.T) {
	key := newKey(t)
	other := newKey(t)
	tok, err := auth.Issue(key, "alice", auth.ScopeAdmin, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	payload, sig, _ := strings.Cut(tok, ".")
	forged := strings.Replace(payload, payload[4:10], base64.RawURLEncoding.EncodeToString([]byte("xxxx")), 1) + "." + sig
	for name, tc := range map[string]struct {
		key  []byte
		tok  string
		now  time.Time
		want string
	}{
		"missing":   {key, "", time.Now(), "missing token: set OPENDSEC_TOKEN or pass --token"},
		"garbage":   {key, "hello", time.Now(), "invalid token"},
		"forged":    {key, forged, time.Now(), "invalid token"},
		"no sig":    {key, payload, time.Now(), "invalid token"},
		"other key": {other, tok, time.Now(), "invalid token"},
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
	key := newKey(t)
	for field, call := range map[string]func() error{
		"scope":   func() error { _, err := auth.Issue(key, "a", "root", time.Hour); return err },
		"subject": func() error { _, err := auth.Issue(key, "", "user", time.Hour); return err },
		"ttl":     func() error { _, err := auth.Issue(key, "a", "user", 0); return err },
		"key":     func() error { _, err := auth.Issue([]byte("short"), "a", "user", time.Hour); return err },
	} {
		var fe *errdefs.FieldError
		if err := call(); !errors.As(err, &fe) || fe.Field != field {
			t.Errorf("%s: err = %v, want a field error naming %s", field, err, field)
		}
	}
}

func TestLoadOrCreateKey(t *testing.T) {
	path := filepath.Join(t.TempDir(), "d", "token.key")
	k1, err := auth.LoadOrCreateKey(path)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 || st.Size() != auth.KeySize {
		t.Fatalf("key file mode %v size %d, want 0600 and %d", st.Mode().Perm(), st.Size(), auth.KeySize)
	}
	k2, err := auth.LoadOrCreateKey(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(k1) != string(k2) {
		t.Fatal("second load returned a different key")
	}
	if err := os.WriteFile(path, []byte("short"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := auth.LoadOrCreateKey(path); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("truncated key: err = %v, want invalid argument", err)
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
	key := newKey(t)
	v := auth.NewVerifier(key, auth.ScopeNode)
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
	userTok, _ := auth.Issue(key, "bob", auth.ScopeUser, time.Hour)
	if _, err := call(auth.Client(srv.Client(), userTok)); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("user scope: err = %v, want permission denied", err)
	}
	nodeTok, _ := auth.Issue(key, "apiserver", auth.ScopeNode, time.Hour)
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
	key := newKey(t)
	v := auth.NewVerifier(key)
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

	tok, _ := auth.Issue(key, "svc", auth.ScopeNode, time.Hour)
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
