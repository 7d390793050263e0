// Package opendsec is the Go client for OpenDsec, self-hosted sandboxes for
// RL rollouts and code-running agents.
//
// A Client talks to an OpenDsec apiserver with the gRPC protocol over HTTP/2
// (h2c for http:// endpoints, TLS for https://), so exec and file transfers
// stream in both directions. Create one with New, then create sandboxes and
// run commands and file operations in them by sandbox ID:
//
//	c, err := opendsec.New("", opendsec.WithToken(token)) // or OPENDSEC_ENDPOINT / OPENDSEC_TOKEN
//	sb, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/py:3.11"})
//	res, err := c.RunShell(ctx, sb.Id, "python3 -c 'print(6*7)'")
//
// Errors returned by the server are *Error values with a Code; use
// IsNotFound, IsInvalidArgument and friends to branch on them.
package opendsec

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
)

// Environment variables New reads when its arguments leave a setting empty.
const (
	EnvEndpoint = "OPENDSEC_ENDPOINT"
	EnvToken    = "OPENDSEC_TOKEN"
)

// DefaultEndpoint is used when neither New's argument nor OPENDSEC_ENDPOINT
// names one: the apiserver of `opendsec up` on this machine.
const DefaultEndpoint = "http://127.0.0.1:7070"

// Aliases of the API messages callers build and read, so most programs need
// only this package.
type (
	// SandboxSpec is what a caller asks for when creating a sandbox.
	SandboxSpec = opendsecv1.SandboxSpec
	// Sandbox is a sandbox as the server reports it. Its GetFromWarmPool
	// reports whether the create that made it took a prestarted sandbox
	// from the node's warm pool.
	Sandbox = opendsecv1.Sandbox
	// FileInfo describes a file inside a sandbox.
	FileInfo = opendsecv1.FileInfo
)

// Client is a connection to an OpenDsec apiserver. It is safe for concurrent
// use; create one and share it.
type Client struct {
	endpoint  string
	token     string
	httpc     *http.Client
	ownHTTP   bool
	retry     RetryPolicy
	sandboxes opendsecv1connect.SandboxServiceClient
	processes opendsecv1connect.ProcessServiceClient
	files     opendsecv1connect.FileServiceClient
	ports     opendsecv1connect.PortServiceClient
	images    opendsecv1connect.ImageServiceClient
	snapshots opendsecv1connect.SnapshotServiceClient
}

// RetryPolicy says how CreateSandbox and BatchCreate retry when the server is
// unavailable. Retries reuse the request ID, so they never make a second
// sandbox.
type RetryPolicy struct {
	// Attempts is the total number of tries, at least 1.
	Attempts int
	// Backoff is the wait before the first retry; it doubles each time.
	Backoff time.Duration
	// MaxBackoff caps the wait between tries.
	MaxBackoff time.Duration
}

// DefaultRetryPolicy is the policy New uses unless WithRetryPolicy is given.
var DefaultRetryPolicy = RetryPolicy{Attempts: 5, Backoff: 200 * time.Millisecond, MaxBackoff: 3 * time.Second}

type options struct {
	token    string
	tokenSet bool
	httpc    *http.Client
	retry    RetryPolicy
}

// Option configures New.
type Option func(*options)

// WithToken sets the bearer token sent with every call. Without it, New uses
// OPENDSEC_TOKEN.
func WithToken(token string) Option {
	return func(o *options) { o.token, o.tokenSet = token, true }
}

// WithHTTPClient makes the client use hc instead of its own HTTP/2 client.
// hc must speak HTTP/2 to the endpoint (for http:// endpoints that means
// unencrypted HTTP/2, see http.Protocols) for streaming calls to work.
func WithHTTPClient(hc *http.Client) Option {
	return func(o *options) { o.httpc = hc }
}

// WithRetryPolicy replaces DefaultRetryPolicy.
func WithRetryPolicy(p RetryPolicy) Option {
	return func(o *options) { o.retry = p }
}

