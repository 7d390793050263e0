package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/testutil"
)

// TestAgentAsPID1 runs the real binary as PID 1 of fresh pid, mount and
// network namespaces (as in a container): it must reap orphans, bring up
// loopback so in-sandbox servers on 127.0.0.1 work (reached through the
// port tunnel), replace a stale socket, and exit cleanly on SIGTERM.
func TestAgentAsPID1(t *testing.T) {
	testutil.RequiresRoot(t)
	bin := testutil.AgentBinary(t)
	dir, err := os.MkdirTemp("", "ag1")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "a.sock")
	// A stale socket file from a previous run.
	stale, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()

	cmd := exec.Command("unshare", "--pid", "--net", "--mount-proc", "--fork", "--kill-child", bin, "--listen", sock)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		cmd.Process.Kill()
		<-exited
	}()

	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	poll(t, 10*time.Second, "agent health", func() bool {
		resp, err := hc.Get("http://agent/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusNoContent
	})
	pc := processconnect.NewProcessClient(hc, "http://agent", connect.WithProtoJSON())
	run := func(script string) (string, int32) {
		t.Helper()
		f := false
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		s, err := pc.Start(ctx, connect.NewRequest(&process.StartRequest{
			Process: &process.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}, Stdin: &f,
		}))
		if err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		code := int32(-100)
		for s.Receive() {
			out.Write(s.Msg().GetEvent().GetData().GetStdout())
			if end := s.Msg().GetEvent().GetEnd(); end != nil {
				code = end.ExitCode
			}
		}
		if err := s.Err(); err != nil {
			t.Fatal(err)
		}
		return out.String(), code
	}

	if out, _ := run("echo $$; cat /proc/1/comm"); !strings.Contains(out, "opendsec-agent") {
		t.Fatalf("agent is not PID 1: %q", out)
	}
	// Orphans are reparented to PID 1 and must not stay zombies.
	if _, code := run("sleep 0.1 & sleep 0.1 & exit 0"); code != 0 {
		t.Fatalf("exit code %d", code)
	}
	poll(t, 10*time.Second, "no zombies in the sandbox", func() bool {
		out, _ := run(`grep -l '^State:.*Z' /proc/[0-9]*/status 2>/dev/null | wc -l`)
		return strings.TrimSpace(out) == "0"
	})
	// Loopback is up in the fresh network namespace.
	if out, _ := run("ip -o link show lo"); !strings.Contains(out, ",UP") {
		t.Fatalf("lo is not up: %q", out)
	}
	// A server on 127.0.0.1 inside, reached through the tunnel.
	// Started, then the client goes away: the process stays (detached).
	bctx, bcancel := context.WithCancel(t.Context())
	f := false
	bg, err := pc.Start(bctx, connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "busybox", Args: []string{"nc", "-ll", "-p", "8080", "-e", "/bin/cat"}}, Stdin: &f,
	}))
	if err != nil || !bg.Receive() {
		t.Fatalf("start nc: %v %v", err, bg.Err())
	}
	bcancel()
	var conn net.Conn
	poll(t, 10*time.Second, "tunnel to in-sandbox port 8080", func() bool {
		c, err := net.Dial("unix", sock)
		if err != nil {
			return false
		}
		fmt.Fprintf(c, "GET /_opendsec/port/8080 HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
			c.Close()
			return false
		}
		conn = c
		return true
	})
	conn.Write([]byte("ping\n"))
	conn.(*net.UnixConn).CloseWrite()
	got, _ := io.ReadAll(conn)
	conn.Close()
	if string(got) != "ping\n" {
		t.Fatalf("echo through tunnel = %q", got)
	}

	// SIGTERM: the agent (PID 1 inside) shuts down and exits 0.
	kids, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	agentPID, err := strconv.Atoi(strings.TrimSpace(string(kids)))
	if err != nil {
		t.Fatalf("agent pid from %q: %v", kids, err)
	}
	if err := syscall.Kill(agentPID, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("agent exit after SIGTERM: %v", err)
		}
		exited <- nil
	case <-time.After(15 * time.Second):
		t.Fatal("agent did not exit within 15s of SIGTERM")
	}
}

func poll(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
