package daemon

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
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
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
	"github.com/kernflux/opendsec/internal/runtime/microvm"
	"github.com/kernflux/opendsec/internal/runtime/sched"
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

// serviceTokenTTL is the lifetime of the service tokens components mint
// for calls to each other; each is renewed at half its lifetime by the
// component holding it. (A variable so tests can shorten it.)
var serviceTokenTTL = auth.ServiceTokenTTL

// startServiceToken issues a short-lived service token for subject and
// renews it in the background until ctx ends.
func startServiceToken(ctx context.Context, iss *auth.Issuer, subject, scope string) (*auth.ServiceToken, error) {
	st, err := auth.NewServiceToken(iss, subject, scope, serviceTokenTTL)
	if err != nil {
		return nil, fmt.Errorf("issue %s service token: %w", subject, err)
	}
	go st.Run(ctx)
	return st, nil
}

// nodeShutdownTimeout bounds the node's wait for creates, stops and pauses
// in flight at shutdown; what is still running then is left for recovery at
// the next start. The HTTP servers have had up to 10s to drain before.
const nodeShutdownTimeout = 20 * time.Second

// localNode is a node with the network manager it was built with.
type localNode struct {
	*node.Node
	net   *netpolicy.Manager // nil when network policy is off
	accel *node.Accelerator  // nil if detection failed
	// defaultBackend is the node's default backend and why.
	defaultBackend backendChoice
}

// shutdown shuts the node down (bounded by nodeShutdownTimeout), then the
// network manager's DNS proxy and netlink sockets: no create or stop uses
// them after the node has stopped. Sandboxes and their networks stay.
func (ln *localNode) shutdown(ctx context.Context) error {
	ctx, cancel := context.WithTimeoutCause(context.WithoutCancel(ctx), nodeShutdownTimeout,
		fmt.Errorf("node shutdown exceeded %s", nodeShutdownTimeout))
	defer cancel()
	err := ln.Node.Shutdown(ctx)
	if ln.net != nil {
		if nerr := ln.net.Close(); nerr != nil {
			err = errors.Join(err, fmt.Errorf("close network policy: %w", nerr))
		}
	}
	return err
}

// newNode builds the node from cfg: image store, backends, network policy,
// sandbox table.
func newNode(ctx context.Context, cfg config.Config) (*localNode, error) {
	maxPaused, err := cfg.Node.MaxPausedDuration()
	if err != nil {
		return nil, err
	}
	store, err := image.Open(cfg.Node.ImageDir)
	if err != nil {
		return nil, fmt.Errorf("open image store: %w", err)
	}
	bcfg, err := cfg.Node.BackendConfigs()
	if err != nil {
		return nil, err
	}
	limits, err := cfg.Node.Limits()
	if err != nil {
		return nil, err
	}
	cpuOver, memOver, err := cfg.Node.Overcommit()
	if err != nil {
		return nil, err
	}
	stateDir := filepath.Join(cfg.DataDir, "node")
	renv := runtime.Env{NodeID: cfg.Node.ID, StateDir: stateDir, Limits: limits, MaxUploadBytes: cfg.Node.MaxUploadMB << 20}
	backends, err := runtime.Open(ctx, renv, bcfg)
	if err != nil {
		return nil, err
	}
	accelRes, accelErr := detectAccel(ctx, cfg)
	var accel *node.Accelerator
	if accelRes != nil {
		accel = acceleratorOf(*accelRes)
	}
	choice, extra, err := chooseDefaultBackend(hostBackendFacts(ctx, cfg, renv, slices.Sorted(maps.Keys(backends)), accelRes, accelErr))
	if err != nil {
		return nil, err
	}
	if extra != nil {
		backends[choice.Backend] = extra
	}
	log.G(ctx).Info(choice.String(), "default_backend", choice.Backend, "reason", choice.Reason)
	nw, err := newNetwork(ctx, cfg)
	if err != nil {
		if extra != nil {
			_ = closeRuntime(extra)
		}
		return nil, err
	}
	ncfg := node.Config{
		ID:       cfg.Node.ID,
		StateDir: stateDir,
		Pool: node.PoolConfig{
			Size:    cfg.Node.WarmPool.Size,
			Max:     cfg.Node.WarmPool.MaxSandboxes,
			IdleTTL: time.Duration(cfg.Node.WarmPool.IdleTTLSec) * time.Second,
		},
		Backends:             backends,
		DefaultBackend:       choice.Backend,
		DefaultBackendReason: choice.Reason,
		Images:               store,
		CPU:                  cfg.Node.CPU,
		MemoryMB:             cfg.Node.MemoryMB,
		MaxSandboxes:         cfg.Node.MaxSandboxes,
		CPUOvercommit:        cpuOver,
		MemoryOvercommit:     memOver,
		MaxPidsLimit:         limits.MaxPidsLimit,
		DiskDefaultMB:        cfg.Node.Disk.DefaultMB,
		DiskMaxMB:            cfg.Node.Disk.MaxMB,
		DiskReserveMB:        cfg.Node.Disk.ReserveMB,
		MaxPaused:            maxPaused,
		MaxUploadBytes:       cfg.Node.MaxUploadMB << 20,
		Build: node.BuildConfig{
			Timeout:         time.Duration(cfg.Node.Build.TimeoutSec) * time.Second,
			MaxTimeout:      time.Duration(cfg.Node.Build.MaxTimeoutSec) * time.Second,
			MaxContextBytes: cfg.Node.Build.MaxContextMB << 20,
			RuleSets:        cfg.Node.Build.RuleSets,
			CPU:             cfg.Node.Build.CPU,
			MemoryMB:        cfg.Node.Build.MemoryMB,
			DiskMB:          cfg.Node.Build.DiskMB,
		},
		DeferTeardown: true,
		Trajectory:    trajectoryConfig(cfg.Node.Trajectory),
		Accelerator:   accel,
	}
	ncfg.CoreScheduling = coreScheduling()
	if _, ok := backends[microvm.Name]; !ok {
		// "auto" found microvm cannot run at this boot: microvm sandboxes
		// of an earlier one must not be left unmanaged (node.New refuses).
		ncfg.Unavailable = map[string]string{microvm.Name: "not opened; default backend " + choice.Backend + ": " + choice.Reason}
	}
	if nw != nil {
		ncfg.Network = nw
	}
	n, err := node.New(ctx, ncfg)
	if err != nil {
		if nw != nil {
			nw.Close()
		}
		if extra != nil {
			_ = closeRuntime(extra)
		}
		return nil, err
	}
	return &localNode{Node: n, net: nw, accel: accel, defaultBackend: choice}, nil
}

