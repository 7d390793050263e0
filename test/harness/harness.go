//go:build linux

// Package harness runs OpenDsec's binaries for real, as root: `opendsec up`
// with the container backend, the real agent and runc, in a data dir and a
// node network namespace of its own, driven through the public API exactly
// as SDKs drive it. The end-to-end suites (test/e2e, test/security) use it:
//
//	func TestMain(m *testing.M) { harness.Main(m) }
//
//	func TestX(t *testing.T) {
//		s := harness.New(t)
//		s.Start()
//		sb := s.Create(t, nil)
//		r := s.Shell(t, sb.GetId(), "echo hi")
//	}
//
// It is test code: only _test.go files may import it.
package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/testutil"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

const module = "github.com/kernflux/opendsec"

var (
	binDir   string
	repoRoot string
	buildMu  sync.Mutex
	built    = map[string]error{}
)

// Main is a package's TestMain: unless the process is root (or
// OPENDSEC_ROOT_TESTS=1, which makes the tests fail loudly instead), it
// skips everything; else it builds opendsec, opendsec-agent and
// opendsec-init once into a temporary directory, runs the tests and exits.
func Main(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Geteuid() != 0 && os.Getenv("OPENDSEC_ROOT_TESTS") != "1" {
		fmt.Println("harness: skipped, needs root")
		return 0
	}
	root, err := findRepoRoot()
	if err != nil {
		fmt.Println(err)
		return 1
	}
	repoRoot = root
	d, err := os.MkdirTemp("", "odbin")
	if err != nil {
		fmt.Println(err)
		return 1
	}
	defer os.RemoveAll(d)
	binDir = d
	for _, c := range []string{"opendsec", "opendsec-agent", "opendsec-init"} {
		if _, err := build(c); err != nil {
			fmt.Println(err)
			return 1
		}
	}
	return m.Run()
}

// findRepoRoot walks up from the working directory (a test's package
// directory) to the go.mod of this module.
func findRepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("working directory: %w", err)
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil {
			first, _, _ := strings.Cut(string(b), "\n")
			if strings.TrimSpace(first) == "module "+module {
				return dir, nil
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("repository root: no go.mod of %s above the working directory", module)
		}
		dir = parent
	}
}

// build builds ./cmd/name (static) into BinDir once per process.
func build(name string) (string, error) { return buildPkg("./cmd/"+name, name) }

// buildPkg builds the package pkg (relative to the repository root,
// static) into BinDir as name, once per process.
func buildPkg(pkg, name string) (string, error) {
	buildMu.Lock()
	defer buildMu.Unlock()
	out := filepath.Join(binDir, name)
	if err, ok := built[name]; ok {
		return out, err
	}
	var err error
	if pkg == "./cmd/opendsec-init" {
		err = testutil.BuildInit(repoRoot, out) // C
	} else {
		cmd := exec.Command("go", "build", "-ldflags", "-s -w", "-o", out, pkg)
		cmd.Dir = repoRoot
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, e := cmd.CombinedOutput(); e != nil {
			err = fmt.Errorf("build %s: %w\n%s", name, e, b)
		}
	}
	built[name] = err
	return out, err
}

