package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/config"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/runtime/container"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/testutil"
)

// TestSecurityPidsLimitFromConfig: the node's process and file limits in
// the config reach the sandboxes through the public API: a pids_limit
// above node.max_pids_limit is invalid_argument naming pids_limit and the
// key, the cgroup parent's pids.max is node.total_pids_limit, and a
// sandbox's processes have node.nofile_limit open files.
func TestSecurityPidsLimitFromConfig(t *testing.T) {
	testutil.RequiresRoot(t)
	agent := testutil.AgentBinary(t)
	parent := "/opendsec-test-" + sandboxid.New("pids")
	s := startUpWith(t, false, func(cfg *config.Config) {
		cfg.Node.AgentPath = agent
		cfg.Node.Backends = map[string]json.RawMessage{"container": json.RawMessage(fmt.Sprintf(`{"cgroup_parent": %q}`, parent))}
		cfg.Node.WarmPool.Size = 0
		cfg.Node.MaxPidsLimit, cfg.Node.TotalPidsLimit, cfg.Node.NofileLimit = 2048, 5000, 1500
		store, err := image.Open(cfg.Node.ImageDir)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := store.ImportDir(t.Context(), "root/busybox", testutil.BusyboxRootfs(t), image.Config{Env: []string{"PATH=/bin"}}); err != nil {
			t.Fatal(err)
		}
	})
	pidsRoot := "/sys/fs/cgroup/pids"
	if _, err := os.Stat(pidsRoot); err != nil {
		pidsRoot = "/sys/fs/cgroup" // v2
	}
	t.Cleanup(func() { // runc made the parent in every hierarchy
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
	if b, err := os.ReadFile(filepath.Join(pidsRoot, parent, "pids.max")); err != nil || strings.TrimSpace(string(b)) != "5000" {
		t.Fatalf("%s pids.max = %q, %v; want node.total_pids_limit 5000", parent, b, err)
	}
	iss, err := loadIssuer(t.Context(), s.cfg)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := EnsureBootstrapToken(s.cfg, iss)
	if err != nil {
		t.Fatal(err)
	}
	api := opendsecv1connect.NewSandboxServiceClient(h2cClient(), "http://"+s.api, connect.WithInterceptors(auth.ClientInterceptor(admin)))
	ctx := t.Context()
	create := func(pids int64) (*opendsecv1.Sandbox, error) {
		deadline := time.Now().Add(10 * time.Second)
		for {
			resp, err := api.CreateSandbox(ctx, connect.NewRequest(&opendsecv1.CreateSandboxRequest{
				Spec: &opendsecv1.SandboxSpec{Image: "root/busybox", PidsLimit: pids, TimeoutSeconds: 300}}))
			if err == nil {
				return resp.Msg.GetSandbox(), nil
			}
			if connect.CodeOf(err) != connect.CodeUnavailable || time.Now().After(deadline) {
				return nil, err
			}
			time.Sleep(50 * time.Millisecond) // polling for the watcher's first view
		}
	}
	for _, tc := range []struct {
		pids int64
		want []string
	}{
		{2049, []string{"pids_limit: 2049 processes exceeds the 2048", "node.max_pids_limit", "ask for at most 2048"}},
		{10_000_000, []string{"pids_limit: 10000000 is more than the kernel can run"}},
	} {
		sb, err := create(tc.pids)
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !containsAll(err.Error(), tc.want...) {
			t.Fatalf("create with pids_limit %d: %v %v; want invalid_argument with %q", tc.pids, sb, err, tc.want)
		}
	}
	sb, err := create(2048)
	if err != nil {
		t.Fatalf("create with pids_limit at node.max_pids_limit: %v", err)
	}
	procs, err := os.ReadFile(filepath.Join(pidsRoot, parent, sb.GetId(), "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	initPid, _, _ := strings.Cut(strings.TrimSpace(string(procs)), "\n")
	limits, err := os.ReadFile("/proc/" + initPid + "/limits")
	if err != nil {
		t.Fatal(err)
	}
	var nofile string
	for _, l := range strings.Split(string(limits), "\n") {
		if strings.HasPrefix(l, "Max open files") {
			nofile = strings.Join(strings.Fields(l)[3:5], " ")
		}
	}
	if nofile != "1500 1500" {
		t.Fatalf("sandbox init's open files limit %q, want node.nofile_limit 1500 soft and hard:\n%s", nofile, limits)
	}
	if b, err := os.ReadFile(filepath.Join(pidsRoot, parent, sb.GetId(), "pids.max")); err != nil || strings.TrimSpace(string(b)) != "2048" {
		t.Fatalf("sandbox pids.max = %q, %v; want 2048", b, err)
	}
	if _, err := api.StopSandbox(context.WithoutCancel(ctx), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: sb.GetId()})); err != nil {
		t.Fatalf("stop: %v", err)
	}
	s.stop(t)
}
