// Package daemon composes OpenDsec's components into running servers: the
// node, the watcher and the apiserver, each behind its own listener and RPC
// boundary, either as separate binaries or all in one process (`opendsec up`).
package daemon

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/httpserver"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// Paths inside the data dir.
const (
	// LegacyKeyFile is the shared HMAC key of OpenDsec before ed25519
	// tokens; it is no longer read (config.Auth names the key files).
	LegacyKeyFile      = "auth.key"
	BootstrapTokenFile = "bootstrap.token"
)

// serve serves h on addr (host:port or unix:///path) until ctx ends; ready
// receives the bound address.
func serve(ctx context.Context, name, addr string, h http.Handler, ready chan<- string) error {
	ln, err := httpserver.Listen(addr)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	log.G(ctx).Info("listening", "component", name, "addr", ln.Addr().String())
	if ready != nil {
		ready <- ln.Addr().String()
	}
	return httpserver.Serve(ctx, name, ln, h)
}

// h2cClient returns an HTTP client that speaks unencrypted HTTP/2 to http://
// URLs (prior knowledge): every call between components is a multiplexed
// stream, so a finished stream never tears down a connection another call
// is using. (With HTTP/1 also enabled, net/http would pick HTTP/1.1.)
func h2cClient() *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Protocols = new(http.Protocols)
	t.Protocols.SetUnencryptedHTTP2(true)
	t.MaxIdleConnsPerHost = 64
	return &http.Client{Transport: t}
}

// nodeDirectory is the config's nodes[] as the node directory of the
// apiserver, the watcher and the E2B gateway.
func nodeDirectory(cfg config.Config) (*nodeclient.StaticDirectory, error) {
	infos := make([]nodeclient.NodeInfo, len(cfg.Nodes))
	for i, n := range cfg.Nodes {
		infos[i] = nodeclient.NodeInfo{ID: n.ID, Addr: n.Address}
	}
	return nodeclient.NewStaticDirectory(infos...)
}

// loadIssuer loads (or, on the first start, creates) the ed25519 key pair
// of the issuer: only `opendsec up` calls it. A data dir from before
// ed25519 keeps its HMAC key file, which nothing reads any more: tokens
// signed with it are refused, and the log says so.
func loadIssuer(ctx context.Context, cfg config.Config) (*auth.Issuer, error) {
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("make data dir: %w", err)
	}
	iss, created, err := auth.LoadOrCreateIssuer(cfg.PrivateKeyPath(), cfg.PublicKeyPath())
	if err != nil {
		return nil, err
	}
	if created {
		l := log.G(ctx).With("private_key", cfg.PrivateKeyPath(), "public_key", cfg.PublicKeyPath())
		if _, err := os.Stat(filepath.Join(cfg.DataDir, LegacyKeyFile)); err == nil {
			l.Warn("generated an ed25519 token-signing key pair; tokens signed with the old HMAC key (" + LegacyKeyFile +
				") are refused from now on: mint new ones with `opendsec token create` (the bootstrap token is renewed)")
		} else {
			l.Info("generated an ed25519 token-signing key pair")
		}
	}
	return iss, nil
}

// loadPublicKey reads the public key every component but the issuer
// verifies tokens with.
func loadPublicKey(cfg config.Config) (ed25519.PublicKey, error) {
	return auth.LoadPublicKey(cfg.PublicKeyPath())
}

// EnsureBootstrapToken writes an admin token to the data dir if none is
// there and returns it. It is the credential `opendsec up` hands out.
func EnsureBootstrapToken(cfg config.Config, iss *auth.Issuer) (string, error) {
	path := filepath.Join(cfg.DataDir, BootstrapTokenFile)
	if b, err := os.ReadFile(path); err == nil {
		tok := strings.TrimSpace(string(b))
		if _, err := auth.Verify(iss.PublicKey(), tok, time.Now()); err == nil {
			return tok, nil
		}
	}
	tok, err := iss.Issue("bootstrap", auth.ScopeAdmin, 365*24*time.Hour)
	if err != nil {
		return "", fmt.Errorf("issue bootstrap token: %w", err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(tok+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("write bootstrap token: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return "", fmt.Errorf("write bootstrap token: %w", err)
	}
	return tok, nil
}