// Binary builds ./cmd/name once per process (Main built opendsec,
// opendsec-agent and opendsec-init already) and returns its path.
func Binary(t testing.TB, name string) string {
	t.Helper()
	p, err := build(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// BuildPackage builds the main package pkg ("./test/security/probe",
// relative to the repository root) as a static binary named name, once per
// process, and returns its path.
func BuildPackage(t testing.TB, pkg, name string) string {
	t.Helper()
	p, err := buildPkg(pkg, name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// BinDir is the directory Main built the binaries into.
func BinDir() string { return binDir }

// RepoRoot is the repository's root directory.
func RepoRoot() string { return repoRoot }

// FreePort returns a loopback port nothing listens on, never the same one
// twice in this process (testutil.FreePort).
func FreePort(t testing.TB) int {
	t.Helper()
	return testutil.FreePort(t)
}

// System is one `opendsec up` with its data dir.
type System struct {
	t        *testing.T
	dataDir  string
	cfgPath  string
	endpoint string
	e2b      string
	token    string
	cmd      *exec.Cmd
	logPath  string
	waitCh   chan error
	// nodeNS is the network namespace that plays the node's host network
	// for the network policy (veths, nftables, DNS proxy), so tests never
	// touch the machine's own network.
	nodeNS string
}

// Options change what New sets up and writes.
type Options struct {
	// PoolSize is node.warm_pool.size (0: no warm pool).
	PoolSize int
	// NodeID is node.id; empty means n001.
	NodeID string
	// NodeNS is the node network namespace to use, e.g. another system's
	// (NodeNS()), so two nodes share one host network; empty makes one.
	NodeNS string
	// Pool is node.network.pool; empty means the default. Nodes sharing a
	// namespace need pools of their own.
	Pool string
	// Config, if set, edits the config (the JSON object written to
	// opendsec.json) before it is written; see Set.
	Config func(cfg map[string]any)
}

// Set sets the value at a dotted path of a config object ("node.cpu",
// "node.network.dns_upstream"), making the objects on the way.
func Set(cfg map[string]any, path string, v any) {
	keys := strings.Split(path, ".")
	m := cfg
	for _, k := range keys[:len(keys)-1] {
		next, ok := m[k].(map[string]any)
		if !ok {
			next = map[string]any{}
			m[k] = next
		}
		m = next
	}
	m[keys[len(keys)-1]] = v
}

// New writes a config with fresh ports and imports the busybox image (as
// root/busybox); Start runs it. Its warm pool is off: tests count the host's
// sandboxes, network namespaces, mounts and image holds, and prestarted
// sandboxes would be among them (NewPool turns it on). When the test ends,
// the system is restarted with --stop-sandboxes and stopped, and the test
// fails if a sandbox is left.
func New(t *testing.T) *System { return NewPool(t, 0) }

// NewPool is New with node.warm_pool.size = poolSize.
func NewPool(t *testing.T, poolSize int) *System { return NewWith(t, Options{PoolSize: poolSize}) }

// NewWith is New with o.
func NewWith(t *testing.T, o Options) *System {
	testutil.RequiresRoot(t)
	poolSize, nodeID := o.PoolSize, o.NodeID
	if nodeID == "" {
		nodeID = "n001"
	}
	if binDir == "" {
		t.Fatal("harness: binaries not built: call harness.Main(m) from TestMain")
	}
	dd, err := os.MkdirTemp("", "odsys")
	if err != nil {
		t.Fatal(err)
	}
	s := &System{t: t, dataDir: dd, cfgPath: filepath.Join(dd, "opendsec.json"), logPath: filepath.Join(dd, "up.log")}
	s.nodeNS = o.NodeNS
	if s.nodeNS == "" {
		s.nodeNS = filepath.Join(dd, "nodens")
		MakeNetNS(t, s.nodeNS)
	}
	api, nodeP, watcherP, e2bP := FreePort(t), FreePort(t), FreePort(t), FreePort(t)
	s.e2b = fmt.Sprintf("127.0.0.1:%d", e2bP)
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
			"id":              nodeID,
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
		"nodes": []map[string]any{{"id": nodeID, "address": fmt.Sprintf("http://127.0.0.1:%d", nodeP)}},
		"e2b":   map[string]any{"listen": s.e2b},
	}
	if o.Pool != "" {
		cfg["node"].(map[string]any)["network"].(map[string]any)["pool"] = o.Pool
	}
	if o.Config != nil {
		o.Config(cfg)
	}
	b, _ := json.MarshalIndent(cfg, "", "  ")
	if err := os.WriteFile(s.cfgPath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	s.Run("image", "import-rootfs", "--name", "root/busybox", "--rootfs", testutil.BusyboxRootfs(t))
	t.Cleanup(func() {
		if t.Failed() {
			if b, err := os.ReadFile(s.logPath); err == nil {
				t.Logf("opendsec up log:\n%s", LastLines(string(b), 80))
			}
		}
		// Whatever the test did, let the node itself remove every sandbox
		// before the data dir goes: restart with --stop-sandboxes and stop.
		if s.waitCh != nil {
			s.Stop()
		}
		s.Start("--stop-sandboxes")
		if err := s.Stop(); err != nil {
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

// LastLines returns the last n lines of s.
func LastLines(s string, n int) string {
	ls := strings.Split(s, "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}

// Run runs an opendsec subcommand against the system's data dir and
// config, failing the test on error; it returns the combined output.
func (s *System) Run(args ...string) string {
	s.t.Helper()
	return s.RunT(s.t, args...)
}

// RunT is Run failing t (a subtest's) instead of the system's test.
func (s *System) RunT(t testing.TB, args ...string) string {
	t.Helper()
	args = append(args, "--data-dir", s.dataDir, "--config", s.cfgPath)
	out, err := exec.CommandContext(t.Context(), filepath.Join(binDir, "opendsec"), args...).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("opendsec %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
	}
	return string(out)
}

// Start runs `opendsec up` (with extra flags) and waits until it serves and
// the watcher has seen the node.
func (s *System) Start(extra ...string) {
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
			s.t.Fatalf("opendsec up exited: %v\n%s", err, LastLines(string(b), 40))
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
	// Re-arm Wait for Kill9/Stop: the goroutine above owns it.
	s.waitCh = exited
	s.WaitForNodes()
}

// WaitForNodes waits until the watcher has seen the node (a create before
// that has no placement candidate).
func (s *System) WaitForNodes() {
	s.t.Helper()
	c := s.Sandboxes()
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

// Kill9 kills the up process with SIGKILL and waits for it to die.
func (s *System) Kill9() {
	s.t.Helper()
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.waitCh
	s.waitCh = nil
}

// Stop sends SIGTERM to the up process and waits for it to exit.
func (s *System) Stop() error {
	s.cmd.Process.Signal(syscall.SIGTERM)
	err := <-s.waitCh
	s.waitCh = nil
	return err
}

// Pid is the up process's pid (0 before Start).
func (s *System) Pid() int {
	if s.cmd == nil || s.cmd.Process == nil {
		return 0
	}
	return s.cmd.Process.Pid
}

// DataDir is the system's data dir.
func (s *System) DataDir() string { return s.dataDir }

// ConfigPath is the system's config file.
func (s *System) ConfigPath() string { return s.cfgPath }

// LogPath is the file `opendsec up` logs to.
func (s *System) LogPath() string { return s.logPath }

// NodeNS is the path of the network namespace that plays the node's host
// network.
func (s *System) NodeNS() string { return s.nodeNS }

// Endpoint is the API server's URL ("http://127.0.0.1:port"), set by Start.
func (s *System) Endpoint() string { return s.endpoint }

// E2BAddr is the E2B gateway's listen address ("127.0.0.1:port").
func (s *System) E2BAddr() string { return s.e2b }

// Token is the bootstrap (admin) token, set by Start.
func (s *System) Token() string { return s.token }

// HTTPClient is an h2c client (the API speaks gRPC over cleartext HTTP/2).
func (s *System) HTTPClient() *http.Client {
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

// Opts are client options for gRPC with tok as the bearer token.
func (s *System) Opts(tok string) []connect.ClientOption {
	return []connect.ClientOption{connect.WithGRPC(), connect.WithInterceptors(bearer(tok))}
}

// Sandboxes is a SandboxService client with the bootstrap token.
func (s *System) Sandboxes() opendsecv1connect.SandboxServiceClient {
	return opendsecv1connect.NewSandboxServiceClient(s.HTTPClient(), s.endpoint, s.Opts(s.token)...)
}

// Processes is a ProcessService client with the bootstrap token.
func (s *System) Processes() opendsecv1connect.ProcessServiceClient {
	return opendsecv1connect.NewProcessServiceClient(s.HTTPClient(), s.endpoint, s.Opts(s.token)...)
}

// Files is a FileService client with the bootstrap token.
func (s *System) Files() opendsecv1connect.FileServiceClient {
	return opendsecv1connect.NewFileServiceClient(s.HTTPClient(), s.endpoint, s.Opts(s.token)...)
}

// Create makes a sandbox (image root/busybox unless spec names one) and
// fails the test on error.
func (s *System) Create(t testing.TB, spec *opendsecv1.SandboxSpec) *opendsecv1.Sandbox {
	t.Helper()
	if spec == nil {
		spec = &opendsecv1.SandboxSpec{}
	}
	if spec.Image == "" {
		spec.Image = "root/busybox"
	}
	r, err := s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{Spec: spec}))
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	return r.Msg.Sandbox
}

// ExecResult is what Exec collected.
type ExecResult struct {
	Stdout, Stderr string
	Exit           *opendsecv1.ExecExit
}

// Exec runs start (its SandboxId and Command set by the caller) in a
// sandbox and collects its output; it fails if the stream ends without an
// exit event.
func (s *System) Exec(ctx context.Context, start *opendsecv1.ExecStart) (ExecResult, error) {
	st := s.Processes().Exec(ctx)
	if err := st.Send(&opendsecv1.ExecRequest{Msg: &opendsecv1.ExecRequest_Start{Start: start}}); err != nil {
		return ExecResult{}, err
	}
	st.CloseRequest()
	var r ExecResult
	var out, errb strings.Builder
	for {
		m, err := st.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			r.Stdout, r.Stderr = out.String(), errb.String()
			return r, err
		}
		switch e := m.Event.(type) {
		case *opendsecv1.ExecResponse_Stdout:
			out.Write(e.Stdout)
		case *opendsecv1.ExecResponse_Stderr:
			errb.Write(e.Stderr)
		case *opendsecv1.ExecResponse_Exit:
			r.Exit = e.Exit
		}
	}
	r.Stdout, r.Stderr = out.String(), errb.String()
	if r.Exit == nil {
		return r, errors.New("exec stream ended without an exit event")
	}
	return r, nil
}

// Shell runs `/bin/sh -c line` in sandbox id and fails the test if the
// exec fails (a non-zero exit is not a failure: see r.Exit).
func (s *System) Shell(t testing.TB, id, line string) ExecResult {
	t.Helper()
	r, err := s.Exec(t.Context(), &opendsecv1.ExecStart{SandboxId: id, Command: []string{"/bin/sh", "-c", line}})
	if err != nil {
		t.Fatalf("exec %q in %s: %v", line, id, err)
	}
	return r
}

// Client is a Go SDK client with the bootstrap token.
func (s *System) Client(t testing.TB) *opendsec.Client {
	t.Helper()
	c, err := opendsec.New(s.endpoint, opendsec.WithToken(s.token))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// E2BKey creates an E2B API key of principal (opendsec e2b key create); the
// running gateway picks it up.
func (s *System) E2BKey(t testing.TB, principal string) string {
	t.Helper()
	return strings.TrimSpace(s.RunT(t, "e2b", "key", "create", "--principal", principal))
}

// InitPid is the host pid of sandbox id's init (its PID 1): the process in
// the sandbox's cgroup whose innermost pid is 1.
func InitPid(t testing.TB, id string) int {
	t.Helper()
	procs, _ := filepath.Glob("/proc/[0-9]*/status")
	for _, p := range procs {
		dir := filepath.Dir(p)
		cg, err := os.ReadFile(filepath.Join(dir, "cgroup"))
		if err != nil || !strings.Contains(string(cg), id) {
			continue
		}
		st, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(st), "\n") {
			f := strings.Fields(l)
			if len(f) >= 3 && f[0] == "NSpid:" && f[len(f)-1] == "1" {
				pid, err := strconv.Atoi(f[1])
				if err == nil {
					return pid
				}
			}
		}
	}
	t.Fatalf("no init process of sandbox %s on the host", id)
	return 0
}
