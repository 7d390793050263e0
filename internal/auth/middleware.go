package auth

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Verifier authenticates requests with the issuer's public key and the
// scopes a service accepts. It cannot mint: only an Issuer can.
type Verifier struct {
	pub      ed25519.PublicKey
	scopes   []string
	onBehalf bool
	// Now is the clock; tests replace it.
	Now func() time.Time

	// verified caches the claims of tokens whose signature checked out
	// (the same few tokens sign every call between services: an ed25519
	// verification each was a visible part of a node's CPU in a burst).
	// The expiry is checked at every use.
	mu       sync.Mutex
	verified map[string]Claims // guarded by mu
}

// maxVerified bounds Verifier.verified; when full it starts over.
const maxVerified = 1024

// verify is Verify with v's key, from the cache when it can.
func (v *Verifier) verify(tok string, now time.Time) (Claims, error) {
	v.mu.Lock()
	c, ok := v.verified[tok]
	v.mu.Unlock()
	if ok && now.Unix() < c.ExpiresAt {
		return c, nil
	}
	c, err := Verify(v.pub, tok, now)
	if err != nil {
		return c, err
	}
	v.mu.Lock()
	if v.verified == nil || len(v.verified) >= maxVerified {
		v.verified = map[string]Claims{}
	}
	v.verified[tok] = c
	v.mu.Unlock()
	return c, nil
}

// NewVerifier returns a Verifier accepting tokens signed by the private key
// of pub whose scope is one of scopes (any valid scope when none are
// given).
func NewVerifier(pub ed25519.PublicKey, scopes ...string) *Verifier {
	return &Verifier{pub: pub, scopes: scopes, Now: time.Now}
}

// AcceptOnBehalf makes v (a node's) honour OnBehalfHeader: a request whose
// bearer is a service (node or admin scope) and that carries the signed
// token of a user or admin in OnBehalfHeader is served as that caller
// (FromContext returns its claims). The forwarded token is verified like
// any other. Without the header the bearer is the caller. It returns v.
func (v *Verifier) AcceptOnBehalf() *Verifier {
	v.onBehalf = true
	return v
}

// TokenFromHeader returns the bearer token in h: from "Authorization: Bearer"
// or, when Authorization holds something else, from TokenHeader.
func TokenFromHeader(h http.Header) string {
	if a := h.Get("Authorization"); a != "" {
		scheme, tok, ok := strings.Cut(a, " ")
		if ok && strings.EqualFold(scheme, "bearer") {
			return strings.TrimSpace(tok)
		}
	}
	return strings.TrimSpace(h.Get(TokenHeader))
}

// Authenticate verifies the token in h and checks its scope.
func (v *Verifier) Authenticate(h http.Header) (Claims, error) {
	c, _, err := v.authenticate(h)
	return c, err
}

// authenticate returns the caller's claims and the token they came from:
// the bearer's, or with AcceptOnBehalf and OnBehalfHeader set, those of
// the caller the bearer acts for.
func (v *Verifier) authenticate(h http.Header) (Claims, string, error) {
	tok := TokenFromHeader(h)
	c, err := v.verify(tok, v.Now())
	if err != nil {
		return Claims{}, "", err
	}
	if len(v.scopes) > 0 && !slices.Contains(v.scopes, c.Scope) {
		return Claims{}, "", errdefs.New(errdefs.ErrPermissionDenied,
			"a %q-scope token cannot call this service; use a token with scope %s", c.Scope, strings.Join(v.scopes, " or "))
	}
	obo := strings.TrimSpace(h.Get(OnBehalfHeader))
	if !v.onBehalf || obo == "" {
		return c, tok, nil
	}
	if c.Scope != ScopeNode && c.Scope != ScopeAdmin {
		return Claims{}, "", errdefs.New(errdefs.ErrPermissionDenied, "a %q-scope token cannot act on behalf of another caller", c.Scope)
	}
	oc, err := v.verify(obo, v.Now())
	if err != nil {
		return Claims{}, "", fmt.Errorf("on-behalf-of token: %w", err)
	}
	if oc.Scope != ScopeUser && oc.Scope != ScopeAdmin {
		return Claims{}, "", errdefs.New(errdefs.ErrPermissionDenied, "on-behalf-of token has scope %q; only user and admin callers are acted for", oc.Scope)
	}
	return oc, obo, nil
}

// Interceptor returns a connect interceptor that rejects unauthenticated
// unary and streaming calls and puts the caller's Claims in the handler's
// context.
func (v *Verifier) Interceptor() connect.Interceptor { return &serverInterceptor{v: v} }

type serverInterceptor struct{ v *Verifier }

