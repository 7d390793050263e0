package e2b

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// Constants the SDKs rely on.
const (
	// EnvdPort is the port the SDKs address the in-sandbox daemon on.
	EnvdPort = 49983
	// EnvdVersion is the envd version reported to SDKs; they enable
	// features by it (0.6.4 and later: everything they use).
	EnvdVersion = "0.6.13"
	// ClientID is the deprecated clientID field, constant as in E2B.
	ClientID = "6532622b"
	// DefaultDomain is the domain in sandbox host names when none is set.
	DefaultDomain = "opendsec.local"
	// MaxConcurrentBuilds bounds the template builds a gateway runs at
	// once; more wait for a slot.
	MaxConcurrentBuilds = 2
	// DefaultTemplate is the template SDKs create when none is given.
	DefaultTemplate = "base"
	// DefaultImage backs the default template unless Templates maps it:
	// E2B's base tools (deploy/images/build.sh).
	DefaultImage = "root/base"
	// CodeInterpreterTemplate is the template the code-interpreter SDKs
	// create by default.
	CodeInterpreterTemplate = "code-interpreter-v1"
	// CodeInterpreterImage backs CodeInterpreterTemplate unless Templates
	// maps it: DefaultImage plus numpy, pandas, matplotlib and pillow.
	CodeInterpreterImage = "root/code-interpreter"
	// CodeInterpreterPort is where the code-interpreter SDKs send run_code
	// and /contexts; the sandbox's agent starts the runner on demand.
	CodeInterpreterPort = 49999
	// MaxTimeoutSeconds is the longest sandbox lifetime a create accepts
	// (the platform's own limit).
	MaxTimeoutSeconds = sandboxspec.MaxTimeoutSec
	// MaxMetadata is the most metadata entries a sandbox may carry.
	MaxMetadata = 64
)

// Labels that carry E2B state on OpenDsec sandboxes.
const (
	labelTeam     = "e2b.sys/team"
	labelTemplate = "e2b.sys/template"
	// labelAlias is the name of the built template a sandbox was started
	// from (its labelTemplate is then the template's ID), as E2B reports
	// templateID and alias apart.
	labelAlias   = "e2b.sys/alias"
	labelSecure  = "e2b.sys/secure"
	labelPrivate = "e2b.sys/private"
	// labelMask is network.maskRequestHost: the Host header of requests
	// to the sandbox's user ports.
	labelMask = "e2b.sys/mask-host"
	// labelNoResume marks a sandbox created with autoResume
	// {"enabled": false}: traffic to it while paused does not resume it.
	labelNoResume = "e2b.sys/no-auto-resume"
	labelMeta     = "e2b.meta/"
)

// SandboxAPI is the part of OpenDsec's public API the gateway uses;
// opendsecv1connect.SandboxServiceClient satisfies it.
type SandboxAPI interface {
	CreateSandbox(context.Context, *connect.Request[v1.CreateSandboxRequest]) (*connect.Response[v1.CreateSandboxResponse], error)
	GetSandbox(context.Context, *connect.Request[v1.GetSandboxRequest]) (*connect.Response[v1.GetSandboxResponse], error)
	ListSandboxes(context.Context, *connect.Request[v1.ListSandboxesRequest]) (*connect.Response[v1.ListSandboxesResponse], error)
	StopSandbox(context.Context, *connect.Request[v1.StopSandboxRequest]) (*connect.Response[v1.StopSandboxResponse], error)
	SetTimeout(context.Context, *connect.Request[v1.SetTimeoutRequest]) (*connect.Response[v1.SetTimeoutResponse], error)
	SetNetwork(context.Context, *connect.Request[v1.SetNetworkRequest]) (*connect.Response[v1.SetNetworkResponse], error)
	PauseSandbox(context.Context, *connect.Request[v1.PauseSandboxRequest]) (*connect.Response[v1.PauseSandboxResponse], error)
	ResumeSandbox(context.Context, *connect.Request[v1.ResumeSandboxRequest]) (*connect.Response[v1.ResumeSandboxResponse], error)
	GetSandboxMetrics(context.Context, *connect.Request[v1.GetSandboxMetricsRequest]) (*connect.Response[v1.GetSandboxMetricsResponse], error)
	ForkSandbox(context.Context, *connect.Request[v1.ForkSandboxRequest]) (*connect.Response[v1.ForkSandboxResponse], error)
}

