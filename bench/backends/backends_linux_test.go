// Package backends is the side-by-side benchmark of the sandbox backends
// (bench/backends.sh): the same steps, through the same runtime.Runtime
// contract the node uses, against container (the reference row), gvisor,
// vm (QEMU, under the accelerator kvmprobe picks: TCG here, KVM where the
// host has it) and microvm (Firecracker; a row saying why it is skipped
// where it cannot open), in one run, printed as one table.
package backends

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"

	_ "github.com/kernflux/opendsec/internal/runtime/container"
	_ "github.com/kernflux/opendsec/internal/runtime/gvisor"
	_ "github.com/kernflux/opendsec/internal/runtime/microvm"
	_ "github.com/kernflux/opendsec/internal/runtime/vm"
)

// readyTimeout bounds one sandbox's wait for its agent (a TCG boot on a
// loaded 2-core machine takes 10 s and more).
const readyTimeout = 120 * time.Second

// TestBackends runs the benchmark when OPENDSEC_BENCH_BACKENDS=1:
// OPENDSEC_BENCH_N iterations (default 3) per backend, backends from
// OPENDSEC_BENCH_ONLY (comma-separated; default container,gvisor,vm,microvm).
func TestBackends(t *testing.T) {
	if os.Getenv("OPENDSEC_BENCH_BACKENDS") != "1" {
		t.Skip("bench/backends.sh runs this benchmark (OPENDSEC_BENCH_BACKENDS=1)")
	}
	testutil.RequiresRoot(t)
	n := 3
	if v := os.Getenv("OPENDSEC_BENCH_N"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			t.Fatalf("OPENDSEC_BENCH_N=%q: give a positive count of iterations", v)
		}
	}
	only := []string{"container", "gvisor", "vm", "microvm"}
	if v := os.Getenv("OPENDSEC_BENCH_ONLY"); v != "" {
		only = strings.Split(v, ",")
	}
	accel, err := kvmprobe.Detect(t.Context(), kvmprobe.Options{})
	if err != nil {
		t.Fatalf("accelerator detection: %v", err)
	}
	fmt.Printf("accelerator: %s\n", accel)
	var rows []row
	for _, name := range only {
		rt, tmpl, why := open(t, name)
		if why != "" {
			rows = append(rows, row{name: name, skipped: why})
			fmt.Printf("%s: skipped: %s\n", name, why)
			continue
		}
		label := name
		if name == "vm" {
			label = "vm (QEMU, " + string(accel.Accel) + ")"
		}
		fmt.Printf("%s: measuring, %d iterations\n", label, n)
		r := measure(t, rt, tmpl, n)
		r.name = label
		rows = append(rows, r)
	}
	fmt.Print(table(rows, n))
}

// open builds backend name as a node would (runtime.Open with its config
// section) and the Spec template its sandboxes are made from: the busybox
// root filesystem with the agent, 1 CPU, 256 MiB, a 64 MiB writable layer.
// A backend that cannot run here returns why.
func open(t *testing.T, name string) (runtime.Runtime, runtime.Spec, string) {
	ctx := t.Context()
	agent := testutil.AgentBinary(t)
	busybox := testutil.BusyboxRootfs(t)
	tmpl := runtime.Spec{
		Rootfs:    runtime.Rootfs{Image: "bench/busybox", Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: busybox}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 256, PidsLimit: 128, DiskMB: 64},
	}
	var cfg any
	switch name {
	case "container":
		cfg = map[string]any{"agent_path": agent, "init_path": testutil.InitBinary(t),
			"state_root": filepath.Join(t.TempDir(), "runc"), "cgroup_parent": "/opendsec-bench"}
	case "gvisor":
		runsc := os.Getenv("OPENDSEC_RUNSC")
		if runsc == "" {
			runsc = "/var/cache/opendsec/gvisor/runsc"
		}
		if _, err := os.Stat(runsc); err != nil {
			return nil, tmpl, "no runsc (scripts/install-deps.sh builds it; or set OPENDSEC_RUNSC): " + err.Error()
		}
		// Not a TempDir: runsc keeps a bind mount of an empty netns in
		// its root for --network=none.
		cfg = map[string]any{"agent_path": agent, "runsc_path": runsc,
			"state_root": "/run/opendsec/bench-backends/runsc", "cgroup_parent": "/opendsec-gvisor-bench"}
	case "vm":
		assets, why := guestAssets()
		if why != "" {
			return nil, tmpl, why
		}
		img := filepath.Join(t.TempDir(), "busybox.erofs")
		if out, err := exec.Command("mkfs.erofs", "--quiet", "--all-root", img, busybox).CombinedOutput(); err != nil {
			return nil, tmpl, fmt.Sprintf("mkfs.erofs (erofs-utils) makes the guest's image layer: %v: %s", err, out)
		}
		tmpl.Rootfs.Layers = []runtime.Layer{{Digest: "sha256:busybox", Format: runtime.LayerEROFS, Path: img}}
		cfg = map[string]any{"assets_dir": assets, "accel": "auto", "boot_timeout_sec": int(readyTimeout / time.Second)}
	default:
		cfg = map[string]any{}
	}
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rts, err := runtime.Open(ctx, runtime.Env{NodeID: "bnch", StateDir: t.TempDir()}, map[string]json.RawMessage{name: raw})
	if err != nil {
		return nil, tmpl, err.Error()
	}
	return rts[name], tmpl, ""
}

