package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/miekg/dns"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	watcherv1 "github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/testutil"
)

// makeNetNS bind-mounts a new network namespace (lo up) at path; it plays
// the node's host network, so the test never touches the machine's own
// (the network manager brings its lo up).
func makeNetNS(t *testing.T, path string) {
	t.Helper()
	ns := func() netns.NsHandle {
		goruntime.LockOSThread()
		defer goruntime.UnlockOSThread()
		orig, err := netns.Get()
		if err != nil {
			t.Fatal(err)
		}
		defer orig.Close()
		ns, err := netns.New()
		if err != nil {
			t.Fatal(err)
		}
		if err := netns.Set(orig); err != nil {
			panic("restore network namespace: " + err.Error())
		}
		return ns
	}()
	defer ns.Close()
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", int(ns)), path, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind-mount netns: %v", err)
	}
	t.Cleanup(func() {
		unix.Unmount(path, unix.MNT_DETACH)
		os.Remove(path)
	})
}

// inNS runs fn on a thread in the network namespace at path.
func inNS(t *testing.T, path string, fn func() error) {
	t.Helper()
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	ns, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if err := netns.Set(ns); err != nil {
		t.Fatal(err)
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		panic("restore network namespace: " + err.Error()) // the thread is unusable
	}
	if ferr != nil {
		t.Fatal(ferr)
	}
}

// freeAddr returns a loopback address nothing listens on (see
// testutil.FreePort).
func freeAddr(t *testing.T) string {
	t.Helper()
	return fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t))
}

// dnsAnswers reports whether the DNS proxy at addr answers over proto.
func dnsAnswers(proto, addr string) error {
	c := &dns.Client{Net: proto, Timeout: time.Second}
	m := new(dns.Msg)
	m.SetQuestion("example.com.", dns.TypeA)
	_, _, err := c.Exchange(m, addr)
	return err
}

// upSystem is `opendsec up` running in this process.
type upSystem struct {
	cfg                   config.Config
	api, watch, node, e2b string // listen addresses
	nodeNS                string
	cancel                context.CancelFunc
	done                  chan error
}

// startUp runs Up in the test's process with fresh ports; withNetwork puts
// the network policy (and its DNS proxy) in a namespace of its own.
func startUp(t *testing.T, withNetwork bool) *upSystem {
	t.Helper()
	return startUpWith(t, withNetwork, nil)
}

