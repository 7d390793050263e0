// Package auth issues and verifies OpenDsec's signed bearer tokens and
// carries the verified claims in request contexts.
//
// A token is "odt_" + base64url(JSON claims) + "." + base64url(ed25519
// signature), the signature taken over everything before the dot. Only an
// Issuer, which holds the ed25519 private key, can mint; everything else
// (apiservers, nodes, the watcher) holds the public key and verifies
// (Verify, Verifier), never a round trip. Servers read "Authorization:
// Bearer <token>"; when the Authorization header is taken by something else
// (the envd agent reads the process user from "Authorization: Basic"),
// internal hops carry the token in TokenHeader instead. A component calling
// another on a caller's behalf forwards the caller's own token in
// OnBehalfHeader (see Verifier.AcceptOnBehalf).
package auth

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Prefix starts every token.
const Prefix = "odt_"

// TokenHeader carries the token on internal hops whose Authorization header
// belongs to the agent (user selection with Basic auth). Servers accept it
// when Authorization holds no bearer token; proxies strip it.
const TokenHeader = "X-Opendsec-Token"

// OnBehalfHeader carries, on a component-to-component call, the signed
// token of the caller the component acts for (the apiserver calling a node
// for a user). The receiver verifies it with the same public key and acts
// with its claims; proxies strip it.
const OnBehalfHeader = "X-Opendsec-On-Behalf-Of"

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
	// Subject is the principal.
	Subject string `json:"sub"`
	Scope   string `json:"scope"`
	// Project is the principal's project; empty until projects exist.
	Project   string `json:"proj,omitempty"`
	ExpiresAt int64  `json:"exp"`
	IssuedAt  int64  `json:"iat"`
	ID        string `json:"jti"`
}

// Expiry returns the expiry as a time.
func (c Claims) Expiry() time.Time { return time.Unix(c.ExpiresAt, 0).UTC() }

var (
	errMissing = errdefs.New(errdefs.ErrUnauthenticated, "missing token: set OPENDSEC_TOKEN or pass --token")
	errInvalid = errdefs.New(errdefs.ErrUnauthenticated, "invalid token")
	errHMAC    = errdefs.New(errdefs.ErrUnauthenticated,
		"invalid token: it is signed with the old shared HMAC key, which OpenDsec no longer accepts; mint a new one with `opendsec token create`")
)

func validScope(s string) bool {
	return s == ScopeAdmin || s == ScopeUser || s == ScopeNode
}

// Minter mints tokens. *Issuer implements it; components that must act for
// principals (the E2B gateway) are given one only where the private key is.
type Minter interface {
	Issue(subject, scope string, ttl time.Duration) (string, error)
}

// Issuer mints tokens with the ed25519 private key. It is the only type in
// OpenDsec that can: a Verifier holds the public key alone.
type Issuer struct {
	priv ed25519.PrivateKey
	pub  ed25519.PublicKey
}

var _ Minter = (*Issuer)(nil)

// NewIssuer returns an Issuer signing with priv.
func NewIssuer(priv ed25519.PrivateKey) (*Issuer, error) {
	if len(priv) != ed25519.PrivateKeySize {
		return nil, errdefs.Invalid("private_key", "is %d bytes; an ed25519 private key is %d", len(priv), ed25519.PrivateKeySize)
	}
	return &Issuer{priv: priv, pub: priv.Public().(ed25519.PublicKey)}, nil
}

// GenerateIssuer returns an Issuer with a new random key pair (tests, and
// the first start of `opendsec up`).
func GenerateIssuer() (*Issuer, error) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate ed25519 key: %w", err)
	}
	return NewIssuer(priv)
}

// PublicKey returns the key that verifies this Issuer's tokens.
func (i *Issuer) PublicKey() ed25519.PublicKey { return i.pub }

// Issue signs a token for subject with scope and no project, valid for ttl
// from now.
func (i *Issuer) Issue(subject, scope string, ttl time.Duration) (string, error) {
	tok, _, err := i.IssueClaims(Claims{Subject: subject, Scope: scope}, ttl)
	return tok, err
}

