//go:build linux

package security

import (
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

// The paper's first incident: agents forged RPCs to the platform's sockets
// inside the sandbox (chronus). Here the node reaches the agent on
// /run/opendsec/agent.sock; what a process in the sandbox must not get by
// forging the node's side of that conversation:
//   - an unprivileged user cannot connect to the agent (the socket is
//     root's, mode 0600), so it cannot ask the agent to run code as root;
//   - root in the sandbox reaches its own agent, which gives it nothing it
//     does not have (a sandbox is one trust domain: docs/security.md);
//   - no process in the sandbox reaches the node, API server, watcher or
//     E2B gateway (they are not on the sandbox's network);
//   - a socket planted at agent.sock pointing at a host socket is not
//     followed by the node (the host socket sees no connection);
//   - envd's internal routes and the agent's /_opendsec/ extensions are
//     refused by the E2B gateway.
//
// Package tests: internal/runtime/container TestAgentSocketSymlinkRefused,
// TestSandboxIsolation/NoInheritedSockets, internal/e2b proxy tests.
func checkForgedAgentRPC(t *testing.T, e *env) {
	// With a network policy, so it has a route out (to the node's side).
	id := e.create(t, &opendsecv1.SandboxSpec{Network: &opendsecv1.NetworkPolicy{
		Allow: []*opendsecv1.NetworkRule{{Cidr: harness.InetIP, Protocol: "tcp", Ports: "8080"}},
	}})
	e.withProbe(t, id)

	user := e.runProbe(t, id, "user", "agent")
	for _, k := range []string{"agent-list", "agent-read"} {
		if !strings.Contains(user[k], "permission denied") {
			t.Errorf("as user, %s: %q; want the socket to refuse (permission denied)", k, user[k])
		}
	}
	// The control: the probe does reach the agent as root.
	if root := e.runProbe(t, id, "", "agent"); root["agent-list"] != "ok" {
		t.Errorf("as root, agent-list: %q; the probe does not reach the agent", root["agent-list"])
	}

	// The control plane is not on the sandbox's network.
	gw := strings.TrimSpace(e.sh(t, id, "ip route | awk '/^default/ {print $3}'"))
	if net.ParseIP(gw) == nil {
		t.Fatalf("no default gateway in the sandbox: %q", gw)
	}
	var addrs []string
	for _, p := range controlPorts(t, e.System) {
		addrs = append(addrs, net.JoinHostPort(gw, p), net.JoinHostPort("127.0.0.1", p))
	}
	for k, v := range e.runProbe(t, id, "", append([]string{"dial"}, addrs...)...) {
		if v == "ok" {
			t.Errorf("%s from the sandbox: connected; the control plane must be unreachable", k)
		}
	}

	// A planted symlink to a host socket is not followed.
	hostSock := filepath.Join(t.TempDir(), "host.sock")
	ln, err := net.Listen("unix", hostSock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan struct{}, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- struct{}{}
			c.Close()
		}
	}()
	victim := e.create(t, nil)
	// The exec may be answered or cut off with its socket.
	e.Shell(t, victim, "ln -s "+hostSock+" /run/opendsec/evil && mv -f /run/opendsec/evil /run/opendsec/agent.sock")
	if _, err := e.c.RunShell(t.Context(), victim, "true"); err == nil {
		t.Errorf("exec through a planted agent.sock symlink succeeded")
	}
	select {
	case <-accepted:
		t.Errorf("the host socket the sandbox pointed agent.sock at received a connection")
	default:
	}

	// Internal routes through the E2B gateway.
	sb := e.e2bCreate(t, true)
	for _, p := range []string{"/init", "/freeze", "/_opendsec/port/80"} {
		if st, body := e.envd(t, sb, http.MethodPost, p, sb.accessToken, "application/json", strings.NewReader("{}")); st != http.StatusNotFound {
			t.Errorf("E2B %s: %d %s, want 404 internal route", p, st, body)
		}
	}
}

// controlPorts are the ports the system's servers listen on.
func controlPorts(t *testing.T, s *harness.System) []string {
	t.Helper()
	b, err := os.ReadFile(s.ConfigPath())
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		APIServer struct{ Listen string } `json:"apiserver"`
		Watcher   struct{ Listen string } `json:"watcher"`
		Node      struct{ Listen string } `json:"node"`
		E2B       struct{ Listen string } `json:"e2b"`
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		t.Fatal(err)
	}
	var ports []string
	for _, a := range []string{cfg.APIServer.Listen, cfg.Watcher.Listen, cfg.Node.Listen, cfg.E2B.Listen} {
		_, p, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatalf("listen address %q: %v", a, err)
		}
		ports = append(ports, p)
	}
	return ports
}
