package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// pidsFactory is newFactoryWith under a cgroup parent of the test's own
// (so the small ceilings below never touch other tests' sandboxes), with
// the node limits given; the parent's cgroups are removed at the end.
func pidsFactory(t *testing.T, maxPids, totalPids int64) (runtimetest.Factory, string) {
	return ownParentFactory(t, "pids", func(c *Config) { c.MaxPidsLimit, c.TotalPidsLimit = maxPids, totalPids })
}

// ownParentFactory is newFactoryWith under a cgroup parent of the test's
// own (/opendsec-test-<prefix...>), mod applied to the rest of the
// configuration; the parent's cgroups are removed at the end.
func ownParentFactory(t *testing.T, prefix string, mod func(*Config)) (runtimetest.Factory, string) {
	parent := "/opendsec-test-" + runtimetest.NewID(prefix)
	f := newFactoryWith(t, func(c *Config) {
		c.CgroupParent = parent
		if mod != nil {
			mod(c)
		}
	})
	cg, err := detectCgroups()
	if err != nil {
		t.Fatal(err)
	}
	// Registered first, so it runs after every sandbox's delete.
	t.Cleanup(func() {
		if err := removeCgroupParent(cg, parent); err != nil {
			t.Errorf("remove cgroup parent %s: %v", parent, err)
		}
	})
	return f, parent
}

// removeCgroupParent removes a test's own sandboxes' parent cgroup: the
// sandboxes' shared cpuset in it first (cgview_linux.go), then its
// directory in every hierarchy.
func removeCgroupParent(cg cgroupMounts, parent string) error {
	if mnt, ok := cg.v1["cpuset"]; ok && !cg.v2 {
		shared := filepath.Join(mnt, parent, SharedCpusetName)
		if err := unix.Rmdir(shared); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("remove %s: %w", shared, err)
		}
	}
	return cg.remove(context.Background(), parent)
}

// readPidsFile reads a pids controller file of cgroup path ("max" is -1).
func readPidsFile(t *testing.T, c *Runtime, path, file string) int64 {
	t.Helper()
	dir := filepath.Join(c.cg.unified, path)
	if !c.cg.v2 {
		dir = filepath.Join(c.cg.v1["pids"], path)
	}
	n, err := readInt(filepath.Join(dir, file))
	if err != nil {
		t.Fatalf("read %s of %s: %v", file, path, err)
	}
	return n
}

// TestSecurityPidsLimitParentCgroup: the backend sets its cgroup parent's
// pids.max to the node's total_pids_limit at start, and again at every
// start after (a node restart that recovers running sandboxes); unset, it
// is the host's pid limit less headroom.
func TestSecurityPidsLimitParentCgroup(t *testing.T) {
	const total = 777
	f, parent := pidsFactory(t, 128, total)
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	if got := readPidsFile(t, c, parent, "pids.max"); got != total {
		t.Fatalf("%s pids.max = %d, want node.total_pids_limit %d", parent, got, total)
	}
	spec, h := runtimetest.StartSandbox(t, rt, tmpl)
	if got := readPidsFile(t, c, c.cgroupPath(spec.ID), "pids.max"); got != tmpl.Resources.PidsLimit {
		t.Fatalf("sandbox pids.max = %d, want its pids_limit %d", got, tmpl.Resources.PidsLimit)
	}
	// Someone (or an older node) reset the ceiling; the restarted node
	// sets it again and recovers the sandbox under it.
	if err := os.WriteFile(c.cg.pidsMaxFile(parent), []byte("max"), 0); err != nil {
		t.Fatal(err)
	}
	rt2, _ := f(t)
	if err := rt2.Recover(t.Context(), h); err != nil {
		t.Fatalf("recover: %v", err)
	}
	if got := readPidsFile(t, c, parent, "pids.max"); got != total {
		t.Fatalf("after a restart %s pids.max = %d, want %d", parent, got, total)
	}
	if res := sh(t, rt2, spec.ID, "echo alive"); res.Stdout != "alive\n" {
		t.Fatalf("recovered sandbox: %+v", res)
	}

	avail, err := sandboxspec.HostPids()
	if err != nil {
		t.Fatal(err)
	}
	fd, parentD := pidsFactory(t, 0, 0)
	rtd, _ := fd(t)
	want := sandboxspec.TotalPidsCeiling(avail)
	if got := readPidsFile(t, rtd.(*Runtime), parentD, "pids.max"); got != want {
		t.Fatalf("default %s pids.max = %d, want %d (host pids %d less headroom)", parentD, got, want, avail)
	}
	t.Logf("host runs %d pids; default node.total_pids_limit %d", avail, want)
}