// IssueClaims signs a token carrying c's subject, scope and project, valid
// for ttl from now, and returns it with its full claims.
func (i *Issuer) IssueClaims(c Claims, ttl time.Duration) (string, Claims, error) {
	if c.Subject == "" {
		return "", Claims{}, errdefs.Invalid("subject", "is empty; name the principal, e.g. \"admin\"")
	}
	if !validScope(c.Scope) {
		return "", Claims{}, errdefs.Invalid("scope", "%q is unknown; use admin, user or node", c.Scope)
	}
	if ttl <= 0 {
		return "", Claims{}, errdefs.Invalid("ttl", "must be positive, e.g. 24h")
	}
	jti := make([]byte, 12)
	if _, err := rand.Read(jti); err != nil {
		return "", Claims{}, fmt.Errorf("token id: %w", err)
	}
	now := time.Now()
	c.IssuedAt, c.ExpiresAt, c.ID = now.Unix(), now.Add(ttl).Unix(), hex.EncodeToString(jti)
	payload, err := json.Marshal(c)
	if err != nil {
		return "", Claims{}, fmt.Errorf("encode claims: %w", err)
	}
	signed := Prefix + base64.RawURLEncoding.EncodeToString(payload)
	return signed + "." + base64.RawURLEncoding.EncodeToString(ed25519.Sign(i.priv, []byte(signed))), c, nil
}

// Verify checks token's signature against pub and its expiry at now and
// returns its claims. Every failure is in the unauthenticated category with
// a message saying what to do.
func Verify(pub ed25519.PublicKey, token string, now time.Time) (Claims, error) {
	if token == "" {
		return Claims{}, errMissing
	}
	if len(pub) != ed25519.PublicKeySize || !strings.HasPrefix(token, Prefix) {
		return Claims{}, errInvalid
	}
	dot := strings.LastIndexByte(token, '.')
	if dot < len(Prefix) {
		return Claims{}, errInvalid
	}
	signed, sigPart := token[:dot], token[dot+1:]
	sig, err := base64.RawURLEncoding.DecodeString(sigPart)
	if err != nil {
		return Claims{}, errInvalid
	}
	if len(sig) == 32 {
		// HMAC-SHA256: a token from before ed25519.
		return Claims{}, errHMAC
	}
	if len(sig) != ed25519.SignatureSize || !ed25519.Verify(pub, []byte(signed), sig) {
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

// peekClaims decodes a token's claims without verifying it (for the expiry
// of a token this process just minted or was given).
func peekClaims(token string) (Claims, error) {
	signed, _, ok := strings.Cut(strings.TrimPrefix(token, Prefix), ".")
	if !ok {
		return Claims{}, errInvalid
	}
	payload, err := base64.RawURLEncoding.DecodeString(signed)
	if err != nil {
		return Claims{}, errInvalid
	}
	var c Claims
	if err := json.Unmarshal(payload, &c); err != nil {
		return Claims{}, errInvalid
	}
	return c, nil
}

type claimsKey struct{}

type callerValue struct {
	c     Claims
	token string
}

// WithClaims returns ctx carrying c as the caller's verified claims.
func WithClaims(ctx context.Context, c Claims) context.Context {
	return context.WithValue(ctx, claimsKey{}, callerValue{c: c})
}

// withCaller returns ctx carrying the caller's claims and the signed token
// they came from, which outgoing calls forward in OnBehalfHeader.
func withCaller(ctx context.Context, c Claims, token string) context.Context {
	return context.WithValue(ctx, claimsKey{}, callerValue{c: c, token: token})
}

// FromContext returns the verified claims of the caller, if any: the
// bearer's, or on a call made on someone's behalf, theirs.
func FromContext(ctx context.Context) (Claims, bool) {
	v, ok := ctx.Value(claimsKey{}).(callerValue)
	return v.c, ok
}

// CallerToken returns the signed token the caller in ctx was verified
// from ("" if none). Client interceptors and transports forward it in
// OnBehalfHeader.
func CallerToken(ctx context.Context) string {
	v, _ := ctx.Value(claimsKey{}).(callerValue)
	return v.token
}

type bearerKey struct{}

// WithBearer returns ctx whose outgoing calls (ClientInterceptorFrom,
// RoundTripperFrom) carry tok instead of the client's own token: the E2B
// gateway calls the API with the token of the API key's principal.
func WithBearer(ctx context.Context, tok string) context.Context {
	return context.WithValue(ctx, bearerKey{}, tok)
}

// BearerFrom returns the token set by WithBearer.
func BearerFrom(ctx context.Context) string {
	s, _ := ctx.Value(bearerKey{}).(string)
	return s
}

// DeriveKey returns a 32-byte secret for purpose derived from the private
// key (HMAC-SHA256 of its seed): stable for as long as the key pair is,
// and known only where the private key is (the E2B gateway's envd access
// tokens).
func (i *Issuer) DeriveKey(purpose string) []byte {
	m := hmac.New(sha256.New, i.priv.Seed())
	m.Write([]byte(purpose))
	return m.Sum(nil)
}
