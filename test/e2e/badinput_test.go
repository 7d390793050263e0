//go:build linux

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/trajectory"

	opendsec "github.com/kernflux/opendsec/sdk/go"
	"google.golang.org/protobuf/proto"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protowire"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
)

// sandboxCount returns how many sandboxes the system has, and checks the
// node's sandbox dir holds exactly that many (once the background teardown
// of sandboxes stopped just before has removed their dirs: polled for up
// to 10 s).
func (s *system) sandboxCount(t *testing.T) int {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		l, err := s.Sandboxes().ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		ents, _ := os.ReadDir(filepath.Join(s.DataDir(), "node", "sandboxes"))
		if len(ents) == len(l.Msg.Sandboxes) {
			return len(l.Msg.Sandboxes)
		}
		if time.Now().After(deadline) {
			t.Fatalf("node holds %d sandbox dirs but lists %d sandboxes", len(ents), len(l.Msg.Sandboxes))
		}
		time.Sleep(20 * time.Millisecond) // polling the node's background teardown
	}
}

func wantErr(t *testing.T, what string, err error, code connect.Code, mention string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: no error, want %s mentioning %q", what, code, mention)
		return
	}
	if connect.CodeOf(err) != code || !strings.Contains(err.Error(), mention) {
		t.Errorf("%s: got %v, want %s mentioning %q", what, err, code, mention)
	}
}

// TestBadInput sends each kind of bad input through the public API and
// checks the error names the field and nothing is left half-made.
func TestBadInput(t *testing.T) {
	s := newSystem(t)
	s.Start()
	sb := s.create(t, nil)
	before := s.sandboxCount(t)

	create := func(spec *opendsecv1.SandboxSpec) error {
		_, err := s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{Spec: spec}))
		return err
	}
	wantErr(t, "unknown image", create(&opendsecv1.SandboxSpec{Image: "root/nope:1"}), connect.CodeInvalidArgument, "image")
	wantErr(t, "empty image", create(&opendsecv1.SandboxSpec{}), connect.CodeInvalidArgument, "image")
	wantErr(t, "memory above capacity", create(&opendsecv1.SandboxSpec{Image: "root/busybox", MemoryMb: proto.Int64(1 << 40)}), connect.CodeInvalidArgument, "memory_mb")
	wantErr(t, "zero memory", create(&opendsecv1.SandboxSpec{Image: "root/busybox", MemoryMb: proto.Int64(0)}), connect.CodeInvalidArgument, "memory_mb")
	wantErr(t, "negative memory", create(&opendsecv1.SandboxSpec{Image: "root/busybox", MemoryMb: proto.Int64(-1)}), connect.CodeInvalidArgument, "memory_mb")
	wantErr(t, "negative timeout", create(&opendsecv1.SandboxSpec{Image: "root/busybox", TimeoutSeconds: -1}), connect.CodeInvalidArgument, "timeout_seconds")
	wantErr(t, "unknown backend", create(&opendsecv1.SandboxSpec{Image: "root/busybox", Backend: "vmware"}), connect.CodeInvalidArgument, "backend")

	_, err := s.exec(t.Context(), sb.Id)
	wantErr(t, "empty command", err, connect.CodeInvalidArgument, "command")
	_, err = s.exec(t.Context(), "n001aaaaaaaaaaaaaaaa", "true")
	wantErr(t, "unknown sandbox", err, connect.CodeNotFound, "n001aaaaaaaaaaaaaaaa")
	_, err = s.exec(t.Context(), "not-an-id", "true")
	wantErr(t, "malformed sandbox id", err, connect.CodeInvalidArgument, "sandbox_id")

	_, err = s.Files().Stat(t.Context(), connect.NewRequest(&opendsecv1.StatRequest{SandboxId: sb.Id, Path: "/no/such/file"}))
	wantErr(t, "missing path", err, connect.CodeNotFound, "/no/such/file")
	rd := s.Files()
	st, err := rd.ReadFile(t.Context(), connect.NewRequest(&opendsecv1.ReadFileRequest{SandboxId: sb.Id, Path: "/no/such/file"}))
	if err == nil {
		for st.Receive() {
		}
		err = st.Err()
	}
	wantErr(t, "read missing path", err, connect.CodeNotFound, "/no/such/file")

	// A 2 GiB upload is refused from its header, before any data moves.
	up := s.Files().WriteFile(t.Context())
	up.Send(&opendsecv1.WriteFileRequest{Msg: &opendsecv1.WriteFileRequest_Header{Header: &opendsecv1.WriteFileHeader{SandboxId: sb.Id, Path: "/tmp/big", Size: 2 << 30}}})
	_, err = up.CloseAndReceive()
	wantErr(t, "2 GiB upload", err, connect.CodeResourceExhausted, "size: 2147483648 bytes exceeds the upload limit")
	if r := s.shell(t, sb.Id, "ls /tmp/big 2>/dev/null; echo done"); r.stdout != "done\n" {
		t.Errorf("refused upload left a file: %q", r.stdout)
	}

	// Invalid UTF-8 in a path: proto clients refuse to send it, so send the
	// wire bytes by hand.
	var body []byte
	body = protowire.AppendTag(body, 1, protowire.BytesType)
	body = protowire.AppendString(body, sb.Id)
	body = protowire.AppendTag(body, 2, protowire.BytesType)
	body = protowire.AppendBytes(body, []byte("/tmp/\xff\xfe"))
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, s.Endpoint()+"/"+opendsecv1connect.FileServiceName+"/Stat", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/proto")
	req.Header.Set("Authorization", "Bearer "+s.Token())
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var ce struct{ Code, Message string }
	json.Unmarshal(b, &ce)
	if resp.StatusCode != http.StatusBadRequest || ce.Code != "invalid_argument" || !strings.Contains(ce.Message, "path") {
		t.Errorf("invalid UTF-8 path: %d %s, want 400 invalid_argument naming path", resp.StatusCode, b)
	}

	// Tokens: none, garbage, expired.
	noTok := opendsecv1connect.NewSandboxServiceClient(s.HTTPClient(), s.Endpoint(), connect.WithGRPC())
	_, err = noTok.ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{}))
	wantErr(t, "no token", err, connect.CodeUnauthenticated, "token")
	bad := opendsecv1connect.NewSandboxServiceClient(s.HTTPClient(), s.Endpoint(), s.Opts("odt_garbage.xyz")...)
	_, err = bad.ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{}))
	wantErr(t, "unknown token", err, connect.CodeUnauthenticated, "token")
	key, err := auth.LoadIssuer(filepath.Join(s.DataDir(), "auth.ed25519"))
	if err != nil {
		t.Fatal(err)
	}
	expired, err := key.Issue("old", auth.ScopeUser, time.Nanosecond)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // token expiry has one-second resolution
	old := opendsecv1connect.NewSandboxServiceClient(s.HTTPClient(), s.Endpoint(), s.Opts(expired)...)
	_, err = old.CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{Spec: &opendsecv1.SandboxSpec{Image: "root/busybox"}}))
	wantErr(t, "expired token", err, connect.CodeUnauthenticated, "expired")

	if after := s.sandboxCount(t); after != before {
		t.Fatalf("bad input changed the sandbox count from %d to %d", before, after)
	}
}