// Config configures a Gateway.
type Config struct {
	// API is OpenDsec's sandbox service. REST calls carry the token of the
	// API key's principal (auth.WithBearer in their context); the traffic
	// proxy's lookups carry the client's own (the gateway's service token).
	API SandboxAPI
	// Tokens mints the user-scope tokens the gateway calls the API with on
	// behalf of each API key's principal: the issuer (it holds the private
	// key).
	Tokens auth.Minter
	// Keys authenticates E2B API keys.
	Keys *KeyStore
	// Nodes says where sandbox traffic goes, by the node in the sandbox ID
	// (nodeclient.StaticDirectory of the config's nodes[]).
	Nodes nodeclient.Directory
	// NodeHTTPClient reaches nodes for envd traffic; nil means
	// nodeclient.DefaultHTTPClient (h2c). Port tunnels use a copy of its
	// transport limited to HTTP/1.1.
	NodeHTTPClient *http.Client
	// NodeTokens supplies the node-scope token of calls to nodes.
	NodeTokens auth.TokenSource
	// Secret derives each sandbox's envd access token (HMAC of its ID).
	Secret []byte
	// Domain is returned to SDKs and routes Host <port>-<id>.<Domain>.
	Domain string
	// Templates map E2B template names to OpenDsec images; a template not
	// listed is used as an image name as is.
	Templates map[string]string
	// User is the default user of E2B sandboxes ("user", as in E2B's
	// images, when empty).
	User string
	// Snapshots is OpenDsec's snapshot service (calls carry the key's
	// principal's token like API's); nil answers the snapshot routes 501.
	Snapshots SnapshotAPI
	// DenyInternetByDefault: a create that names no network option gets
	// the node's default rule sets (by default no network) instead of
	// E2B's default, the public internet (config
	// e2b.default_internet_access: false).
	DenyInternetByDefault bool
	// NoPrivilegeEscalation keeps no_new_privs in E2B sandboxes (config
	// e2b.allow_privilege_escalation: false); by default they allow it,
	// so sudo works as in E2B.
	NoPrivilegeEscalation bool
	// Backend runs the sandboxes E2B creates (config e2b.backend); empty
	// means the node's default. Creates from a snapshot keep its source's.
	Backend string
	// Images is OpenDsec's image service, for template lookups
	// (GET /templates/aliases/{alias}); nil answers only the configured
	// templates and snapshots.
	Images ImageAPI
	// Trajectory reads sandboxes' trajectory logs (calls carry the key's
	// principal's token like API's) for the sandbox logs routes; nil
	// answers them with the sandbox's start only.
	Trajectory TrajectoryAPI
	// Builder runs the native image builds of E2B template builds
	// (NewImageBuilder of the image service); nil answers the template
	// build routes 501.
	Builder ImageBuilder
	// StateDir keeps the templates built through the gateway and their
	// uploaded files (the data dir's e2b/); empty keeps templates in
	// memory and files in a temporary directory.
	StateDir string
	// MaxTemplateUpload bounds one uploaded COPY archive (and its unpacked
	// size); 0 means DefaultMaxTemplateUpload.
	MaxTemplateUpload int64
	// ReadyTimeout bounds the wait of a create from a template with a
	// start command for its ready command; 0 means DefaultReadyTimeout.
	ReadyTimeout time.Duration
}

// Gateway serves the E2B REST API and sandbox traffic. Create it with New.
type Gateway struct {
	cfg   Config
	nodes *nodeclient.Pool
	api   http.Handler
	prom  *promMetrics
	tpls  *tplStore
	// buildSlots bounds the template builds running at once.
	buildSlots chan struct{}
	// builds are the template builds running (tests wait for them).
	builds sync.WaitGroup
	// trajectory, if set, reads a sandbox's calls instead of the API's
	// GetTrajectory (tests).
	trajectory func(ctx context.Context, id string) ([]*v1.TrajectoryEntry, bool, error)

	tokMu sync.Mutex
	// toks are the principals' renewing tokens; guarded by tokMu.
	toks map[string]*auth.ServiceToken

	cacheMu sync.Mutex
	// cache remembers recent sandbox lookups of the traffic proxy; guarded
	// by cacheMu.
	cache map[string]cachedSandbox
}

type cachedSandbox struct {
	secure  bool // envd needs the access token
	private bool // user ports need the traffic access token
	// mask is the Host header of requests to user ports (network.
	// maskRequestHost, ${PORT} not yet replaced); empty keeps the caller's.
	mask string
	// noResume: created with autoResume false; calls ask the node not to
	// resume it (nodeclient.NoAutoResumeHeader).
	noResume bool
	at       time.Time
}

// New checks cfg and returns a Gateway.
func New(cfg Config) (*Gateway, error) {
	if cfg.API == nil {
		return nil, errdefs.Invalid("api", "is nil; give an OpenDsec sandbox service client")
	}
	if cfg.Tokens == nil {
		return nil, errdefs.Invalid("tokens", "is nil; give the issuer that mints the principals' tokens")
	}
	if cfg.Keys == nil {
		return nil, errdefs.Invalid("keys", "is nil; give a key store")
	}
	if len(cfg.Secret) < 16 {
		return nil, errdefs.Invalid("secret", "must be at least 16 bytes")
	}
	if cfg.Nodes == nil {
		return nil, errdefs.Invalid("nodes", "is nil; give a node directory (nodeclient.NewStaticDirectory of the config's nodes)")
	}
	if cfg.NodeTokens == nil {
		return nil, errdefs.Invalid("node_tokens", "is nil; give a source of node-scope tokens")
	}
	if cfg.Domain == "" {
		cfg.Domain = DefaultDomain
	}
	if cfg.User == "" {
		cfg.User = "user"
	}
	if cfg.Builder != nil && cfg.StateDir == "" {
		d, err := os.MkdirTemp("", "opendsec-e2b-")
		if err != nil {
			return nil, err
		}
		cfg.StateDir = d
	}
	tplPath := ""
	if cfg.StateDir != "" {
		tplPath = filepath.Join(cfg.StateDir, "templates.json")
	}
	tpls, err := newTplStore(tplPath)
	if err != nil {
		return nil, err
	}
	g := &Gateway{
		tpls:       tpls,
		buildSlots: make(chan struct{}, MaxConcurrentBuilds),
		cfg:        cfg,
		nodes:      nodeclient.NewPool(cfg.Nodes, nodeclient.Options{HTTPClient: cfg.NodeHTTPClient, Tokens: cfg.NodeTokens}),
		toks:       map[string]*auth.ServiceToken{},
		cache:      map[string]cachedSandbox{},
		prom:       newPromMetrics(),
	}
	g.api = g.apiMux()
	return g, nil
}

