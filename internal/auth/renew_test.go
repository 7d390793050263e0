package auth_test

import (
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
)

// A component holding a short-lived service token keeps working after the
// first token expired: Run renewed it in the background before that, and
// every call takes the current one. The expired token itself is refused.
func TestServiceTokenRenewal(t *testing.T) {
	iss := newIssuer(t)
	v := auth.NewVerifier(iss.PublicKey(), auth.ScopeNode)
	mux := http.NewServeMux()
	mux.Handle(watcherv1connect.NewWatcherServiceHandler(watcherSvc{}, connect.WithInterceptors(v.Interceptor())))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	call := func(c *http.Client, opts ...connect.ClientOption) error {
		_, err := watcherv1connect.NewWatcherServiceClient(c, srv.URL, opts...).ListNodes(t.Context(), connect.NewRequest(&watcherv1.ListNodesRequest{}))
		return err
	}

	const ttl = 2 * time.Second
	st, err := auth.NewServiceToken(iss, "apiserver", auth.ScopeNode, ttl)
	if err != nil {
		t.Fatal(err)
	}
	first, firstExpiry := st.Token(), st.Expiry()
	if d := time.Until(firstExpiry); d > ttl || d <= 0 {
		t.Fatalf("first token expires in %s; want within %s", d, ttl)
	}
	go st.Run(t.Context())

	clients := map[string]func() error{
		"roundtripper": func() error { return call(auth.ClientFrom(srv.Client(), st)) },
		"interceptor": func() error {
			return call(srv.Client(), connect.WithInterceptors(auth.ClientInterceptorFrom(st)))
		},
	}
	for name, c := range clients {
		if err := c(); err != nil {
			t.Fatalf("%s with the first token: %v", name, err)
		}
	}

	// Run renews before the first token expires.
	deadline := time.Now().Add(5 * time.Second)
	for !st.Expiry().After(firstExpiry) {
		if time.Now().After(deadline) {
			t.Fatal("the service token was not renewed in the background")
		}
		time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
	}
	if _, err := auth.Verify(iss.PublicKey(), first, time.Now()); err != nil {
		t.Fatalf("renewed only after the first token expired: %v", err)
	}

	// Wait until the first token has expired.
	deadline = time.Now().Add(5 * time.Second)
	for {
		if _, err := auth.Verify(iss.PublicKey(), first, time.Now()); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("first token did not expire")
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
	err = call(auth.Client(srv.Client(), first))
	if connect.CodeOf(err) != connect.CodeUnauthenticated || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("expired service token: %v; want unauthenticated, expired", err)
	}
	for name, c := range clients {
		if err := c(); err != nil {
			t.Fatalf("%s after the first token expired: %v", name, err)
		}
	}
	if st.Token() == first {
		t.Fatal("Token still returns the expired token")
	}
}

// Token renews on the spot when Run is not running and the renewal point
// has passed, so a holder never sends a token it knows is about to expire.
func TestServiceTokenRenewsWithoutRun(t *testing.T) {
	iss := newIssuer(t)
	st, err := auth.NewServiceToken(iss, "watcher", auth.ScopeNode, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	first := st.Token()
	deadline := time.Now().Add(5 * time.Second)
	for st.Token() == first {
		if time.Now().After(deadline) {
			t.Fatal("Token never renewed")
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
	if _, err := auth.Verify(iss.PublicKey(), st.Token(), time.Now()); err != nil {
		t.Fatalf("renewed token: %v", err)
	}
}

// A FileToken serves the file's token and picks up a rewritten file; a
// missing file fails at start with how to mint one.
func TestFileToken(t *testing.T) {
	path := filepath.Join(t.TempDir(), "service.token")
	if _, err := auth.NewFileToken(path); err == nil || !strings.Contains(err.Error(), "opendsec token create --scope node") {
		t.Fatalf("missing file: err = %v", err)
	}
	if err := os.WriteFile(path, []byte("odt_a.b\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ft, err := auth.NewFileToken(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := ft.Token(); got != "odt_a.b" {
		t.Fatalf("token %q", got)
	}
}
