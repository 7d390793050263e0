package main

import (
	"context"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/testutil"
)

// TestIdleTrimReturnsMemory streams a burst of output through the real
// binary and checks that its anonymous memory, grown by the burst, goes back
// down once it is idle (the Go runtime alone keeps it for minutes).
func TestIdleTrimReturnsMemory(t *testing.T) {
	testutil.RequiresRoot(t) // its process runs as root (the default user)
	bin := testutil.AgentBinary(t)
	sock := filepath.Join(t.TempDir(), "a.sock")
	cmd := exec.Command(bin, "--listen", sock, "--log-level", "warn", "--idle-trim-after", "300ms")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
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
	fresh := rssAnon(t, cmd.Process.Pid)

	pc := processconnect.NewProcessClient(hc, "http://agent", connect.WithProtoJSON())
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	f := false
	s, err := pc.Start(ctx, connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "yes | head -c 150000000"}}, Stdin: &f,
	}))
	if err != nil {
		t.Fatal(err)
	}
	for s.Receive() {
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	s.Close()
	burst := rssAnon(t, cmd.Process.Pid)
	if burst-fresh < 3<<20 {
		t.Fatalf("RssAnon %d KiB -> %d KiB: the burst did not grow the agent, nothing to check", fresh>>10, burst>>10)
	}
	var now int64
	poll(t, 10*time.Second, "RssAnon to drop by 2 MiB after the burst", func() bool {
		now = rssAnon(t, cmd.Process.Pid)
		return now < burst-2<<20
	})
	t.Logf("RssAnon: fresh %d KiB, after burst %d KiB, idle %d KiB", fresh>>10, burst>>10, now>>10)
}

func rssAnon(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "RssAnon:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatalf("parse RssAnon %q: %v", v, err)
			}
			return kb << 10
		}
	}
	t.Fatal("no RssAnon in /proc/<pid>/status")
	return 0
}

// TestIdleExitFlags: --idle-exit, --conn-fd and --ready-fd need a socket
// kept by opendsec-init, and a negative --idle-exit is refused; each names
// the flag.
func TestIdleExitFlags(t *testing.T) {
	bin := testutil.AgentBinary(t)
	sock := filepath.Join(t.TempDir(), "a.sock")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--listen", sock, "--idle-exit", "1s"}, "--idle-exit needs --listen-fd"},
		{[]string{"--listen-fd", "3", "--idle-exit", "-1s"}, "--idle-exit: -1s is negative"},
		{[]string{"--listen-fd", "9"}, "--listen-fd"},
		{[]string{"--listen", sock, "--conn-fd", "4"}, "--conn-fd and --ready-fd need --listen-fd"},
		{[]string{"--listen", sock, "--ready-fd", "5"}, "--conn-fd and --ready-fd need --listen-fd"},
	} {
		out, err := exec.Command(bin, tc.args...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), tc.want) {
			t.Errorf("%v: err %v output %q; want a failure saying %q", tc.args, err, out, tc.want)
		}
	}
	if _, err := os.Stat(sock); err == nil {
		t.Error("a refused start created the socket")
	}
}