// TestYesDoesNotGrowTheNode runs `yes` for 60 s with its output streamed to
// a client and checks the node's memory and disk stay flat.
func TestYesDoesNotGrowTheNode(t *testing.T) {
	if testing.Short() {
		t.Skip("takes 60 s")
	}
	s := newSystem(t)
	s.Start()
	sb := s.create(t, nil)
	rssBefore := rss(t, s.Pid())
	duBefore := diskUsage(t, s.DataDir())
	// Through the Go SDK, as a user would.
	c, err := opendsec.New(s.Endpoint(), opendsec.WithToken(s.Token()))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	var out countWriter
	p, err := c.Exec(ctx, sb.Id, opendsec.ExecOptions{Command: []string{"yes"}, Timeout: 60 * time.Second, Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	exit, err := p.Wait()
	if err != nil {
		t.Fatalf("yes stream: %v", err)
	}
	if !exit.TimedOut {
		t.Fatalf("yes ended with %+v, want killed by its 60 s timeout", exit)
	}
	n := out.n
	rssAfter := rss(t, s.Pid())
	duAfter := diskUsage(t, s.DataDir())
	t.Logf("yes streamed %d MiB; node RSS %d -> %d KiB; data dir %d -> %d KiB", n>>20, rssBefore, rssAfter, duBefore, duAfter)
	if n < 64<<20 {
		t.Errorf("only %d bytes of output reached the client", n)
	}
	if rssAfter-rssBefore > 64<<10 {
		t.Errorf("node RSS grew by %d KiB while yes ran", rssAfter-rssBefore)
	}
	// The trajectory log keeps up to its per-stream output cap of the call
	// (stdout and stderr), whatever the call writes after that.
	if limit := int64(2*trajectory.DefaultMaxOutputBytes>>10) + 1<<10; int64(duAfter-duBefore) > limit {
		t.Errorf("data dir grew by %d KiB while yes ran (limit %d KiB: the trajectory log's output caps and 1 MiB)", duAfter-duBefore, limit)
	}
	if r := s.shell(t, sb.Id, "echo still here"); r.stdout != "still here\n" {
		t.Fatalf("sandbox after yes: %q", r.stdout)
	}
}

func rss(t *testing.T, pid int) int64 {
	b, err := os.ReadFile(filepath.Join("/proc", itoa(pid), "status"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			var v int64
			for _, c := range f[1] {
				v = v*10 + int64(c-'0')
			}
			return v
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

func itoa(i int) string { return strconv.Itoa(i) }

// diskUsage is the KiB allocated under dir.
func diskUsage(t *testing.T, dir string) int64 {
	var total int64
	filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error {
		if err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				total += st.Blocks * 512
			}
		}
		return nil
	})
	return total >> 10
}

type countWriter struct{ n int64 }

func (w *countWriter) Write(p []byte) (int, error) { w.n += int64(len(p)); return len(p), nil }

// TestNodeTokenRefusedByPublicAPI checks the public API takes only caller
// tokens: a node-scope token (for component-to-node calls) is refused.
func TestNodeTokenRefusedByPublicAPI(t *testing.T) {
	s := newSystem(t)
	s.Start()
	key, err := auth.LoadIssuer(filepath.Join(s.DataDir(), "auth.ed25519"))
	if err != nil {
		t.Fatal(err)
	}
	nodeTok, err := key.Issue("x", auth.ScopeNode, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	c := opendsecv1connect.NewSandboxServiceClient(s.HTTPClient(), s.Endpoint(), s.Opts(nodeTok)...)
	_, err = c.ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{}))
	wantErr(t, "node-scope token", err, connect.CodePermissionDenied, "scope")
}