// TestSecurityPidsLimitAboveNodeMax: a pids_limit above the node's
// max_pids_limit, or above anything the kernel can run (10,000,000 was a
// raw runc error at start), is invalid_argument naming the field at
// Create, and nothing is made.
func TestSecurityPidsLimitAboveNodeMax(t *testing.T) {
	f, parent := pidsFactory(t, 256, 1024)
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	for _, pids := range []int64{257, 4_000_000, 10_000_000} {
		tmpl.Resources.PidsLimit = pids
		spec := runtimetest.Prepare(t, rt, tmpl)
		_, err := rt.Create(t.Context(), spec)
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != "resources.pids_limit" || !strings.Contains(fe.Msg, "node.max_pids_limit") || !strings.Contains(fe.Msg, "at most 256") {
			if err == nil {
				_ = rt.Start(t.Context(), spec.ID) // show what runc says
				_, err = rt.Status(t.Context(), spec.ID)
			}
			t.Fatalf("pids_limit %d: %v; want invalid_argument naming resources.pids_limit, node.max_pids_limit and the limit 256", pids, err)
		}
		if ents, _ := os.ReadDir(spec.StateDir); len(ents) != 0 {
			t.Errorf("pids_limit %d: a refused create left %d files in its state dir", pids, len(ents))
		}
		if dirs := c.CgroupDirs(spec.ID); len(dirs) != 0 {
			t.Errorf("pids_limit %d: a refused create left cgroups %v", pids, dirs)
		}
	}
	if got := readPidsFile(t, c, parent, "pids.max"); got != 1024 {
		t.Errorf("%s pids.max = %d after refused creates, want 1024", parent, got)
	}
}