// guestAssets builds (or reuses) the vm guest's kernel and initramfs with
// scripts/build-guest-assets.sh; "" and why when they cannot be had.
func guestAssets() (string, string) {
	cmd := exec.Command("scripts/build-guest-assets.sh")
	cmd.Dir = "../.."
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", fmt.Sprintf("the guest assets cannot be built (scripts/build-guest-assets.sh: %v): %s", err, strings.TrimSpace(errb.String()))
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	return lines[len(lines)-1], ""
}

// row is one backend's measurements.
type row struct {
	name, skipped string
	// memoryKept: a fork still runs the source's process (it rewrote a
	// file from the value it held in memory).
	memoryKept                    string
	snapshot, fork                bool
	boot                          []time.Duration
	snapCall, snapPaused, restore []time.Duration
	f1Paused, f1Ready             []time.Duration
	f4Call, f4Paused, f4Ready     []time.Duration
	f4All                         []time.Duration
	// Per clone of a fork of 4, all 4 running: the clone's processes'
	// smaps_rollup sums, kB.
	rss, pss, private []int64
	procs             []int
}

// measure runs the steps n times on one source sandbox that holds a
// random value in a shell's memory.
func measure(t *testing.T, rt runtime.Runtime, tmpl runtime.Spec, n int) row {
	ctx := t.Context()
	var r row
	// Boot (create) to agent ready.
	for range n {
		spec := runtimetest.Prepare(t, rt, tmpl)
		t0 := time.Now()
		if _, err := rt.Create(ctx, spec); err != nil {
			t.Fatalf("create: %v", err)
		}
		if err := rt.Start(ctx, spec.ID); err != nil {
			t.Fatalf("start: %v", err)
		}
		if err := runtimetest.WaitAgent(ctx, rt, spec.ID, readyTimeout); err != nil {
			t.Fatal(err)
		}
		r.boot = append(r.boot, time.Since(t0))
		mustDelete(t, rt, spec.ID)
	}
	snap, hasSnap := rt.(runtime.Snapshotter)
	fk, hasFork := rt.(runtime.Forker)
	r.snapshot, r.fork = hasSnap, hasFork
	if !hasSnap && !hasFork {
		return r
	}
	src := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(ctx, src); err != nil {
		t.Fatalf("create source: %v", err)
	}
	if err := rt.Start(ctx, src.ID); err != nil {
		t.Fatalf("start source: %v", err)
	}
	if err := runtimetest.WaitAgent(ctx, rt, src.ID, readyTimeout); err != nil {
		t.Fatal(err)
	}
	// The value lives in the shell's memory; the loop writes it out.
	if res, err := runtimetest.Run(ctx, rt, src.ID, "", "/bin/sh", "-c",
		`(v=$(head -c8 /dev/urandom | od -An -tx1 | tr -d ' \n'); while :; do echo "$v" > /v.tmp && mv /v.tmp /v; sleep 0.2; done) >/dev/null 2>&1 </dev/null &`); err != nil || res.ExitCode != 0 {
		t.Fatalf("start the holder: %v %+v", err, res)
	}
	value := waitValue(t, rt, src.ID, "", 10*time.Second)
	if value == "" {
		t.Fatal("the holder wrote no /v in 10 s")
	}
	for i := range n {
		if hasSnap {
			dir := t.TempDir()
			t0 := time.Now()
			info, err := snap.Snapshot(ctx, src.ID, dir)
			if err != nil {
				t.Fatalf("snapshot: %v", err)
			}
			r.snapCall = append(r.snapCall, time.Since(t0))
			r.snapPaused = append(r.snapPaused, info.SourceFrozen)
			spec := runtimetest.Prepare(t, rt, tmpl)
			t0 = time.Now()
			if _, err := snap.Restore(ctx, spec, dir); err != nil {
				t.Fatalf("restore: %v", err)
			}
			if err := rt.Start(ctx, spec.ID); err != nil {
				t.Fatalf("start restored: %v", err)
			}
			if err := runtimetest.WaitAgent(ctx, rt, spec.ID, readyTimeout); err != nil {
				t.Fatal(err)
			}
			r.restore = append(r.restore, time.Since(t0))
			mustDelete(t, rt, spec.ID)
		}
		if !hasFork {
			continue
		}
		for _, count := range []int{1, 4} {
			specs := make([]runtime.Spec, count)
			for k := range specs {
				specs[k] = runtimetest.Prepare(t, rt, tmpl)
			}
			t0 := time.Now()
			res, err := fk.Fork(ctx, src.ID, specs)
			if err != nil {
				t.Fatalf("fork %d: %v", count, err)
			}
			call := time.Since(t0)
			ready := startAll(t, rt, specs)
			all := time.Since(t0) - call
			if count == 1 {
				r.f1Paused, r.f1Ready = append(r.f1Paused, res[0].SourceFrozen), append(r.f1Ready, ready...)
			} else {
				r.f4Call, r.f4Paused, r.f4Ready, r.f4All = append(r.f4Call, call), append(r.f4Paused, res[0].SourceFrozen), append(r.f4Ready, ready...), append(r.f4All, all)
				if i == 0 {
					r.memoryKept = memoryKept(t, rt, specs[0].ID, value)
				}
				for _, s := range specs {
					st, err := rt.Status(ctx, s.ID)
					if err != nil {
						t.Fatalf("status of fork %s: %v", s.ID, err)
					}
					m, procs := cloneMemory(st.Pid)
					r.rss, r.pss, r.private = append(r.rss, m["Rss"]), append(r.pss, m["Pss"]), append(r.private, m["Private_Clean"]+m["Private_Dirty"])
					r.procs = append(r.procs, procs)
				}
			}
			for _, s := range specs {
				mustDelete(t, rt, s.ID)
			}
		}
	}
	mustDelete(t, rt, src.ID)
	return r
}

