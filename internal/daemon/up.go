package daemon

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sync/errgroup"

	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/kernflux/opendsec/internal/apiserver"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/node"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/container"
	"github.com/kernflux/opendsec/internal/watcher"
)

// UpOptions control Up.
type UpOptions struct {
	// StopSandboxes stops every sandbox at shutdown instead of leaving them
	// running for the next start to recover.
	StopSandboxes bool
	PidFile       string
	// ReadyFile receives the apiserver endpoint once everything serves.
	ReadyFile string
}

// serviceToken issues the token components use to call nodes.
//
// It is minted in memory at start and never leaves the process, so it lives
// as long as a process may run (a 30-day token broke every node call of an
// `opendsec up` that ran longer). Rotation comes with the cluster CA and mTLS.
func serviceToken(key []byte) (string, error) {
	return auth.Issue(key, "opendsec-internal", auth.ScopeNode, serviceTokenTTL)
}

// serviceTokenTTL is the lifetime of in-process service tokens.
const serviceTokenTTL = 10 * 365 * 24 * time.Hour

// newNode builds the node from cfg: image store, backends, sandbox table.
func newNode(ctx context.Context, cfg config.Config) (*node.Node, error) {
	store, err := image.Open(cfg.Node.ImageDir)
	if err != nil {
		return nil, fmt.Errorf("open image store: %w", err)
	}
	ct, err := container.New(container.Config{})
	if err != nil {
		return nil, fmt.Errorf("container backend: %w", err)
	}
	nw, err := newNetwork(ctx, cfg)
	if err != nil {
		return nil, err
	}
	ncfg := node.Config{
		ID:             cfg.Node.ID,
		StateDir:       filepath.Join(cfg.DataDir, "node"),
		AgentPath:      cfg.Node.AgentPath,
		InitPath:       cfg.Node.InitPath,
		AgentIdleExit:  agentIdleExit(cfg.Node.AgentIdleExitMS),
		Backends:       map[string]runtime.Runtime{"container": ct},
		DefaultBackend: cfg.Node.DefaultBackend,
		Images:         store,
		CPU:            cfg.Node.CPU,
		MemoryMB:       cfg.Node.MemoryMB,
		MaxSandboxes:   cfg.Node.MaxSandboxes,
	}
	if nw != nil {
		ncfg.Network = nw
	}
	n, err := node.New(ctx, ncfg)
	if err != nil {
		if nw != nil {
			nw.Close()
		}
		return nil, err
	}
	return n, nil
}

// newNetwork starts the network policy manager, or returns nil when it is
// turned off, or unset and this machine cannot run it.
func newNetwork(ctx context.Context, cfg config.Config) (*netpolicy.Manager, error) {
	en := cfg.Node.Network.Enabled
	if en != nil && !*en {
		log.G(ctx).Warn("network policy is off (node.network.enabled=false): sandboxes have no network")
		return nil, nil
	}
	m, err := netpolicy.New(ctx, cfg.Node.Network.Config, cfg.DataDir)
	if err != nil {
		if en != nil || errdefs.IsInvalidArgument(err) {
			return nil, fmt.Errorf("start network policy: %w", err)
		}
		log.G(ctx).Warn("network policy unavailable; sandboxes have no network (set node.network.enabled to decide)", log.Err(err))
		return nil, nil
	}
	return m, nil
}

func nodeHandlerOpts(key []byte) (*auth.Verifier, []connect.HandlerOption) {
	v := auth.NewVerifier(key, auth.ScopeNode, auth.ScopeAdmin)
	return v, []connect.HandlerOption{connect.WithInterceptors(v.Interceptor())}
}

// RunNode serves a node until ctx ends. Sandboxes keep running after.
func RunNode(ctx context.Context, cfg config.Config, key []byte, ready chan<- string) error {
	n, err := newNode(ctx, cfg)
	if err != nil {
		return err
	}
	defer n.Close()
	v, opts := nodeHandlerOpts(key)
	return serve(ctx, "node", cfg.Node.Listen, nodeMux(n, v, opts), ready)
}

func nodeMux(n *node.Node, v *auth.Verifier, opts []connect.HandlerOption) *muxWithProxy {
	rpc := http.NewServeMux()
	rpc.Handle("/", n.Handler(opts...))
	rpc.Handle(n.ImageHandler(opts...))
	return &muxWithProxy{rpc: rpc, proxy: v.Middleware(n.AgentProxy())}
}

// RunWatcher serves the watcher until ctx ends.
func RunWatcher(ctx context.Context, cfg config.Config, key []byte, ready chan<- string) error {
	tok, err := serviceToken(key)
	if err != nil {
		return err
	}
	w := watcher.New(cfg.Watcher, cfg.Nodes, h2cClient(), tok)
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return w.Run(ctx) })
	g.Go(func() error {
		v := auth.NewVerifier(key, auth.ScopeNode, auth.ScopeAdmin)
		mux := http.NewServeMux()
		mux.Handle(w.Handler(connect.WithInterceptors(v.Interceptor())))
		return serve(ctx, "watcher", cfg.Watcher.Listen, mux, ready)
	})
	return g.Wait()
}

