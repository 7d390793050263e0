//go:build linux

package security

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/runtime/container"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/test/harness"
)

// TestSecurityPidsLimit is issue 11's finding 2 ("a user can lift the
// process cap"), end to end: the node's config bounds pids_limit
// (node.max_pids_limit: above it, and at 10,000,000, a create is
// invalid_argument naming pids_limit), the sandboxes' cgroup parent has
// pids.max = node.total_pids_limit, every sandbox process has
// node.nofile_limit open files, and a process flood in each of 4
// sandboxes stays within their limits, below the ceiling, while a new
// sandbox still starts. The ceiling refusing forks when the sandboxes'
// limits add up past it is internal/runtime/container's
// TestSecurityPidsLimitForkBombs; the node's refusal before the backend
// runs is internal/node's TestSecurityPidsLimitNode.
func TestSecurityPidsLimit(t *testing.T) {
	const maxPids, total, nofile, bombPids = 1024, 1100, 2048, 64
	parent := "/opendsec-test-" + sandboxid.New("sec0")
	// Registered before the system's own cleanup, so it runs after the
	// sandboxes are gone: runc made the parent in every hierarchy.
	t.Cleanup(func() {
		dirs, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup/*", parent))
		for _, d := range append(dirs, filepath.Join("/sys/fs/cgroup", parent)) {
			// The sandboxes' shared cpuset first (crun, cgroup v1).
			if err := os.Remove(filepath.Join(d, container.SharedCpusetName)); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Errorf("remove the shared cpuset: %v", err)
			}
			if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Errorf("remove cgroup parent: %v", err)
			}
		}
	})
	s := harness.NewWith(t, harness.Options{Config: func(cfg map[string]any) {
		harness.Set(cfg, "node.max_pids_limit", maxPids)
		harness.Set(cfg, "node.total_pids_limit", total)
		harness.Set(cfg, "node.nofile_limit", nofile)
		harness.Set(cfg, "node.backends.container.cgroup_parent", parent)
	}})
	s.Start()

	pidsDir := filepath.Join("/sys/fs/cgroup/pids", parent)
	if _, err := os.Stat("/sys/fs/cgroup/pids"); err != nil {
		pidsDir = filepath.Join("/sys/fs/cgroup", parent) // v2
	}
	read := func(file string) int64 {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(pidsDir, file))
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			t.Fatalf("%s: %q", file, b)
		}
		return n
	}
	if got := read("pids.max"); got != total {
		t.Fatalf("%s pids.max = %d, want node.total_pids_limit %d", parent, got, total)
	}

	for _, tc := range []struct {
		pids int64
		want []string
	}{
		{maxPids + 1, []string{"pids_limit: 1025 processes exceeds the 1024", "node.max_pids_limit", "ask for at most 1024"}},
		{10_000_000, []string{"pids_limit: 10000000 is more than the kernel can run"}},
	} {
		_, err := s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{
			Spec: &opendsecv1.SandboxSpec{Image: "root/busybox", PidsLimit: tc.pids}}))
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !containsEvery(err.Error(), tc.want...) {
			t.Fatalf("create with pids_limit %d: %v; want invalid_argument with %q", tc.pids, err, tc.want)
		}
	}
	if r, err := s.Sandboxes().ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{})); err != nil || len(r.Msg.GetSandboxes()) != 0 {
		t.Fatalf("sandboxes after refused creates: %v %v", r, err)
	}

	var ids []string
	for range 4 {
		sb := s.Create(t, &opendsecv1.SandboxSpec{Cpu: 0.25, MemoryMb: proto.Int64(128), PidsLimit: bombPids})
		ids = append(ids, sb.GetId())
	}
	if r := s.Shell(t, ids[0], "ulimit -n; ulimit -Hn"); r.Stdout != "2048\n2048\n" {
		t.Fatalf("open files limit in a sandbox: %q %q; want node.nofile_limit 2048 soft and hard", r.Stdout, r.Stderr)
	}
	// Each flood starts sleeps for ever, retrying when a fork fails (a
	// shell fork bomb collapses in busybox: ash exits at its first failed
	// fork), in the background away from the exec's pipes.
	for _, id := range ids {
		s.Shell(t, id, `awk 'BEGIN { while (1) system("sleep 600 &") }' </dev/null >/dev/null 2>&1 &`)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		cur := read("pids.current")
		if cur > total {
			t.Fatalf("the sandboxes hold %d pids, over node.total_pids_limit %d", cur, total)
		}
		if cur >= 4*bombPids-8 {
			break // every flood is at its own limit
		}
		if time.Now().After(deadline) {
			t.Fatalf("the floods never reached their limits: %d pids", cur)
		}
		time.Sleep(50 * time.Millisecond) // polling the cgroup with a deadline
	}
	if cur := read("pids.current"); cur > 4*bombPids {
		t.Fatalf("4 sandboxes of pids_limit %d hold %d pids", bombPids, cur)
	}
	if err := exec.Command("/bin/true").Run(); err != nil {
		t.Fatalf("the host cannot fork beside the floods: %v", err)
	}
	nw := s.Create(t, &opendsecv1.SandboxSpec{PidsLimit: 32})
	if r := s.Shell(t, nw.GetId(), "echo alive"); r.Stdout != "alive\n" {
		t.Fatalf("a new sandbox beside 4 floods: %q %q", r.Stdout, r.Stderr)
	}
	t.Logf("4 floods of pids_limit %d: %d pids under %s (pids.max %d)", bombPids, read("pids.current"), parent, total)
	for _, id := range append(ids, nw.GetId()) {
		if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id})); err != nil {
			t.Errorf("stop %s: %v", id, err)
		}
	}
}

func containsEvery(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}