// startAll starts the forks at once (as the node does) and returns each
// one's Start to agent ready.
func startAll(t *testing.T, rt runtime.Runtime, specs []runtime.Spec) []time.Duration {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		ready []time.Duration
		errs  []error
	)
	for _, s := range specs {
		wg.Go(func() {
			t0 := time.Now()
			err := rt.Start(t.Context(), s.ID)
			if err == nil {
				err = runtimetest.WaitAgent(t.Context(), rt, s.ID, readyTimeout)
			}
			mu.Lock()
			defer mu.Unlock()
			ready = append(ready, time.Since(t0))
			if err != nil {
				errs = append(errs, fmt.Errorf("fork %s: %w", s.ID, err))
			}
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatal(errs[0])
	}
	return ready
}

// memoryKept says whether fork id runs the source's holder: /v is
// overwritten with junk, and the holder (if it is there) writes the value
// from its memory back within a few of its 0.2 s ticks.
func memoryKept(t *testing.T, rt runtime.Runtime, id, value string) string {
	if err := runtimetest.WriteFile(t.Context(), rt, id, "/v", []byte("junk\n")); err != nil {
		t.Fatal(err)
	}
	if waitValue(t, rt, id, value, 5*time.Second) == value {
		return "yes"
	}
	return "no"
}

// waitValue polls /v in sandbox id until it is want (any value when want
// is "") or timeout passes, and returns the last value read.
func waitValue(t *testing.T, rt runtime.Runtime, id, want string, timeout time.Duration) string {
	deadline := time.Now().Add(timeout)
	last := ""
	for time.Now().Before(deadline) {
		b, err := runtimetest.ReadFile(t.Context(), rt, id, "/v")
		if v := strings.TrimSpace(string(b)); err == nil && v != "" && v != "junk" {
			last = v
			if want == "" || v == want {
				return v
			}
		}
		time.Sleep(50 * time.Millisecond) // polling a file the guest writes
	}
	return last
}

func mustDelete(t *testing.T, rt runtime.Runtime, id string) {
	if err := rt.Delete(context.WithoutCancel(t.Context()), id); err != nil {
		t.Fatalf("delete %s: %v", id, err)
	}
}

// cloneMemory sums /proc/<pid>/smaps_rollup (kB) over a sandbox's
// processes: those in the cgroup of its init or VMM (pid), or pid and its
// descendants when that cgroup is not the sandbox's own.
func cloneMemory(pid int) (map[string]int64, int) {
	pids := cgroupProcs(pid)
	if len(pids) == 0 {
		pids = tree(pid)
	}
	sum := map[string]int64{}
	for _, p := range pids {
		for k, v := range smapsKB(p) {
			sum[k] += v
		}
	}
	return sum, len(pids)
}

// cgroupProcs lists the processes of pid's memory cgroup (v1) or its
// cgroup (v2); nil when that is the root or this process's own cgroup.
func cgroupProcs(pid int) []int {
	path := func(p string) string {
		b, err := os.ReadFile("/proc/" + p + "/cgroup")
		if err != nil {
			return ""
		}
		v2 := ""
		for line := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
			f := strings.SplitN(line, ":", 3)
			if len(f) != 3 {
				continue
			}
			if slices.Contains(strings.Split(f[1], ","), "memory") {
				return "memory" + f[2]
			}
			if f[0] == "0" && f[1] == "" {
				v2 = f[2]
			}
		}
		return v2
	}
	mine, theirs := path("self"), path(strconv.Itoa(pid))
	if theirs == "" || theirs == mine || theirs == "memory/" || theirs == "/" {
		return nil
	}
	b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", theirs, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var out []int
	for f := range strings.FieldsSeq(string(b)) {
		if p, err := strconv.Atoi(f); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// tree is pid and its descendants.
func tree(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	children := map[int][]int{}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		if i := bytes.LastIndexByte(b, ')'); i > 0 {
			if f := strings.Fields(string(b[i+1:])); len(f) > 1 {
				if pp, err := strconv.Atoi(f[1]); err == nil {
					children[pp] = append(children[pp], p)
				}
			}
		}
	}
	out := []int{pid}
	for i := 0; i < len(out); i++ {
		out = append(out, children[out[i]]...)
	}
	return out
}

// smapsKB reads /proc/<pid>/smaps_rollup's fields in kB.
func smapsKB(pid int) map[string]int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		return nil
	}
	out := map[string]int64{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 3 && f[2] == "kB" {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			out[strings.TrimSuffix(f[0], ":")] = v
		}
	}
	return out
}