func (i *serverInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		c, tok, err := i.v.authenticate(req.Header())
		if err != nil {
			return nil, errdefs.ToConnect(err)
		}
		return next(withCaller(ctx, c, tok), req)
	}
}

func (i *serverInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i *serverInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		c, tok, err := i.v.authenticate(conn.RequestHeader())
		if err != nil {
			return errdefs.ToConnect(err)
		}
		return next(withCaller(ctx, c, tok), conn)
	}
}

// Middleware wraps a plain HTTP handler: unauthenticated requests get the
// category's HTTP status and a JSON body {"code": status, "message": ...}
// (the envd error shape); authenticated ones reach next with Claims in the
// request context and TokenHeader and OnBehalfHeader removed.
func (v *Verifier) Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, tok, err := v.authenticate(r.Header)
		if err != nil {
			WriteError(w, err)
			return
		}
		r = r.WithContext(withCaller(r.Context(), c, tok))
		r.Header.Del(TokenHeader)
		r.Header.Del(OnBehalfHeader)
		next.ServeHTTP(w, r)
	})
}

// WriteError writes err as {"code": status, "message": text} with the
// status of its category.
func WriteError(w http.ResponseWriter, err error) {
	status, msg := errdefs.ToHTTP(context.Background(), err)
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}{status, msg})
}

// setOutgoing puts the token for a call made in ctx in h: the WithBearer
// token if set, else src's; and the caller's token (CallerToken) in
// OnBehalfHeader when ctx carries one, so the callee acts for that caller.
func setOutgoing(ctx context.Context, h http.Header, src TokenSource) {
	tok := BearerFrom(ctx)
	if tok == "" {
		tok = src.Token()
	}
	setToken(h, tok)
	if obo := CallerToken(ctx); obo != "" && obo != tok {
		h.Set(OnBehalfHeader, obo)
	}
}

// setToken puts tok in h: as "Authorization: Bearer" when that header is
// free, else in TokenHeader.
func setToken(h http.Header, tok string) {
	if h.Get("Authorization") == "" {
		h.Set("Authorization", "Bearer "+tok)
		return
	}
	h.Set(TokenHeader, tok)
}

// RoundTripper returns a transport that adds tok to every request (see
// TokenHeader for when Authorization is already set). base nil means
// http.DefaultTransport.
func RoundTripper(tok string, base http.RoundTripper) http.RoundTripper {
	return RoundTripperFrom(StaticToken(tok), base)
}

// RoundTripperFrom is RoundTripper with the token taken from src for each
// request, so a renewed token is used as soon as it exists.
func RoundTripperFrom(src TokenSource, base http.RoundTripper) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport
	}
	return &tokenTransport{src: src, base: base}
}

type tokenTransport struct {
	src  TokenSource
	base http.RoundTripper
}

func (t *tokenTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	setOutgoing(r.Context(), r.Header, t.src)
	return t.base.RoundTrip(r)
}

// Client returns a copy of c (http.DefaultClient if nil) whose transport
// adds tok to every request.
func Client(c *http.Client, tok string) *http.Client {
	return ClientFrom(c, StaticToken(tok))
}

// ClientFrom is Client with the token taken from src for each request.
func ClientFrom(c *http.Client, src TokenSource) *http.Client {
	if c == nil {
		c = http.DefaultClient
	}
	cc := *c
	cc.Transport = RoundTripperFrom(src, c.Transport)
	return &cc
}

// ClientInterceptor returns a connect client interceptor that adds tok to
// unary and streaming calls.
func ClientInterceptor(tok string) connect.Interceptor {
	return ClientInterceptorFrom(StaticToken(tok))
}

// ClientInterceptorFrom is ClientInterceptor with the token taken from src
// for each call.
func ClientInterceptorFrom(src TokenSource) connect.Interceptor {
	return &clientInterceptor{src: src}
}

type clientInterceptor struct{ src TokenSource }

func (i *clientInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			setOutgoing(ctx, req.Header(), i.src)
		}
		return next(ctx, req)
	}
}

func (i *clientInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		return &tokenConn{StreamingClientConn: next(ctx, spec), ctx: ctx, src: i.src}
	}
}

func (i *clientInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// tokenConn sets the token just before the request headers are sent, after
// the caller has set its own (e.g. Authorization: Basic for the agent).
type tokenConn struct {
	connect.StreamingClientConn
	ctx  context.Context
	src  TokenSource
	once sync.Once
}

func (c *tokenConn) set() { c.once.Do(func() { setOutgoing(c.ctx, c.RequestHeader(), c.src) }) }

func (c *tokenConn) Send(m any) error {
	c.set()
	return c.StreamingClientConn.Send(m)
}

func (c *tokenConn) CloseRequest() error {
	c.set()
	return c.StreamingClientConn.CloseRequest()
}
