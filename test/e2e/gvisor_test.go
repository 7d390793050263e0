//go:build linux

package e2e

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

// gvisorRunsc is the runsc the gvisor tests use: $OPENDSEC_RUNSC, else the
// one scripts/install-deps.sh builds.
func gvisorRunsc(t *testing.T) string {
	t.Helper()
	p := os.Getenv("OPENDSEC_RUNSC")
	if p == "" {
		p = "/var/cache/opendsec/gvisor/runsc"
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("runsc is needed for the gvisor backend: %v; run scripts/install-deps.sh (it builds a pinned runsc) or set OPENDSEC_RUNSC", err)
	}
	return p
}

// newGvisorSystem is a system whose node has the container and gvisor
// backends, with root/py:3.11 imported.
func newGvisorSystem(t *testing.T) *system {
	runsc := gvisorRunsc(t)
	s := &system{harness.NewWith(t, harness.Options{Config: func(cfg map[string]any) {
		harness.Set(cfg, "node.backends", map[string]any{
			"container": map[string]any{},
			"gvisor":    map[string]any{"runsc_path": runsc, "agent_path": filepath.Join(harness.BinDir(), "opendsec-agent"), "debug_log_dir": os.Getenv("OPENDSEC_RUNSC_DEBUG_LOG")},
		})
	}})}
	s.Run("image", "import-rootfs", "--name", "root/py:3.11", "--rootfs", pyRootfs(t))
	return s
}

// pyServer holds a random value in a Python process's memory and answers
// every connection to 127.0.0.1:7000 with it, a fresh os.urandom and its
// hostname.
const pyServer = `import os, socket
v = os.urandom(8).hex()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7000))
s.listen(8)
while True:
    c, _ = s.accept()
    c.sendall(("%s %s %s\n" % (v, os.urandom(8).hex(), socket.gethostname())).encode())
    c.close()
`

const pyClient = `python3 -c 'import socket; print(socket.create_connection(("127.0.0.1", 7000), timeout=10).makefile().readline().strip())'`

// TestGvisorForkWithMemory is the acceptance's fork test on gvisor: a
// Python process holding a random value in memory, forked into 3 through
// the node's fork API: each fork's process (the same one, restored) reports
// the same value, and each fork has its own hostname and RNG output; a
// write in one fork is invisible to the others and the source. The forks
// are on the node's network like any sandbox.
func TestGvisorForkWithMemory(t *testing.T) {
	s := newGvisorSystem(t)
	inet := harness.MakeInternet(t, s.NodeNS())
	addr := harness.InetIP + ":8080"
	l := harness.ListenIn(t, inet, addr)
	go func() {
		_ = http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "hello "+addr) }))
	}()
	s.Start()
	src := s.create(t, &opendsecv1.SandboxSpec{Backend: "gvisor", Image: "root/py:3.11", Network: &opendsecv1.NetworkPolicy{
		Allow: []*opendsecv1.NetworkRule{{Cidr: harness.InetIP, Protocol: "tcp", Ports: "8080"}},
	}})
	// The node's policy holds in the sandbox and in every fork.
	get := func(id string) {
		t.Helper()
		r := s.shell(t, id, `python3 -c 'import urllib.request; print(urllib.request.urlopen("http://`+addr+`/", timeout=5).read().decode())'`)
		if r.exit.GetExitCode() != 0 || strings.TrimSpace(r.stdout) != "hello "+addr {
			t.Errorf("%s: GET of the allowed server: %q %q", id, r.stdout, r.stderr)
		}
		r = s.shell(t, id, `python3 -c 'import socket; socket.create_connection(("`+harness.InetIP+`", 8081), timeout=2)'`)
		if r.exit.GetExitCode() == 0 {
			t.Errorf("%s: connected to a port no rule allows", id)
		}
	}
	get(src.GetId())
	s.checkPTY(t, src.GetId())
	if r := s.shell(t, src.GetId(), "cat > /root/srv.py <<'EOF'\n"+pyServer+"EOF\n(python3 /root/srv.py >/dev/null 2>&1 </dev/null &)\n"+
		"for i in $(seq 200); do "+pyClient+" 2>/dev/null && exit 0; sleep 0.05; done; exit 1"); r.exit.GetExitCode() != 0 {
		t.Fatalf("start the python server: %+v", r)
	}
	report := func(id string) (value, rng, host, urandom string) {
		t.Helper()
		r := s.shell(t, id, pyClient+"; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if r.exit.GetExitCode() != 0 || len(lines) != 2 {
			t.Fatalf("%s: ask the python process: %q %q", id, r.stdout, r.stderr)
		}
		f := strings.Fields(lines[0])
		if len(f) != 3 {
			t.Fatalf("%s: python says %q", id, lines[0])
		}
		return f[0], f[1], f[2], lines[1]
	}
	v0, rng0, host0, ur0 := report(src.GetId())

	out, err := s.fork(t, src.GetId(), 3)
	if err != nil {
		t.Fatalf("fork 3: %v", err)
	}
	if len(out.GetForks()) != 3 {
		t.Fatalf("%d forks, want 3", len(out.GetForks()))
	}
	t.Logf("source frozen %d µs", out.GetSourceFrozenUs())
	seenHost, seenRNG, seenUR := map[string]string{host0: "source"}, map[string]string{rng0: "source"}, map[string]string{ur0: "source"}
	var ids []string
	for _, f := range out.GetForks() {
		id := f.GetSandbox().GetId()
		ids = append(ids, id)
		if !f.GetMemoryPreserved() {
			t.Errorf("fork %s: memory_preserved false on gvisor", id)
		}
		v, rng, host, ur := report(id)
		t.Logf("fork %s: value %s, python urandom %s, hostname %s, /dev/urandom %s", id, v, rng, host, ur)
		if v != v0 {
			t.Errorf("fork %s: python holds %q, the source %q: not the source's memory", id, v, v0)
		}
		for _, c := range []struct {
			what, got string
			seen      map[string]string
		}{{"hostname", host, seenHost}, {"python's os.urandom", rng, seenRNG}, {"/dev/urandom", ur, seenUR}} {
			if other, dup := c.seen[c.got]; dup {
				t.Errorf("fork %s: %s %q repeats %s's", id, c.what, c.got, other)
			}
			c.seen[c.got] = id
		}
		if h := strings.TrimSpace(s.shell(t, id, "hostname").stdout); h != host {
			t.Errorf("fork %s: hostname %q, python says %q", id, h, host)
		}
		get(id)
	}
	if r := s.shell(t, ids[0], "echo fork-0 > /root/only-0"); r.exit.GetExitCode() != 0 {
		t.Fatalf("write in fork 0: %+v", r)
	}
	for _, id := range append([]string{src.GetId()}, ids[1:]...) {
		if r := s.shell(t, id, "cat /root/only-0"); r.exit.GetExitCode() == 0 {
			t.Errorf("%s reads fork 0's file: %q", id, r.stdout)
		}
	}
	// The source runs on with its value.
	if v, _, h, _ := report(src.GetId()); v != v0 || h != host0 {
		t.Errorf("source after the fork: %s %s, was %s %s", v, h, v0, host0)
	}
	for _, id := range append(ids, src.GetId()) {
		if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id})); err != nil {
			t.Fatalf("stop %s: %v", id, err)
		}
	}
}