// detectAccel decides the accelerator VM backends use on this host (once
// coreScheduling is the host's core-scheduling decision for the node's Info.
func coreScheduling() *node.CoreScheduling {
	core := sched.Core()
	return &node.CoreScheduling{Enabled: core.Enabled, Reason: core.Reason}
}

// detectAccel decides the accelerator VM backends use on this host (once
// per boot, cached) and logs it; nil and why if it cannot be decided, which
// only VM backends and the default backend's choice need.
func detectAccel(ctx context.Context, cfg config.Config) (*kvmprobe.Result, error) {
	r, err := kvmprobe.Detect(ctx, kvmprobe.Options{PVMGuestKernel: cfg.Node.PVMGuestKernel})
	if err != nil {
		log.G(ctx).Warn("accelerator not detected", log.Err(err))
		return nil, err
	}
	log.G(ctx).Info("vm accelerator", "accel", r.Accel, "kind", r.Kind, "module", r.Module, "reason", r.Reason)
	return &r, nil
}

// acceleratorOf is r for the node's Info.
func acceleratorOf(r kvmprobe.Result) *node.Accelerator {
	return &node.Accelerator{Accel: string(r.Accel), Kind: string(r.Kind), Module: r.Module, Reason: r.Reason,
		ProbeInstructions: r.ProbeInstructions, ProbeDuration: r.ProbeDuration, DetectedAt: r.DetectedAt}
}

// newNetwork starts the network policy manager, or returns nil when it is
// turned off, or unset and this machine cannot run it.
func newNetwork(ctx context.Context, cfg config.Config) (*netpolicy.Manager, error) {
	en := cfg.Node.Network.Enabled
	if en != nil && !*en {
		log.G(ctx).Warn("network policy is off (node.network.enabled=false): sandboxes have no network")
		return nil, nil
	}
	ncfg := cfg.Node.Network.Config
	ncfg.NodeID = cfg.Node.ID // in the names of what the node makes on the host
	m, err := netpolicy.New(ctx, ncfg, cfg.DataDir)
	if err != nil {
		if en != nil || errdefs.IsInvalidArgument(err) {
			return nil, fmt.Errorf("start network policy: %w", err)
		}
		log.G(ctx).Warn("network policy unavailable; sandboxes have no network (set node.network.enabled to decide)", log.Err(err))
		return nil, nil
	}
	return m, nil
}

