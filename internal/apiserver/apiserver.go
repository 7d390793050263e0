// Package apiserver serves OpenDsec's public API (opendsec.v1
// SandboxService, ProcessService, FileService, PortService). It is
// stateless: creates are placed with the watcher's view of the nodes, every
// other call is routed by the node encoded in the sandbox ID, and exec,
// files and ports go through the node's proxy to the sandbox's agent
// (<node>/agent/<id>/..., the envd protocol).
package apiserver

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/httpserver"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/placement"
)

// WatcherClient is the part of the watcher's API the apiserver uses;
// watcherv1connect.WatcherServiceClient satisfies it.
type WatcherClient interface {
	ListNodes(context.Context, *connect.Request[watcherv1.ListNodesRequest]) (*connect.Response[watcherv1.ListNodesResponse], error)
}

// Defaults for the zero fields of Config.
const (
	DefaultMaxUploadBytes   = 1 << 30
	DefaultMaxHTTPBodyBytes = 64 << 20
	DefaultBatchConcurrency = 8
	DefaultViewTTL          = 250 * time.Millisecond
	// DefaultViewMaxStale is how old a watcher view may be and still serve
	// a placement while a fresh one is fetched in the background.
	DefaultViewMaxStale = 2 * time.Second
	// DefaultBatchNodeTimeout bounds one node's part of a batch pause or
	// resume.
	DefaultBatchNodeTimeout = 15 * time.Second
	// DefaultReclaimNodeTimeout bounds one node's part of a batch pause
	// with reclaim: pushing out the memory of a node's paused sandboxes
	// takes longer than freezing them (200 sandboxes of 30 MiB into zram
	// on 2 cores: about 15 s).
	DefaultReclaimNodeTimeout = 5 * time.Minute
	// MaxBatch is the most sandboxes one BatchCreateSandboxes makes.
	MaxBatch = 32768
	// readChunk is the size of ReadFile's messages.
	readChunk = 1 << 20
)

// Config configures a Server.
type Config struct {
	// Nodes says where the nodes to route to listen, by ID
	// (nodeclient.StaticDirectory of the config's nodes[]). Required.
	Nodes nodeclient.Directory
	// Watcher serves the view of the nodes used for placement and listing.
	Watcher WatcherClient
	// HTTPClient reaches nodes; nil means nodeclient.DefaultHTTPClient
	// (h2c, no timeouts: exec streams are long). The node token is added to
	// every request.
	HTTPClient *http.Client
	// NodeToken is a "node"-scope token for calls to nodes.
	NodeToken string
	// NodeTokens, when set, replaces NodeToken: each call to a node takes
	// its current token (a renewed auth.ServiceToken).
	NodeTokens auth.TokenSource
	// Auth verifies callers' tokens. Required.
	Auth *auth.Verifier
	// MaxUploadBytes caps one WriteFile (DefaultMaxUploadBytes if 0).
	MaxUploadBytes int64
	// MaxHTTPBodyBytes caps HTTPRequest's response body.
	MaxHTTPBodyBytes int64
	// PlacementSample is k in power-of-k placement (2 if 0).
	PlacementSample int
	// ViewTTL is how long a fetched watcher view is reused as it is.
	ViewTTL time.Duration
	// ViewMaxStale: an older view (younger than this) still serves while
	// a fresh one is fetched in the background, so that a create after a
	// quiet spell does not wait for the watcher. At or below ViewTTL:
	// always fetch synchronously.
	ViewMaxStale time.Duration
	// BatchConcurrency bounds the creates one batch runs at once.
	BatchConcurrency int
	// BatchNodeTimeout bounds each node's part of PauseSandboxes and
	// ResumeSandboxes (DefaultBatchNodeTimeout if 0): a node that does not
	// answer in time is reported as that node's failure, and the others'
	// results come back without waiting for it.
	BatchNodeTimeout time.Duration
	// ReclaimNodeTimeout is BatchNodeTimeout for a pause with reclaim
	// (DefaultReclaimNodeTimeout if 0).
	ReclaimNodeTimeout time.Duration
}

// Server implements the public services. Create it with New.
type Server struct {
	cfg    Config
	nodes  *nodeclient.Pool
	placer *placement.Placer

	viewMu sync.Mutex
	// view and viewAt cache the watcher's answer; viewFetching is set
	// while a background fetch runs; all guarded by viewMu.
	view         []*watcherv1.NodeStatus
	viewAt       time.Time
	viewFetching bool

	metrics *metrics
}

var (
	_ opendsecv1connect.SandboxServiceHandler = (*Server)(nil)
	_ opendsecv1connect.ProcessServiceHandler = (*Server)(nil)
	_ opendsecv1connect.FileServiceHandler    = (*Server)(nil)
	_ opendsecv1connect.PortServiceHandler    = (*Server)(nil)
)