func median[T int | int64 | time.Duration](vs []T) T {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	return s[len(s)/2]
}

func ms(ds []time.Duration) string {
	if len(ds) == 0 {
		return "—"
	}
	return msOf(median(ds))
}

// msOf is d in milliseconds: one decimal under 10 ms, whole above.
func msOf(d time.Duration) string {
	if d < 10*time.Millisecond {
		return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 1, 64)
	}
	return strconv.FormatInt(d.Milliseconds(), 10)
}

func mib(kb []int64) string {
	if len(kb) == 0 {
		return "—"
	}
	return fmt.Sprintf("%.1f", float64(median(kb))/1024)
}

// table is the results as one markdown table: medians of n iterations
// (per-clone columns: of n or 4n clones).
func table(rows []row, n int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\n| backend | boot to agent ready (ms) | snapshot: call / source paused (ms) | restore to agent ready (ms) | fork 1: source paused / clone ready (ms) | fork 4: call / source paused (ms) | fork 4: per-clone ready / all ready (ms) | per clone of 4: Pss / Private / shared (MiB) | processes per clone | fork keeps memory |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		if r.skipped != "" {
			fmt.Fprintf(&b, "| %s | skipped: %s | | | | | | | | |\n", r.name, strings.ReplaceAll(r.skipped, "|", "/"))
			continue
		}
		snap, restore := "— (no Snapshotter)", "—"
		if r.snapshot {
			snap, restore = ms(r.snapCall)+" / "+ms(r.snapPaused), ms(r.restore)
		}
		f1, f4, f4r, mem, procs := "— (no Forker)", "—", "—", "—", "—"
		if r.fork {
			f1 = ms(r.f1Paused) + " / " + ms(r.f1Ready)
			f4 = ms(r.f4Call) + " / " + ms(r.f4Paused)
			f4r = ms(r.f4Ready) + " / " + ms(r.f4All)
			shared := make([]int64, len(r.rss))
			for i := range r.rss {
				shared[i] = r.rss[i] - r.private[i]
			}
			mem = mib(r.pss) + " / " + mib(r.private) + " / " + mib(shared)
			procs = strconv.Itoa(median(r.procs))
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.name, ms(r.boot), snap, restore, f1, f4, f4r, mem, procs, r.memoryKept)
	}
	fmt.Fprintf(&b, "\nmedians of %d iterations (per-clone columns: of %d or %d clones); shared = Rss - Private\n", n, n, 4*n)
	return b.String()
}
