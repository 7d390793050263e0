//go:build linux

// Package e2e runs OpenDsec's binaries for real, as root: `opendsec up` with
// the container backend, the real agent and runc, driven through the public
// API exactly as SDKs drive it.
package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/testutil"
)

var binDir string

func TestMain(m *testing.M) {
	code := func() int {
		if os.Geteuid() != 0 && os.Getenv("OPENDSEC_ROOT_TESTS") != "1" {
			fmt.Println("e2e: skipped, needs root")
			return 0
		}
		d, err := os.MkdirTemp("", "odbin")
		if err != nil {
			fmt.Println(err)
			return 1
		}
		defer os.RemoveAll(d)
		binDir = d
		root, _ := filepath.Abs("../..")
		for _, c := range []string{"opendsec", "opendsec-agent", "opendsec-init"} {
			cmd := exec.Command("go", "build", "-o", filepath.Join(d, c), "./cmd/"+c)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				fmt.Printf("build %s: %v\n%s", c, err, out)
				return 1
			}
		}
		return m.Run()
	}()
	os.Exit(code)
}

var (
	portsMu sync.Mutex
	ports   = map[int]bool{} // handed out in this process
)

// freePort returns a loopback port nothing listens on, below the kernel's
// ephemeral range (so no outgoing connection takes it between the pick and
// the system's listen), never the same one twice in this process. Asking
// the kernel for port 0 could hand out one port twice in a row, and a
// system then failed to start ("address already in use").
func freePort(t *testing.T) int {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 1000 {
		p := 20000 + rand.IntN(12000) // 20000-31999; ephemeral ports start at 32768
		if ports[p] {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue
		}
		l.Close()
		ports[p] = true
		return p
	}
	t.Fatal("no free loopback port in 20000-31999 after 1000 tries")
	return 0
}

// system is one `opendsec up` with its data dir.
type system struct {
	t        *testing.T
	dataDir  string
	cfgPath  string
	endpoint string
	token    string
	cmd      *exec.Cmd
	logPath  string
	waitCh   chan error
	// nodeNS is the network namespace that plays the node's host network
	// for the network policy (veths, nftables, DNS proxy), so tests never
	// touch the machine's own network.
	nodeNS string
}

// newSystem writes a config with fresh ports and imports the busybox image.
// Its warm pool is off: these tests count the host's sandboxes, network
// namespaces, mounts and image holds, and prestarted sandboxes would be
// among them. TestWarmPool turns it on (newSystemPool).
func newSystem(t *testing.T) *system { return newSystemPool(t, 0) }