// TestSecurityPidsLimitForkBombs: process floods in two sandboxes whose
// limits add up past the node's total_pids_limit never take more than it —
// the parent cgroup refuses the forks; the host keeps forking, and with one
// flood still running a new sandbox starts and runs a command. (The
// classic shell fork bomb within one sandbox's limit is TestPidsLimit.)
func TestSecurityPidsLimitForkBombs(t *testing.T) {
	const maxPids, total = 64, 100
	f, parent := pidsFactory(t, maxPids, total)
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	tmpl.Resources = runtime.Resources{CPU: 0.5, MemoryMB: 128, PidsLimit: maxPids}
	a, _ := runtimetest.StartSandbox(t, rt, tmpl)
	b, _ := runtimetest.StartSandbox(t, rt, tmpl)
	// Each bomb starts sleeps for ever, retrying when a fork fails (a shell
	// bomb collapses: ash exits at its first failed fork), in the
	// background with its output away from the agent's pipes, so the shell
	// returns at once. Their own limits alone (64) would let the two
	// take 128.
	for _, id := range []string{a.ID, b.ID} {
		sh(t, rt, id, `awk 'BEGIN { while (1) system("sleep 600 &") }' </dev/null >/dev/null 2>&1 &`)
	}
	deadline := time.Now().Add(30 * time.Second)
	var peak int64
	for {
		cur := readPidsFile(t, c, parent, "pids.current")
		peak = max(peak, cur)
		if cur > total {
			t.Fatalf("the sandboxes hold %d pids, over node.total_pids_limit %d", cur, total)
		}
		if cur >= total-2 {
			break // the parent is full: its limit, not the sandboxes', refuses forks
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bombs never filled the parent (peak %d of %d pids; a: %d, b: %d)", peak, total,
				readPidsFile(t, c, c.cgroupPath(a.ID), "pids.current"), readPidsFile(t, c, c.cgroupPath(b.ID), "pids.current"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	// A few more samples: the bombs never get past it.
	for range 50 {
		cur := readPidsFile(t, c, parent, "pids.current")
		peak = max(peak, cur)
		if cur > total {
			t.Fatalf("the sandboxes hold %d pids, over node.total_pids_limit %d", cur, total)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, id := range []string{a.ID, b.ID} {
		if n := readPidsFile(t, c, c.cgroupPath(id), "pids.current"); n > maxPids {
			t.Fatalf("sandbox %s holds %d pids, over its pids_limit %d", id, n, maxPids)
		}
	}
	if err := exec.Command("/bin/true").Run(); err != nil {
		t.Fatalf("the host cannot fork while the sandboxes are full: %v", err)
	}
	// While they are full a new sandbox cannot start, and says why.
	tmpl.Resources.PidsLimit = 32
	full := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(t.Context(), full); err != nil {
		t.Fatalf("create beside full sandboxes: %v", err)
	}
	err := rt.Start(t.Context(), full.ID)
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "node.total_pids_limit") {
		t.Fatalf("start while the sandboxes hold every pid: %v; want resource_exhausted naming node.total_pids_limit", err)
	}
	t.Logf("refused: %v", err)
	// Stop one bomb; the other keeps its 64 and a new sandbox starts in
	// what is left.
	if err := rt.Stop(t.Context(), b.ID, runtime.StopOptions{}); err != nil {
		t.Fatalf("stop a bombed sandbox: %v", err)
	}
	if err := rt.Delete(t.Context(), b.ID); err != nil {
		t.Fatalf("delete a bombed sandbox: %v", err)
	}
	nw, _ := runtimetest.StartSandbox(t, rt, tmpl)
	if res := sh(t, rt, nw.ID, "echo alive"); res.Stdout != "alive\n" {
		t.Fatalf("new sandbox beside a fork bomb: %+v", res)
	}
	if cur := readPidsFile(t, c, parent, "pids.current"); cur > total {
		t.Fatalf("the sandboxes hold %d pids, over %d", cur, total)
	}
	t.Logf("two process floods peaked at %d pids of node.total_pids_limit %d", peak, total)
	if err := rt.Stop(t.Context(), a.ID, runtime.StopOptions{}); err != nil {
		t.Fatalf("stop a bombed sandbox: %v", err)
	}
}

// TestSecurityPidsLimitNofile: every sandbox process has the node's
// nofile_limit as soft and hard RLIMIT_NOFILE (docs/security.md), not the
// node's own limit; a limit runc could not give is refused at start.
func TestSecurityPidsLimitNofile(t *testing.T) {
	f, _ := pidsFactory(t, 0, 0)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	want := strconv.Itoa(sandboxspec.DefaultNofileLimit)
	res := sh(t, rt, spec.ID, `grep 'Max open files' /proc/self/limits; ulimit -n; ulimit -Hn`)
	fields := strings.Fields(res.Stdout)
	if len(fields) != 8 || fields[3] != want || fields[4] != want || fields[6] != want || fields[7] != want {
		t.Fatalf("sandbox open files limit:\n%s\nwant %s soft and hard", res.Stdout, want)
	}

	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	if rl.Max >= sandboxspec.MaxNofileLimit || hasCapability(unix.CAP_SYS_RESOURCE) {
		t.Logf("the node can raise RLIMIT_NOFILE (hard %d); not checking the refusal", rl.Max)
		return
	}
	above := int64(rl.Max) + 1
	cfg := Config{StateRoot: filepath.Join(t.TempDir(), "runc"), CgroupParent: "/opendsec-test", AgentPath: rt.(*Runtime).cfg.AgentPath, NofileLimit: above}
	_, err := New(cfg)
	var fe *errdefs.FieldError
	if !errors.As(err, &fe) || fe.Field != "node.nofile_limit" {
		t.Fatalf("nofile_limit %d above the node's hard limit %d without CAP_SYS_RESOURCE: New = %v; want invalid_argument naming node.nofile_limit", above, rl.Max, err)
	}
	t.Logf("refused: %v", err)
}