// nodeHandlerOpts authenticates the node's callers with the public key:
// components (node scope) and admins, each possibly acting on behalf of a
// user or admin whose signed token they forward (auth.OnBehalfHeader).
func nodeHandlerOpts(pub ed25519.PublicKey) (*auth.Verifier, []connect.HandlerOption) {
	v := auth.NewVerifier(pub, auth.ScopeNode, auth.ScopeAdmin).AcceptOnBehalf()
	return v, []connect.HandlerOption{connect.WithInterceptors(v.Interceptor())}
}

// RunNode serves a node until ctx ends. Sandboxes keep running after. The
// node holds only the public key: it verifies, it cannot mint.
func RunNode(ctx context.Context, cfg config.Config, pub ed25519.PublicKey, ready chan<- string) error {
	n, err := newNode(ctx, cfg)
	if err != nil {
		return err
	}
	v, opts := nodeHandlerOpts(pub)
	err = serve(ctx, "node", cfg.Node.Listen, nodeMux(n.Node, v, opts), ready)
	if serr := n.shutdown(ctx); serr != nil {
		err = errors.Join(err, fmt.Errorf("shut down node: %w", serr))
	}
	return err
}

func nodeMux(n *node.Node, v *auth.Verifier, opts []connect.HandlerOption) *muxWithProxy {
	rpc := http.NewServeMux()
	rpc.Handle("/", n.Handler(opts...))
	rpc.Handle(n.ImageHandler(opts...))
	rpc.Handle(n.SnapshotHandler(opts...))
	return &muxWithProxy{rpc: rpc, proxy: v.Middleware(n.AgentProxy())}
}

// RunWatcher serves the watcher until ctx ends. It verifies its callers
// with pub and polls nodes with tok (a node-scope token).
func RunWatcher(ctx context.Context, cfg config.Config, pub ed25519.PublicKey, tok auth.TokenSource, ready chan<- string) error {
	g, ctx := errgroup.WithContext(ctx)
	nodes, err := nodeDirectory(cfg)
	if err != nil {
		return err
	}
	w := watcher.NewWithTokens(cfg.Watcher, nodes, h2cClient(), tok)
	g.Go(func() error { return w.Run(ctx) })
	g.Go(func() error {
		v := auth.NewVerifier(pub, auth.ScopeNode, auth.ScopeAdmin)
		mux := http.NewServeMux()
		mux.Handle(w.Handler(connect.WithInterceptors(v.Interceptor())))
		mux.Handle("GET /metrics", w.MetricsHandler()) // no token, like the node's and apiserver's
		return serve(ctx, "watcher", cfg.Watcher.Listen, mux, ready)
	})
	return g.Wait()
}

// RunAPIServer serves the public API until ctx ends. It verifies callers
// with pub and calls the watcher and nodes with tok (a node-scope token),
// forwarding each caller's own token to the node (auth.OnBehalfHeader).
func RunAPIServer(ctx context.Context, cfg config.Config, pub ed25519.PublicKey, tok auth.TokenSource, ready chan<- string) error {
	return runAPIServer(ctx, cfg, pub, tok, h2cClient(), ready)
}

// runAPIServer is RunAPIServer reaching the watcher and nodes with hc.
func runAPIServer(ctx context.Context, cfg config.Config, pub ed25519.PublicKey, tok auth.TokenSource, hc *http.Client, ready chan<- string) error {
	nodes, err := nodeDirectory(cfg)
	if err != nil {
		return err
	}
	wc := watcherv1connect.NewWatcherServiceClient(hc, cfg.APIServer.WatcherAddress,
		connect.WithInterceptors(auth.ClientInterceptorFrom(tok)))
	srv, err := apiserver.New(apiserver.Config{
		Nodes:      nodes,
		Watcher:    wc,
		HTTPClient: hc,
		NodeTokens: tok,
		// Callers only: node-scope tokens are for component-to-node calls.
		Auth:            auth.NewVerifier(pub, auth.ScopeAdmin, auth.ScopeUser),
		MaxUploadBytes:  cfg.Node.MaxUploadMB << 20,
		PlacementSample: cfg.APIServer.PlacementSample,
	})
	if err != nil {
		return err
	}
	return serve(ctx, "apiserver", cfg.APIServer.Listen, srv.Handler(), ready)
}

