package daemon

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
)

// `opendsec token create` mints only where the issuer's private key is:
// with the public key alone (what apiservers and nodes hold) it fails,
// saying so, and prints nothing.
func TestTokenCreateNeedsPrivateKey(t *testing.T) {
	dd := t.TempDir()
	cfg := config.Default(dd)
	iss, _, err := auth.LoadOrCreateIssuer(cfg.PrivateKeyPath(), cfg.PublicKeyPath())
	if err != nil {
		t.Fatal(err)
	}
	run := func() (string, error) {
		root := NewRootCommand()
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&out)
		root.SetArgs([]string{"--data-dir", dd, "token", "create", "--subject", "alice", "--ttl", "1h"})
		err := root.ExecuteContext(t.Context())
		return out.String(), err
	}
	out, err := run()
	if err != nil {
		t.Fatalf("with the private key: %v", err)
	}
	c, err := auth.Verify(iss.PublicKey(), strings.TrimSpace(out), time.Now())
	if err != nil || c.Subject != "alice" || c.Scope != auth.ScopeUser {
		t.Fatalf("minted %q: %+v, %v", out, c, err)
	}
	if err := os.Remove(cfg.PrivateKeyPath()); err != nil {
		t.Fatal(err)
	}
	out, err = run()
	if err == nil || !strings.Contains(err.Error(), "no token-signing private key") || strings.Contains(out, auth.Prefix) {
		t.Fatalf("with the public key only: out %q, err %v; want a clear error and no token", out, err)
	}
}

// A data dir from before ed25519 (an HMAC auth.key and a bootstrap token
// signed with it) gets a key pair at the first start; the old bootstrap
// token is refused and replaced.
func TestMigrateFromHMACKey(t *testing.T) {
	dd := t.TempDir()
	cfg := config.Default(dd)
	if err := os.WriteFile(filepath.Join(dd, LegacyKeyFile), make([]byte, 32), 0o600); err != nil {
		t.Fatal(err)
	}
	old := "odt_eyJzdWIiOiJib290c3RyYXAiLCJleHAiOjQxMDI0NDQ4MDAsImlhdCI6MCwianRpIjoieCIsInNjb3BlIjoiYWRtaW4ifQ.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
	if err := os.WriteFile(filepath.Join(dd, BootstrapTokenFile), []byte(old+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	iss, err := loadIssuer(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := auth.Verify(iss.PublicKey(), old, time.Now()); err == nil || !strings.Contains(err.Error(), "opendsec token create") {
		t.Fatalf("old HMAC token: err = %v, want refused with how to mint a new one", err)
	}
	tok, err := EnsureBootstrapToken(cfg, iss)
	if err != nil {
		t.Fatal(err)
	}
	if c, err := auth.Verify(iss.PublicKey(), tok, time.Now()); err != nil || c.Scope != auth.ScopeAdmin {
		t.Fatalf("new bootstrap token: %+v, %v", c, err)
	}
	if pub, err := auth.LoadPublicKey(cfg.PublicKeyPath()); err != nil || !pub.Equal(iss.PublicKey()) {
		t.Fatalf("public key file: %v", err)
	}
}
