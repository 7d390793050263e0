package nodeclient_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"testing"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

const sbx = "n001aaaaaaaaaaaaaaaa"

// h2cOnly is a client that speaks nothing but cleartext HTTP/2, like the
// components' (the harder case: tunnels must still use HTTP/1.1).
func h2cOnly(t *testing.T) *http.Client {
	t.Helper()
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	c := &http.Client{Transport: &http.Transport{Protocols: p}}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

func newClient(t *testing.T, n *fakeNode) *nodeclient.Client {
	t.Helper()
	c, err := nodeclient.New(nodeclient.NodeInfo{ID: n.id, Addr: n.url + "/"}, nodeclient.Options{HTTPClient: h2cOnly(t), Tokens: n.token(t)})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestRPCOverH2CWithToken(t *testing.T) {
	n := newFakeNode(t, "n001")
	c := newClient(t, n)
	resp, err := c.Node().Info(t.Context(), connect.NewRequest(&nodev1.InfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.GetNodeId() != "n001" {
		t.Fatalf("node id %q", resp.Msg.GetNodeId())
	}
	if p := n.protosOf("rpc"); len(p) != 1 || p[0] != "HTTP/2.0" {
		t.Fatalf("RPC protocols %v, want one HTTP/2.0 call", p)
	}
	if c.ID() != "n001" || c.Info().Addr != n.url {
		t.Fatalf("info %+v: the trailing slash must be trimmed", c.Info())
	}

	// Without a token the node refuses, and the category survives.
	bare, err := nodeclient.New(nodeclient.NodeInfo{ID: "n001", Addr: n.url}, nodeclient.Options{HTTPClient: h2cOnly(t)})
	if err != nil {
		t.Fatal(err)
	}
	_, err = bare.Node().Info(t.Context(), connect.NewRequest(&nodev1.InfoRequest{}))
	if err = nodeclient.MapError(t.Context(), "node info", err); !errors.Is(err, errdefs.ErrUnauthenticated) {
		t.Fatalf("without a token: %v, want unauthenticated", err)
	}
}

func TestAgentURL(t *testing.T) {
	c, err := nodeclient.New(nodeclient.NodeInfo{ID: "n001", Addr: "http://10.0.0.1:7071/base/"}, nodeclient.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ id, path, want string }{
		{sbx, "", "http://10.0.0.1:7071/base/agent/" + sbx},
		{sbx, "/files", "http://10.0.0.1:7071/base/agent/" + sbx + "/files"},
		{sbx, nodeclient.PortPath(8080), "http://10.0.0.1:7071/base/agent/" + sbx + "/_opendsec/port/8080"},
		{"a/../b", "/x", "http://10.0.0.1:7071/base/agent/a%2F..%2Fb/x"},
	} {
		if got := c.AgentURL(tc.id, tc.path).String(); got != tc.want {
			t.Errorf("AgentURL(%q, %q) = %s, want %s", tc.id, tc.path, got, tc.want)
		}
	}
	// The URL is the caller's: changing it changes no later one.
	u := c.AgentURL(sbx, "/files")
	u.RawQuery = "path=/etc"
	u.Host = "evil"
	if got := c.AgentURL(sbx, "/files").String(); got != "http://10.0.0.1:7071/base/agent/"+sbx+"/files" {
		t.Fatalf("after changing a returned URL: %s", got)
	}
}

// TestDialPortRelaysBothWays opens a real tunnel (HTTP/1.1 Upgrade through
// the node to a loopback port) over a client that speaks only h2c
// otherwise, ends the dial's context, sends a MiB, half-closes, and reads
// the port's answer after its own EOF.
func TestDialPortRelaysBothWays(t *testing.T) {
	n := newFakeNode(t, "n001")
	n.echoPort(t)
	n.set(func(n *fakeNode) { n.states[sbx] = nodev1.SandboxState_SANDBOX_STATE_RUNNING })
	c := newClient(t, n)

	// The context bounds opening the tunnel only: the stream outlives it.
	dctx, cancel := context.WithCancel(t.Context())
	conn, err := c.DialPort(dctx, sbx, 8000)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if p := n.protosOf("tunnel"); len(p) != 1 || p[0] != "HTTP/1.1" {
		t.Fatalf("tunnel protocols %v, want one HTTP/1.1 request", p)
	}
	if got := conn.RemoteAddr().String(); got != "n001/"+sbx+":8000" {
		t.Errorf("RemoteAddr %q", got)
	}
	payload := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
	werr := make(chan error, 1)
	go func() {
		_, err := conn.Write(payload)
		if err == nil {
			err = conn.(interface{ CloseWrite() error }).CloseWrite()
		}
		werr <- err
	}()
	got, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-werr; err != nil {
		t.Fatalf("write and half-close: %v", err)
	}
	want := append([]byte("got 1048576 bytes: "), payload...)
	if !bytes.Equal(got, want) {
		t.Fatalf("read %d bytes (%.40q...), want %d", len(got), got, len(want))
	}
}

func TestDialPortRefusals(t *testing.T) {
	n := newFakeNode(t, "n001")
	n.echoPort(t)
	paused := "n001pppppppppppppppp"
	n.set(func(n *fakeNode) {
		n.states[sbx] = nodev1.SandboxState_SANDBOX_STATE_RUNNING
		n.states[paused] = nodev1.SandboxState_SANDBOX_STATE_PAUSED
		n.down[49999] = "python3 is not in the image; use an image with python3"
	})
	c := newClient(t, n)
	for _, tc := range []struct {
		name   string
		id     string
		port   int
		cat    error
		status int
		msg    string
	}{
		{"closed port", sbx, 9, errdefs.ErrUnavailable, http.StatusBadGateway, "port 9 is not open in the sandbox"},
		{"service down", sbx, 49999, errdefs.ErrUnavailable, http.StatusServiceUnavailable, "python3 is not in the image"},
		{"paused", paused, 8000, errdefs.ErrFailedPrecondition, http.StatusBadRequest, "is paused; resume it first"},
		{"unknown sandbox", "n001zzzzzzzzzzzzzzzz", 8000, errdefs.ErrNotFound, http.StatusNotFound, "sandbox n001zzzzzzzzzzzzzzzz not found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := c.DialPort(t.Context(), tc.id, tc.port)
			if err == nil {
				conn.Close()
				t.Fatal("tunnel opened")
			}
			var re *nodeclient.ResponseError
			if !errors.As(err, &re) || re.StatusCode != tc.status || !errors.Is(err, tc.cat) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("err = %v (%T), want a ResponseError %d of category %v saying %q", err, err, tc.status, tc.cat, tc.msg)
			}
		})
	}
	if _, err := c.DialPort(t.Context(), sbx, 0); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("port 0: %v, want invalid_argument", err)
	}
}

func TestDialPortUnreachableNode(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there now
	c, err := nodeclient.New(nodeclient.NodeInfo{ID: "n001", Addr: addr}, nodeclient.Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.DialPort(t.Context(), sbx, 8000)
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "node n001") {
		t.Fatalf("err = %v, want unavailable naming node n001", err)
	}
	ctx, cancel := context.WithCancelCause(t.Context())
	cause := errdefs.New(errdefs.ErrDeadlineExceeded, "the caller gave up")
	cancel(cause)
	if _, err := c.DialPort(ctx, sbx, 8000); !errors.Is(err, cause) {
		t.Fatalf("ended context: %v, want its cause", err)
	}
}

// TestAgentError: a Connect client of the agent sees the node's 404 and
// 400 without their JSON; AgentError still tells an unknown sandbox and a
// paused one apart (the latter by asking the node).
func TestAgentError(t *testing.T) {
	n := newFakeNode(t, "n001")
	paused := "n001pppppppppppppppp"
	n.set(func(n *fakeNode) { n.states[paused] = nodev1.SandboxState_SANDBOX_STATE_PAUSED })
	c := newClient(t, n)
	call := func(id string) error {
		proc := processconnect.NewProcessClient(c.HTTPClient(), c.AgentURL(id, "").String())
		stream, err := proc.Start(t.Context(), connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "true"}}))
		if err != nil {
			return err
		}
		defer stream.Close()
		for stream.Receive() {
		}
		return stream.Err()
	}
	unknown := "n001zzzzzzzzzzzzzzzz"
	err := c.AgentError(t.Context(), unknown, "start process", call(unknown))
	if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), unknown) {
		t.Fatalf("unknown sandbox: %v, want not_found naming it", err)
	}
	err = c.AgentError(t.Context(), paused, "start process", call(paused))
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "paused") {
		t.Fatalf("paused sandbox: %v, want failed_precondition saying it is paused", err)
	}
	var de *errdefs.DiedError
	if errors.As(err, &de) {
		t.Fatalf("paused sandbox: %v is a DiedError", err)
	}
}

