// Package auth issues and verifies OpenDsec's signed bearer tokens and
// carries the verified claims in request contexts.
//
// A token is "odt_" + base64url(JSON claims) + "." + base64url(HMAC-SHA256),
// the MAC taken over everything before the dot. Verification needs only the
// key, never a round trip. Servers read "Authorization: Bearer <token>"; when
// the Authorization header is taken by something else (the envd agent reads
// the process user from "Authorization: Basic"), internal hops carry the
// token in TokenHeader instead.
package auth

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Prefix starts every token.
const Prefix = "odt_"

// KeySize is the length of a signing key in bytes.
const KeySize = 32

// TokenHeader carries the token on internal hops whose Authorization header
// belongs to the agent (user selection with Basic auth). Servers accept it
// when Authorization holds no bearer token; proxies strip it.
const TokenHeader = "X-Opendsec-Token"

// Scopes.
const (
	ScopeAdmin = "admin"
	ScopeUser  = "user"
	// ScopeNode is for component-to-component calls (apiserver and watcher
	// to nodes).
	ScopeNode = "node"
)

// Claims are what a token says about its bearer.
type Claims struct {
	Subject   string `json:"sub"`
	ExpiresAt int64  `json:"exp"`
	IssuedAt  int64  `json:"iat"`
	ID        string `json:"jti"`
	Scope     string `json:"scope"`
}

// Expiry returns the expiry as a time.
func (c Claims) Expiry() time.Time { return time.Unix(c.ExpiresAt, 0).UTC() }

var (
	errMissing = errdefs.New(errdefs.ErrUnauthenticated, "missing token: set OPENDSEC_TOKEN or pass --token")
	errInvalid = errdefs.New(errdefs.ErrUnauthenticated, "invalid token")
)

func validScope(s string) bool {
	return s == ScopeAdmin || s == ScopeUser || s == ScopeNode
}

// Issue signs a token for subject with scope, valid for ttl from now.
func Issue(key []byte, subject, scope string, ttl time.Duration) (string, error) {
	if len(key) != KeySize {
		return "", errdefs.Invalid("key", "is %d bytes; a signing key is %d bytes", len(key), KeySize)
	}
	if subject == "" {
		return "", errdefs.Invalid("subject", "is empty; name the principal, e.g. \"admin\"")
	}
	if !validScope(scope) {
		return "", errdefs.Invalid("scope", "%q is unknown; use admin, user or node", scope)
	}
	if ttl <= 0 {
		return "", errdefs.Invalid("ttl", "must be positive, e.g. 24h")
	}
	jti := make([]byte, 12)
	if _, err := rand.Read(jti); err != nil {
		return "", fmt.Errorf("token id: %w", err)
	}
	now := time.Now()
	c := Claims{
		Subject:   subject,
		IssuedAt:  now.Unix(),
		ExpiresAt: now.Add(ttl).Unix(),
		ID:        hex.EncodeToString(jti),
		Scope:     scope,
	}
	payload, err := json.Marshal(c)
	if err != nil {
		return "", fmt.Errorf("encode claims: %w", err)
	}
	signed := Prefix + base64.RawURLEncoding.EncodeToString(payload)
	return signed + "." + base64.RawURLEncoding.EncodeToString(mac(key, signed)), nil
}

func mac(key []byte, s string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(s))
	return m.Sum(nil)
}

// Verify checks token's signature and expiry at now and returns its claims.
// Every failure is in the unauthenticated category with a message saying
// what to do.
func Verify(key []byte, token string, now time.Time) (Claims, error) {
	if token == "" {
		return Claims{}, errMissing
	}
	if len(key) != KeySize || !strings.HasPrefix(token, Prefix) {
		return Claims{}, errInvalid
	}
	dot := strings.LastIndexByte(token, '.')
	if dot < len(Prefix) {
		return Claims{}, errInvalid
	}
	signed, sigPart := token[:dot], token[dot+1:]
	sig, err := base64.RawURLEncoding.DecodeString(sigPart)
	if err != nil || !hmac.Equal(sig, mac(key, signed)) {
		return Claims{}, errInvalid
	}
	payload, err := base64.RawURLEncoding.DecodeString(signed[len(Prefix):])
	if err != nil {
		return Claims{}, errInvalid
	}
	var c Claims
	dec := json.NewDecoder(bytes.NewReader(payload))
	if err := dec.Decode(&c); err != nil || c.Subject == "" || !validScope(c.Scope) {
		return Claims{}, errInvalid
	}
	if now.Unix() >= c.ExpiresAt {
		return Claims{}, errdefs.New(errdefs.ErrUnauthenticated,
			"token expired at %s; create a new one with `opendsec token create`", c.Expiry().Format(time.RFC3339))
	}
	return c, nil
}

// LoadOrCreateKey reads the signing key at path, creating it (KeySize random
// bytes, mode 0600, parent directories 0700) when missing.
func LoadOrCreateKey(path string) ([]byte, error) {
	key, err := os.ReadFile(path)
	switch {
	case err == nil:
		if len(key) != KeySize {
			return nil, errdefs.Invalid("key_file", "%s is %d bytes, want %d; remove it to make a new key (tokens issued with it stop working)", path, len(key), KeySize)
		}
		return key, nil
	case !errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("read signing key: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("create key directory: %w", err)
	}
	key = make([]byte, KeySize)
	if _, err := rand.Read(key); err != nil {
		return nil, fmt.Errorf("generate signing key: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		// Another process created it first: use theirs.
		return LoadOrCreateKey(path)
	}
	if err != nil {
		return nil, fmt.Errorf("create signing key: %w", err)
	}
	if _, err := f.Write(key); err != nil {
		f.Close()
		os.Remove(path)
		return nil, fmt.Errorf("write signing key: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		os.Remove(path)
		return nil, fmt.Errorf("sync signing key: %w", err)
	}
	if err := f.Close(); err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("close signing key: %w", err)
	}
	return key, nil
}

type claimsKey struct{}

// WithClaims returns ctx carrying c.
func WithClaims(ctx context.Context, c Claims) context.Context {
	return context.WithValue(ctx, claimsKey{}, c)
}

// FromContext returns the verified claims of the caller, if any.
func FromContext(ctx context.Context) (Claims, bool) {
	c, ok := ctx.Value(claimsKey{}).(Claims)
	return c, ok
}