// Up runs node, watcher and apiserver in one process until ctx ends. It is
// the issuer: it holds the private key and mints the components' service
// tokens (renewed at half their lifetime); the components get only the
// public key and their tokens.
func Up(ctx context.Context, cfg config.Config, o UpOptions) error {
	iss, err := loadIssuer(ctx, cfg)
	if err != nil {
		return err
	}
	if _, err := EnsureBootstrapToken(cfg, iss); err != nil {
		return err
	}
	pub := iss.PublicKey()
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
	shutDown := false
	defer func() {
		// Early returns: the node still releases its table and sockets.
		if !shutDown {
			if err := n.shutdown(ctx); err != nil {
				log.G(ctx).Error("shut down node", log.Err(err))
			}
		}
	}()

	g, gctx := errgroup.WithContext(ctx)
	nodeReady, watcherReady, apiReady := make(chan string, 1), make(chan string, 1), make(chan string, 1)
	watcherTok, err := startServiceToken(gctx, iss, "opendsec-watcher", auth.ScopeNode)
	if err != nil {
		return err
	}
	apiTok, err := startServiceToken(gctx, iss, "opendsec-apiserver", auth.ScopeNode)
	if err != nil {
		return err
	}
	v, opts := nodeHandlerOpts(pub)
	nodeHandler := nodeMux(n.Node, v, opts)
	apiHC, ip, err := inProcessClient(cfg, nodeHandler)
	if err != nil {
		return err
	}
	if testHookInProcess != nil {
		testHookInProcess(ip)
	}
	g.Go(func() error { return serve(gctx, "node", cfg.Node.Listen, nodeHandler, nodeReady) })
	g.Go(func() error { return RunWatcher(gctx, cfg, pub, watcherTok, watcherReady) })
	g.Go(func() error { return runAPIServer(gctx, cfg, pub, apiTok, apiHC, apiReady) })
	e2bReady := make(chan string, 1)
	g.Go(func() error { return RunE2B(gctx, cfg, iss, e2bReady) })
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
		if err := waitNodeSeen(gctx, cfg, iss); err != nil {
			return err
		}
		attrs := []any{"endpoint", api, "token_file", filepath.Join(cfg.DataDir, BootstrapTokenFile)}
		if n.accel != nil {
			attrs = append(attrs, "vm_accel", n.accel.Accel, "vm_accel_reason", n.accel.Reason)
		}
		attrs = append(attrs, "default_backend", n.defaultBackend.Backend, "default_backend_reason", n.defaultBackend.Reason)
		core := sched.Core()
		attrs = append(attrs, "core_scheduling", core.Enabled, "core_scheduling_reason", core.Reason)
		log.G(ctx).Info("opendsec is up", attrs...)
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
	shutDown = true
	if serr := n.shutdown(ctx); serr != nil {
		log.G(ctx).Error("shut down node; what it left is recovered at the next start", log.Err(serr))
	}
	if err != nil && ctx.Err() == nil {
		return err
	}
	log.G(ctx).Info("opendsec stopped", "sandboxes_left_running", !o.StopSandboxes)
	return nil
}

// testHookInProcess, if set, sees the transport Up's apiserver reaches
// its own node with (tests only).
var testHookInProcess func(*nodeclient.InProcess)

// inProcessClient is the apiserver's client in `opendsec up`: calls to
// this process's node (cfg.Node.ID at its nodes[] address) go straight to
// its handler h, the one its listener serves (same interceptors, same
// token checks); calls to any other node in nodes[], and port tunnels,
// over h2c as in a separate apiserver. Without this node in nodes[] (the
// apiserver does not route to it) it is plain h2c and the transport nil.
func inProcessClient(cfg config.Config, h http.Handler) (*http.Client, *nodeclient.InProcess, error) {
	hc := h2cClient()
	for _, n := range cfg.Nodes {
		if n.ID != cfg.Node.ID {
			continue
		}
		ip, err := nodeclient.NewInProcess(strings.TrimRight(n.Address, "/"), h, hc.Transport)
		if err != nil {
			return nil, nil, fmt.Errorf("nodes[%q]: %w", n.ID, err)
		}
		return &http.Client{Transport: ip}, ip, nil
	}
	return hc, nil, nil
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
func waitNodeSeen(ctx context.Context, cfg config.Config, iss *auth.Issuer) error {
	// One call site, done within a minute: a token without renewal.
	tok, err := iss.Issue("opendsec-up", auth.ScopeNode, 5*time.Minute)
	if err != nil {
		return fmt.Errorf("issue service token: %w", err)
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

// trajectoryConfig is node.trajectory for the node.
func trajectoryConfig(t config.Trajectory) node.TrajectoryConfig {
	c := node.TrajectoryConfig{Off: t.Off, MaxBytes: t.MaxLogMB << 20, MaxOutputBytes: t.MaxOutputKB << 10, Sync: t.Fsync}
	switch {
	case t.RetentionSec < 0:
		c.Retention = -1
	case t.RetentionSec > 0:
		c.Retention = time.Duration(t.RetentionSec) * time.Second
	}
	return c
}