// TestSecuritySandboxDiedAgentError: a call into a sandbox that died is a
// DiedError with the node's reason, whether the node's answer said so or
// only the sandbox's state does (a stream cut when its init died).
func TestSecuritySandboxDiedAgentError(t *testing.T) {
	n := newFakeNode(t, "n001")
	dead := "n001dddddddddddddddd"
	n.set(func(n *fakeNode) {
		n.states[dead] = nodev1.SandboxState_SANDBOX_STATE_FAILED
		n.reasons = map[string]string{dead: "died: killed by signal 9"}
	})
	c := newClient(t, n)
	proc := processconnect.NewProcessClient(c.HTTPClient(), c.AgentURL(dead, "").String())
	stream, err := proc.Start(t.Context(), connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "true"}}))
	if err == nil {
		for stream.Receive() {
		}
		err = stream.Err()
		stream.Close()
	}
	for _, in := range []error{err, errdefs.New(errdefs.ErrUnavailable, "the agent ended the process stream without an exit event")} {
		got := c.AgentError(t.Context(), dead, "start process", in)
		var de *errdefs.DiedError
		if !errors.As(got, &de) || de.Reason != "killed by signal 9" || !errors.Is(got, errdefs.ErrFailedPrecondition) ||
			got.Error() != "sandbox "+dead+" died: killed by signal 9; create a new one" {
			t.Fatalf("%v: got %v, want a DiedError with the reason", in, got)
		}
		ce, ok := errdefs.ToConnect(got).(*connect.Error)
		if !ok || ce.Code() != connect.CodeFailedPrecondition || ce.Meta().Get(errdefs.DiedMetadataKey) != "killed by signal 9" {
			t.Fatalf("answer %v lacks the %s metadata", ce, errdefs.DiedMetadataKey)
		}
	}
}

// TestNoNodeImports: the E2B gateway builds on nodeclient and must stay
// free of the node's and the backends' code.
func TestNoNodeImports(t *testing.T) {
	out, err := exec.CommandContext(t.Context(), "go", "list", "-deps",
		"github.com/kernflux/opendsec/internal/nodeclient", "github.com/kernflux/opendsec/internal/e2b").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{"github.com/kernflux/opendsec/internal/node", "github.com/kernflux/opendsec/internal/runtime"} {
			if dep == banned || strings.HasPrefix(dep, banned+"/") {
				t.Errorf("nodeclient or e2b depends on %s", dep)
			}
		}
	}
}