// New returns a client for the apiserver at endpoint, given as "host:port" or
// "http(s)://host:port". An empty endpoint means OPENDSEC_ENDPOINT, then
// DefaultEndpoint. New does not dial; the first call does.
func New(endpoint string, opts ...Option) (*Client, error) {
	o := options{retry: DefaultRetryPolicy}
	for _, opt := range opts {
		opt(&o)
	}
	if endpoint == "" {
		endpoint = os.Getenv(EnvEndpoint)
	}
	if endpoint == "" {
		endpoint = DefaultEndpoint
	}
	base, err := normalizeEndpoint(endpoint)
	if err != nil {
		return nil, err
	}
	if !o.tokenSet {
		o.token = os.Getenv(EnvToken)
	}
	if o.retry.Attempts < 1 {
		o.retry.Attempts = 1
	}
	c := &Client{endpoint: base, token: o.token, httpc: o.httpc, retry: o.retry}
	if c.httpc == nil {
		c.httpc, c.ownHTTP = newHTTPClient(), true
	}
	copts := []connect.ClientOption{
		connect.WithGRPC(),
		connect.WithInterceptors(tokenInterceptor{token: o.token}),
	}
	c.sandboxes = opendsecv1connect.NewSandboxServiceClient(c.httpc, base, copts...)
	c.processes = opendsecv1connect.NewProcessServiceClient(c.httpc, base, copts...)
	c.files = opendsecv1connect.NewFileServiceClient(c.httpc, base, copts...)
	c.ports = opendsecv1connect.NewPortServiceClient(c.httpc, base, copts...)
	c.images = opendsecv1connect.NewImageServiceClient(c.httpc, base, copts...)
	c.snapshots = opendsecv1connect.NewSnapshotServiceClient(c.httpc, base, copts...)
	return c, nil
}

// Endpoint returns the base URL the client talks to, e.g.
// "http://127.0.0.1:7070".
func (c *Client) Endpoint() string { return c.endpoint }

// Close releases idle connections of the client's own HTTP client. It does
// not affect an HTTP client given with WithHTTPClient.
func (c *Client) Close() error {
	if c.ownHTTP {
		c.httpc.CloseIdleConnections()
	}
	return nil
}

// normalizeEndpoint turns "host:port" or "http(s)://host:port[/prefix]" into
// a base URL without a trailing slash.
func normalizeEndpoint(endpoint string) (string, error) {
	e := strings.TrimSpace(endpoint)
	if !strings.Contains(e, "://") {
		e = "http://" + e
	}
	u, err := url.Parse(e)
	if err != nil {
		return "", invalid("endpoint", "%q is not host:port or http(s)://host:port: %s", endpoint, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", invalid("endpoint", "scheme %q is not supported; use host:port, http://host:port or https://host:port", u.Scheme)
	}
	if u.Host == "" {
		return "", invalid("endpoint", "%q has no host; use host:port, e.g. 127.0.0.1:7070", endpoint)
	}
	return strings.TrimRight(u.String(), "/"), nil
}

// newHTTPClient returns an HTTP/2-only client: prior-knowledge h2c for
// http:// and ALPN h2 for https://, which gRPC's bidi streams need.
func newHTTPClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	p.SetHTTP2(true)
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Protocols = &p
	// Keep a dead peer from hanging streams forever.
	t.HTTP2 = &http.HTTP2Config{SendPingTimeout: 30 * time.Second, PingTimeout: 15 * time.Second}
	return &http.Client{Transport: t}
}

// tokenInterceptor adds "Authorization: Bearer <token>" to every call,
// unary and streaming.
type tokenInterceptor struct{ token string }

var _ connect.Interceptor = tokenInterceptor{}

func (t tokenInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if t.token != "" && req.Spec().IsClient {
			req.Header().Set("Authorization", "Bearer "+t.token)
		}
		return next(ctx, req)
	}
}

func (t tokenInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		if t.token != "" {
			conn.RequestHeader().Set("Authorization", "Bearer "+t.token)
		}
		return conn
	}
}

func (t tokenInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// newRequestID returns a random idempotency key.
func newRequestID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		// crypto/rand does not fail on supported platforms.
		panic(fmt.Sprintf("read random bytes: %v", err))
	}
	return hex.EncodeToString(b[:])
}

// sleepCtx waits d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