// newSystemPool is newSystem with node.warm_pool.size = poolSize.
func newSystemPool(t *testing.T, poolSize int) *system {
	testutil.RequiresRoot(t)
	dd, err := os.MkdirTemp("", "odsys")
	if err != nil {
		t.Fatal(err)
	}
	s := &system{t: t, dataDir: dd, cfgPath: filepath.Join(dd, "opendsec.json"), logPath: filepath.Join(dd, "up.log")}
	s.nodeNS = filepath.Join(dd, "nodens")
	makeNetNS(t, s.nodeNS)
	api, nodeP, watcherP, e2bP := freePort(t), freePort(t), freePort(t), freePort(t)
	cfg := map[string]any{
		"version":  1,
		"data_dir": dd,
		"log":      map[string]any{"level": "debug"},
		"apiserver": map[string]any{
			"listen":           fmt.Sprintf("127.0.0.1:%d", api),
			"watcher_address":  fmt.Sprintf("http://127.0.0.1:%d", watcherP),
			"placement_sample": 2,
		},
		"watcher": map[string]any{"listen": fmt.Sprintf("127.0.0.1:%d", watcherP), "poll_interval_ms": 200},
		"node": map[string]any{
			"id":              "n001",
			"listen":          fmt.Sprintf("127.0.0.1:%d", nodeP),
			"agent_path":      filepath.Join(binDir, "opendsec-agent"),
			"image_dir":       filepath.Join(dd, "images"),
			"default_backend": "container",
			"max_sandboxes":   100,
			"max_upload_mb":   64,
			"warm_pool":       map[string]any{"size": poolSize, "max_sandboxes": 4, "idle_ttl_sec": 600},
			"network": map[string]any{
				"enabled":    true,
				"node_netns": s.nodeNS,
				"netns_dir":  filepath.Join(dd, "netns"),
			},
		},
		"nodes": []map[string]any{{"id": "n001", "address": fmt.Sprintf("http://127.0.0.1:%d", nodeP)}},
		"e2b":   map[string]any{"listen": fmt.Sprintf("127.0.0.1:%d", e2bP)},
	}
	b, _ := json.MarshalIndent(cfg, "", "  ")
	if err := os.WriteFile(s.cfgPath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	s.run("image", "import-rootfs", "--name", "root/busybox", "--rootfs", testutil.BusyboxRootfs(t))
	t.Cleanup(func() {
		if t.Failed() {
			if b, err := os.ReadFile(s.logPath); err == nil {
				t.Logf("opendsec up log:\n%s", lastLines(string(b), 80))
			}
		}
		// Whatever the test did, let the node itself remove every sandbox
		// before the data dir goes: restart with --stop-sandboxes and stop.
		if s.waitCh != nil {
			s.stop()
		}
		s.start("--stop-sandboxes")
		if err := s.stop(); err != nil {
			t.Errorf("final shutdown: %v", err)
		}
		ents, _ := os.ReadDir(filepath.Join(dd, "node", "sandboxes"))
		if len(ents) > 0 {
			t.Errorf("sandboxes left after --stop-sandboxes: %d", len(ents))
			return // keep the data dir: removing it under live mounts is worse
		}
		os.RemoveAll(dd)
	})
	return s
}

func lastLines(s string, n int) string {
	ls := strings.Split(s, "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}

// run runs an opendsec subcommand against the system's data dir.
func (s *system) run(args ...string) string {
	s.t.Helper()
	args = append(args, "--data-dir", s.dataDir, "--config", s.cfgPath)
	out, err := exec.CommandContext(s.t.Context(), filepath.Join(binDir, "opendsec"), args...).CombinedOutput()
	if err != nil {
		s.t.Fatalf("opendsec %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// start runs `opendsec up` and waits until it serves.
func (s *system) start(extra ...string) {
	s.t.Helper()
	ready := filepath.Join(s.dataDir, "ready")
	os.Remove(ready)
	logf, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.t.Fatal(err)
	}
	defer logf.Close()
	args := append([]string{"up", "--data-dir", s.dataDir, "--config", s.cfgPath, "--ready-file", ready}, extra...)
	s.cmd = exec.Command(filepath.Join(binDir, "opendsec"), args...)
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	if err := s.cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- s.cmd.Wait() }()
	deadline := time.After(60 * time.Second)
	for {
		if b, err := os.ReadFile(ready); err == nil && len(b) > 0 {
			s.endpoint = "http://" + strings.TrimSpace(string(b))
			break
		}
		select {
		case err := <-exited:
			b, _ := os.ReadFile(s.logPath)
			s.t.Fatalf("opendsec up exited: %v\n%s", err, lastLines(string(b), 40))
		case <-deadline:
			s.t.Fatal("opendsec up did not become ready in 60s")
		case <-time.After(20 * time.Millisecond):
		}
	}
	tok, err := os.ReadFile(filepath.Join(s.dataDir, "bootstrap.token"))
	if err != nil {
		s.t.Fatal(err)
	}
	s.token = strings.TrimSpace(string(tok))
	// Re-arm Wait for kill9/stop: the goroutine above owns it.
	s.waitCh = exited
	s.waitForNodes()
}

// waitForNodes waits until the watcher has seen the node (a create before
// that has no placement candidate).
func (s *system) waitForNodes() {
	s.t.Helper()
	c := s.sandboxes()
	deadline := time.Now().Add(30 * time.Second)
	for {
		// Not t.Context(): cleanup restarts the system after it is canceled.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := c.ListSandboxes(ctx, connect.NewRequest(&opendsecv1.ListSandboxesRequest{}))
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("system not ready: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // polling a condition with a deadline
	}
}

// kill9 kills the up process with SIGKILL and waits for it to die.
func (s *system) kill9() {
	s.t.Helper()
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.waitCh
	s.waitCh = nil
}

// stop sends SIGTERM and waits.
func (s *system) stop() error {
	s.cmd.Process.Signal(syscall.SIGTERM)
	err := <-s.waitCh
	s.waitCh = nil
	return err
}

func (s *system) httpClient() *http.Client {
	t := &http.Transport{Protocols: new(http.Protocols)}
	t.Protocols.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: t}
}

type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, r connect.AnyRequest) (connect.AnyResponse, error) {
		r.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, r)
	}
}
func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, sp connect.Spec) connect.StreamingClientConn {
		c := next(ctx, sp)
		c.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return c
	}
}
func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

func (s *system) opts(tok string) []connect.ClientOption {
	return []connect.ClientOption{connect.WithGRPC(), connect.WithInterceptors(bearer(tok))}
}

func (s *system) sandboxes() opendsecv1connect.SandboxServiceClient {
	return opendsecv1connect.NewSandboxServiceClient(s.httpClient(), s.endpoint, s.opts(s.token)...)
}

func (s *system) processes() opendsecv1connect.ProcessServiceClient {
	return opendsecv1connect.NewProcessServiceClient(s.httpClient(), s.endpoint, s.opts(s.token)...)
}

func (s *system) files() opendsecv1connect.FileServiceClient {
	return opendsecv1connect.NewFileServiceClient(s.httpClient(), s.endpoint, s.opts(s.token)...)
}