// startUpWith is startUp with mod applied to the config before the start.
func startUpWith(t *testing.T, withNetwork bool, mod func(*config.Config)) *upSystem {
	t.Helper()
	dd := t.TempDir()
	agent := filepath.Join(dd, "agent")
	for _, p := range []string{agent, filepath.Join(dd, "opendsec-init")} {
		if err := os.WriteFile(p, []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	s := &upSystem{cfg: config.Default(dd), api: freeAddr(t), watch: freeAddr(t), node: freeAddr(t), e2b: freeAddr(t), done: make(chan error, 1)}
	cfg := &s.cfg
	cfg.APIServer.Listen, cfg.APIServer.WatcherAddress = s.api, "http://"+s.watch
	cfg.Watcher.Listen, cfg.Watcher.PollIntervalMS = s.watch, 100
	cfg.Node.Listen, cfg.Node.AgentPath = s.node, agent
	cfg.Nodes = []config.NodeRef{{ID: cfg.Node.ID, Address: "http://" + s.node}}
	cfg.E2B.Listen = s.e2b
	on := withNetwork
	cfg.Node.Network.Enabled = &on
	if withNetwork {
		s.nodeNS = filepath.Join(dd, "nodens")
		makeNetNS(t, s.nodeNS)
		cfg.Node.Network.NodeNetNS = s.nodeNS
		cfg.Node.Network.NetNSDir = filepath.Join(dd, "netns")
		cfg.Node.Network.Pool = "100.100.0.0/24"
	}
	if mod != nil {
		mod(cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	s.cancel = cancel
	t.Cleanup(func() {
		cancel()
		<-s.done
	})
	ready := filepath.Join(dd, "ready")
	go func() { s.done <- Up(ctx, *cfg, UpOptions{ReadyFile: ready}) }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		if b, err := os.ReadFile(ready); err == nil && len(b) > 0 {
			return s
		}
		select {
		case err := <-s.done:
			s.done <- err
			t.Fatalf("up returned before it was ready: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("up was not ready within 60s")
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
}

// stop ends Up's context and waits for it to return.
func (s *upSystem) stop(t *testing.T) {
	t.Helper()
	s.cancel()
	select {
	case err := <-s.done:
		s.done <- nil // for the cleanup
		if err != nil {
			t.Fatalf("up: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("up did not return within 60s of its context ending")
	}
}

// `opendsec up` shut down by its context leaves nothing behind in the
// process: every listener (the four servers and the DNS proxy, UDP and TCP)
// is closed and the goroutines it started are gone.
func TestUpShutdownClosesEverything(t *testing.T) {
	testutil.RequiresRoot(t)
	const dnsAddr = "100.100.0.1:53" // index 0 of the pool, second address
	base := goruntime.NumGoroutine()
	s := startUp(t, true)
	tcpAddrs := []string{s.api, s.watch, s.node, s.e2b}
	for _, a := range tcpAddrs {
		c, err := net.Dial("tcp", a)
		if err != nil {
			t.Fatalf("listener %s while up: %v", a, err)
		}
		c.Close()
	}
	inNS(t, s.nodeNS, func() error {
		for _, proto := range []string{"udp", "tcp"} {
			if err := dnsAnswers(proto, dnsAddr); err != nil {
				return fmt.Errorf("dns proxy over %s while up: %w", proto, err)
			}
		}
		return nil
	})

	s.stop(t)

	for _, a := range tcpAddrs {
		c, err := net.Dial("tcp", a)
		if err == nil {
			c.Close()
			t.Errorf("listener %s still accepts after shutdown", a)
		} else if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("listener %s after shutdown: %v; want connection refused", a, err)
		}
	}
	inNS(t, s.nodeNS, func() error {
		for _, proto := range []string{"udp", "tcp"} {
			if err := dnsAnswers(proto, dnsAddr); err == nil {
				t.Errorf("dns proxy still answers over %s after shutdown", proto)
			}
		}
		return nil
	})

	// Goroutines Up started end with it (idle HTTP/2 client connections
	// close as the servers go; poll for that).
	deadline := time.Now().Add(10 * time.Second)
	for goruntime.NumGoroutine() > base {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:goruntime.Stack(buf, true)]
			t.Fatalf("%d goroutines after shutdown, %d before up:\n%s", goruntime.NumGoroutine(), base, leftStacks(string(buf)))
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
}

// With 2-second service tokens, every component-to-component path still
// works after the first tokens expired: apiserver to watcher and node,
// watcher to node, e2b gateway to apiserver.
func TestUpServiceTokensRenewed(t *testing.T) {
	testutil.RequiresRoot(t)
	defer func(d time.Duration) { serviceTokenTTL = d }(serviceTokenTTL)
	serviceTokenTTL = 2 * time.Second
	s := startUp(t, false)
	key, err := loadIssuer(t.Context(), s.cfg)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := EnsureBootstrapToken(s.cfg, key)
	if err != nil {
		t.Fatal(err)
	}
	e2bKey, err := e2bKeys(s.cfg).Create("default")
	if err != nil {
		t.Fatal(err)
	}

	// Every component minted its first token before this probe: once the
	// probe has expired, so have they.
	probe, err := key.Issue("probe", auth.ScopeNode, serviceTokenTTL)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := auth.Verify(key.PublicKey(), probe, time.Now()); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("probe token did not expire")
		}
		time.Sleep(50 * time.Millisecond) // polling a condition with a deadline
	}
	sinceExpiry := time.Now()

	hc := h2cClient()
	// The watcher still polls the node: a successful poll after expiry.
	wc := watcherv1connect.NewWatcherServiceClient(hc, "http://"+s.watch, connect.WithInterceptors(auth.ClientInterceptor(admin)))
	deadline = time.Now().Add(10 * time.Second)
	for {
		resp, err := wc.ListNodes(t.Context(), connect.NewRequest(&watcherv1.ListNodesRequest{}))
		if err != nil {
			t.Fatalf("watcher: %v", err)
		}
		st := resp.Msg.GetNodes()[0]
		if st.GetHealthy() && st.GetLastSeen().AsTime().After(sinceExpiry) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("watcher's node status after the first service tokens expired: %v", st)
		}
		time.Sleep(50 * time.Millisecond) // polling a condition with a deadline
	}
	// The apiserver reaches the watcher and the node.
	api := opendsecv1connect.NewSandboxServiceClient(hc, "http://"+s.api, connect.WithInterceptors(auth.ClientInterceptor(admin)))
	if _, err := api.ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{})); err != nil {
		t.Fatalf("apiserver list after the first service tokens expired: %v", err)
	}
	_, err = api.CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{Spec: &opendsecv1.SandboxSpec{Image: "no/such-image"}}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "image") {
		t.Fatalf("create reaching the node after the first service tokens expired: %v; want the node's invalid image error", err)
	}
	// The e2b gateway reaches the apiserver.
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+s.e2b+"/sandboxes", nil)
	req.Header.Set("X-API-Key", e2bKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("e2b list after the first service tokens expired: %d %s", resp.StatusCode, body)
	}
	s.stop(t)
}

// leftStacks drops the test framework's own goroutines from a dump.
func leftStacks(dump string) string {
	var keep []string
	for _, g := range strings.Split(dump, "\n\n") {
		if strings.Contains(g, "testing.(*T).Run") || strings.Contains(g, "testing.tRunner") || strings.Contains(g, "testing.(*M)") {
			continue
		}
		keep = append(keep, g)
	}
	return strings.Join(keep, "\n\n")
}