// New checks cfg, fills defaults and returns a Server.
func New(cfg Config) (*Server, error) {
	if cfg.Nodes == nil {
		return nil, errdefs.Invalid("nodes", "is nil; give a node directory (nodeclient.NewStaticDirectory of the config's nodes)")
	}
	if cfg.Watcher == nil {
		return nil, errdefs.Invalid("watcher", "is nil; give a watcher client")
	}
	if cfg.Auth == nil {
		return nil, errdefs.Invalid("auth", "is nil; every call must be authenticated")
	}
	if cfg.MaxUploadBytes <= 0 {
		cfg.MaxUploadBytes = DefaultMaxUploadBytes
	}
	if cfg.MaxHTTPBodyBytes <= 0 {
		cfg.MaxHTTPBodyBytes = DefaultMaxHTTPBodyBytes
	}
	if cfg.PlacementSample <= 0 {
		cfg.PlacementSample = 2
	}
	if cfg.ViewTTL <= 0 {
		cfg.ViewTTL = DefaultViewTTL
	}
	if cfg.ViewMaxStale == 0 {
		cfg.ViewMaxStale = DefaultViewMaxStale
	}
	if cfg.BatchConcurrency <= 0 {
		cfg.BatchConcurrency = DefaultBatchConcurrency
	}
	if cfg.ReclaimNodeTimeout <= 0 {
		cfg.ReclaimNodeTimeout = DefaultReclaimNodeTimeout
	}
	if cfg.BatchNodeTimeout <= 0 {
		cfg.BatchNodeTimeout = DefaultBatchNodeTimeout
	}
	nodeTokens := cfg.NodeTokens
	if nodeTokens == nil {
		nodeTokens = auth.StaticToken(cfg.NodeToken)
	}
	s := &Server{
		cfg:    cfg,
		nodes:  nodeclient.NewPool(cfg.Nodes, nodeclient.Options{HTTPClient: cfg.HTTPClient, Tokens: nodeTokens}),
		placer: placement.New(cfg.PlacementSample),

		metrics: newMetrics(),
	}
	return s, nil
}

// Handler returns all public services behind the auth interceptor (with
// request metrics), plus an unauthenticated GET /healthz and GET /metrics.
func (s *Server) Handler() http.Handler {
	opts := []connect.HandlerOption{
		connect.WithInterceptors(metricsInterceptor{s.metrics}, s.cfg.Auth.Interceptor(), errdefs.Interceptor()),
		connect.WithCodec(protoCodec{}),
		// Room for a full HTTPRequest body plus framing.
		connect.WithReadMaxBytes(int(s.cfg.MaxHTTPBodyBytes) + 1<<20),
		// Answers under 16 KiB go uncompressed, as the node's: a gzip
		// writer's reset and flush for each small message (each result of
		// a batch create, each stop) cost more CPU than the bytes saved.
		connect.WithCompressMinBytes(httpserver.CompressMinBytes),
	}
	mux := http.NewServeMux()
	mux.Handle(opendsecv1connect.NewSandboxServiceHandler(s, opts...))
	// Exec output is never compressed (see the agent's process handler):
	// compressed, the transport windows to a slow reader held hundreds of
	// MiB of `yes` output ahead of the exit. Requests may still be gzip.
	mux.Handle(opendsecv1connect.NewProcessServiceHandler(s, append(opts[:len(opts):len(opts)], connect.WithCompressMinBytes(math.MaxInt))...))
	mux.Handle(opendsecv1connect.NewFileServiceHandler(s, opts...))
	mux.Handle(s.portServiceHandler(opts...))
	mux.Handle(opendsecv1connect.NewImageServiceHandler(s, opts...))
	mux.Handle(opendsecv1connect.NewSnapshotServiceHandler(s, opts...))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	})
	mux.Handle("GET /metrics", s.metricsHandler())
	return mux
}

// nodeFor routes a sandbox ID to its node's client through the node
// directory. field names the request field carrying the ID.
func (s *Server) nodeFor(ctx context.Context, field, id string) (*nodeclient.Client, error) {
	return s.nodes.ForSandbox(ctx, field, id)
}

// nodeView returns the watcher's view, reusing it for ViewTTL.
func (s *Server) nodeView(ctx context.Context) ([]*watcherv1.NodeStatus, error) {
	s.viewMu.Lock()
	defer s.viewMu.Unlock()
	age := time.Since(s.viewAt)
	if s.view != nil && age < s.cfg.ViewTTL {
		return s.view, nil
	}
	if s.view != nil && age < s.cfg.ViewMaxStale {
		if !s.viewFetching {
			s.viewFetching = true
			go s.refreshView()
		}
		return s.view, nil
	}
	resp, err := s.cfg.Watcher.ListNodes(ctx, connect.NewRequest(&watcherv1.ListNodesRequest{}))
	if err != nil {
		err = errdefs.FromConnect(err)
		if connect.CodeOf(err) == connect.CodeUnknown || errors.Is(err, errdefs.ErrInternal) {
			err = errdefs.New(errdefs.ErrUnavailable, "watcher: %s", err)
		}
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	s.view, s.viewAt = resp.Msg.GetNodes(), time.Now()
	return s.view, nil
}

// viewFetchTimeout bounds a background fetch of the watcher's view.
const viewFetchTimeout = 5 * time.Second

// refreshView fetches the watcher's view in the background (nodeView serves
// the previous one meanwhile); a failure leaves the old view to age out.
func (s *Server) refreshView() {
	ctx, cancel := context.WithTimeout(context.Background(), viewFetchTimeout)
	defer cancel()
	resp, err := s.cfg.Watcher.ListNodes(ctx, connect.NewRequest(&watcherv1.ListNodesRequest{}))
	s.viewMu.Lock()
	defer s.viewMu.Unlock()
	s.viewFetching = false
	if err != nil {
		log.G(ctx).Debug("refresh watcher view", log.Err(err))
		return
	}
	s.view, s.viewAt = resp.Msg.GetNodes(), time.Now()
}

// remoteErr converts an error from a node or agent call into a categorized
// error carrying the remote message (nodeclient.MapError).
func remoteErr(ctx context.Context, what string, err error) error {
	return nodeclient.MapError(ctx, what, err)
}