// ServeHTTP routes sandbox traffic (E2b-Sandbox-Id header, or Host
// <port>-<id>.<domain>) to the proxy and everything else to the REST API,
// counting each request by route and status code.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	sw := &statusWriter{ResponseWriter: w}
	route := g.route(sw, r)
	g.prom.requests.WithLabelValues(route, sw.status()).Inc()
}

// route serves r and returns its route label.
func (g *Gateway) route(w http.ResponseWriter, r *http.Request) string {
	if id := r.Header.Get("E2b-Sandbox-Id"); id != "" {
		ps := r.Header.Get("E2b-Sandbox-Port")
		if ps == "" {
			http.Error(w, "missing header E2b-Sandbox-Port", http.StatusBadRequest)
			return routeProxy
		}
		port, err := strconv.Atoi(ps)
		if err != nil || port < 1 || port > 65535 {
			http.Error(w, "Invalid sandbox port", http.StatusBadRequest)
			return routeProxy
		}
		g.proxy(w, r, id, port)
		return routeProxy
	}
	if id, port, ok := g.hostRoute(r.Host); ok {
		g.proxy(w, r, id, port)
		return routeProxy
	}
	if r.URL.Path == "/files" && r.URL.Query().Get("signature") != "" {
		// A signed file URL made while E2B_SANDBOX_URL is set carries no
		// routing headers: find the sandbox whose token made the signature.
		id, err := g.signedFileSandbox(r)
		if err != nil {
			writeErr(w, err)
			return routeProxy
		}
		g.proxy(w, r, id, EnvdPort)
		return routeProxy
	}
	// The mux sets r.Pattern to the pattern that matched ("/" for no route).
	g.api.ServeHTTP(w, r)
	return r.Pattern
}

// hostRoute parses Host <port>-<id>.<domain>.
func (g *Gateway) hostRoute(host string) (id string, port int, ok bool) {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	first, rest, found := strings.Cut(host, ".")
	if !found || !strings.EqualFold(rest, g.cfg.Domain) {
		return "", 0, false
	}
	ps, id, found := strings.Cut(first, "-")
	if !found {
		return "", 0, false
	}
	port, err := strconv.Atoi(ps)
	if err != nil || port < 1 || port > 65535 {
		return "", 0, false
	}
	return id, port, true
}

// principalTokenTTL is the lifetime of the tokens the gateway acts for a
// principal with; each is renewed at half of it when next used.
const principalTokenTTL = time.Hour

// principalToken returns the current user-scope token of principal p,
// minting (and later renewing) it with the issuer.
func (g *Gateway) principalToken(p string) (string, error) {
	g.tokMu.Lock()
	defer g.tokMu.Unlock()
	st, ok := g.toks[p]
	if !ok {
		var err error
		st, err = auth.NewServiceToken(g.cfg.Tokens, p, auth.ScopeUser, principalTokenTTL)
		if err != nil {
			return "", err
		}
		if len(g.toks) > 10000 {
			clear(g.toks)
		}
		g.toks[p] = st
	}
	return st.Token(), nil
}

// accessToken is the envd access token of sandbox id.
func (g *Gateway) accessToken(id string) string {
	m := hmac.New(sha256.New, g.cfg.Secret)
	m.Write([]byte("e2b envd access token\x00" + id))
	return hex.EncodeToString(m.Sum(nil))
}

// apiError is E2B's error body.
type apiError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, format string, args ...any) {
	writeJSON(w, status, apiError{Code: status, Message: fmt.Sprintf(format, args...)})
}

// writeErr maps an error category to E2B's status codes.
func writeErr(w http.ResponseWriter, err error) {
	status, msg := errdefs.ToHTTP(context.Background(), err)
	switch status {
	case http.StatusGatewayTimeout, http.StatusServiceUnavailable, http.StatusBadRequest,
		http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound, http.StatusConflict,
		http.StatusTooManyRequests, http.StatusNotImplemented:
	default:
		if status >= 500 {
			status = http.StatusInternalServerError
		}
	}
	writeError(w, status, "%s", msg)
}