// RunAPIServer serves the public API until ctx ends.
func RunAPIServer(ctx context.Context, cfg config.Config, key []byte, ready chan<- string) error {
	tok, err := serviceToken(key)
	if err != nil {
		return err
	}
	hc := h2cClient()
	wc := watcherv1connect.NewWatcherServiceClient(hc, cfg.APIServer.WatcherAddress,
		connect.WithInterceptors(auth.ClientInterceptor(tok)))
	srv, err := apiserver.New(apiserver.Config{
		Nodes:      cfg.Nodes,
		Watcher:    wc,
		HTTPClient: hc,
		NodeToken:  tok,
		// Callers only: node-scope tokens are for component-to-node calls.
		Auth:            auth.NewVerifier(key, auth.ScopeAdmin, auth.ScopeUser),
		MaxUploadBytes:  cfg.Node.MaxUploadMB << 20,
		PlacementSample: cfg.APIServer.PlacementSample,
		PlacementHold:   2 * time.Duration(cfg.Watcher.PollIntervalMS) * time.Millisecond,
	})
	if err != nil {
		return err
	}
	return serve(ctx, "apiserver", cfg.APIServer.Listen, srv.Handler(), ready)
}

// Up runs node, watcher and apiserver in one process until ctx ends.
func Up(ctx context.Context, cfg config.Config, o UpOptions) error {
	key, err := loadKey(cfg)
	if err != nil {
		return err
	}
	if _, err := EnsureBootstrapToken(cfg, key); err != nil {
		return err
	}
	if o.PidFile != "" {
		if err := os.WriteFile(o.PidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
			return fmt.Errorf("write pid file: %w", err)
		}
		defer os.Remove(o.PidFile)
	}
	n, err := newNode(ctx, cfg)
	if err != nil {
		return err
	}
	defer n.Close()

	g, gctx := errgroup.WithContext(ctx)
	nodeReady, watcherReady, apiReady := make(chan string, 1), make(chan string, 1), make(chan string, 1)
	g.Go(func() error {
		v, opts := nodeHandlerOpts(key)
		return serve(gctx, "node", cfg.Node.Listen, nodeMux(n, v, opts), nodeReady)
	})
	g.Go(func() error { return RunWatcher(gctx, cfg, key, watcherReady) })
	g.Go(func() error { return RunAPIServer(gctx, cfg, key, apiReady) })
	e2bReady := make(chan string, 1)
	g.Go(func() error { return RunE2B(gctx, cfg, key, e2bReady) })
	g.Go(func() error {
		var api string
		for _, ch := range []chan string{nodeReady, watcherReady, e2bReady, apiReady} {
			select {
			case a := <-ch:
				api = a
			case <-gctx.Done():
				return nil
			}
		}
		if err := waitNodeSeen(gctx, cfg, key); err != nil {
			return err
		}
		log.G(ctx).Info("opendsec is up", "endpoint", api, "token_file", filepath.Join(cfg.DataDir, BootstrapTokenFile))
		if o.ReadyFile != "" {
			if err := os.WriteFile(o.ReadyFile, []byte(api+"\n"), 0o644); err != nil {
				return fmt.Errorf("write ready file: %w", err)
			}
		}
		return nil
	})
	err = g.Wait()
	if o.StopSandboxes {
		n.StopAll(context.WithoutCancel(ctx), "opendsec up --stop-sandboxes shutdown")
	}
	if err != nil && ctx.Err() == nil {
		return err
	}
	log.G(ctx).Info("opendsec stopped", "sandboxes_left_running", !o.StopSandboxes)
	return nil
}

// muxWithProxy sends agent traffic to the (authenticated) agent proxy and
// everything else to the node's RPC handler.
type muxWithProxy struct {
	rpc, proxy http.Handler
}

func (m *muxWithProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.HasPrefix(r.URL.Path, node.AgentPrefix) {
		m.proxy.ServeHTTP(w, r)
		return
	}
	m.rpc.ServeHTTP(w, r)
}

// waitNodeSeen waits until the watcher reports this machine's node healthy,
// so the first create after "up" has somewhere to go.
func waitNodeSeen(ctx context.Context, cfg config.Config, key []byte) error {
	tok, err := serviceToken(key)
	if err != nil {
		return err
	}
	wc := watcherv1connect.NewWatcherServiceClient(h2cClient(), cfg.APIServer.WatcherAddress,
		connect.WithInterceptors(auth.ClientInterceptor(tok)))
	ctx, cancel := context.WithTimeoutCause(ctx, 60*time.Second,
		fmt.Errorf("the watcher at %s did not see node %s within 60s", cfg.APIServer.WatcherAddress, cfg.Node.ID))
	defer cancel()
	t := time.NewTicker(25 * time.Millisecond)
	defer t.Stop()
	for {
		resp, err := wc.ListNodes(ctx, connect.NewRequest(&watcherv1.ListNodesRequest{}))
		if err == nil {
			for _, n := range resp.Msg.GetNodes() {
				if n.GetNodeId() == cfg.Node.ID && n.GetHealthy() {
					return nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-t.C:
		}
	}
}

// agentIdleExit maps node.agent_idle_exit_ms (0: never) to
// node.Config.AgentIdleExit (negative: never).
func agentIdleExit(ms int64) time.Duration {
	if ms == 0 {
		return -1
	}
	return time.Duration(ms) * time.Millisecond
}
