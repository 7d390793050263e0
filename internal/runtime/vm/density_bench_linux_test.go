package vm

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestVMDensity is bench/vm-density.sh's measurement (issue 13 part 7),
// run only with OPENDSEC_BENCH_DENSITY=1: N idle VMs of MEM MiB (1 vCPU,
// one image) per configuration, side by side in one run, and the host
// memory they use once idle. Configurations: baseline (microvm, no
// balloon, layers on virtio-blk), + balloon free page reporting, the same
// on q35 (the machine virtio-pmem needs), + layers on virtio-pmem with
// DAX, and + zram (the pmem VMs, then their cgroups' memory limits
// lowered once to push cold guest pages into the node's zram swap, and put
// back). Each VM
// boots, its agent answers, and it runs one Python process that imports
// json, re and asyncio (the image's pages in the guest's cache) and fills
// 128 MiB before it ends (memory a task used and freed), then all settle.
//
// Env: OPENDSEC_DENSITY_N (16), _MEM (512), _BATCH (VMs booted at once, 4),
// _SETTLE (seconds after the last VM is ready, 20), _IMAGE (a rootfs dir,
// default /var/cache/opendsec/rootfs/py-3.11), _ZRAM (1: the zram row; the
// node must have zram swap), _OUT (markdown table file).
func TestVMDensity(t *testing.T) {
	if os.Getenv("OPENDSEC_BENCH_DENSITY") != "1" {
		t.Skip("OPENDSEC_BENCH_DENSITY=1 runs the density measurement (bench/vm-density.sh)")
	}
	rootOnly(t)
	n, mem, batch := envInt("OPENDSEC_DENSITY_N", 16), int64(envInt("OPENDSEC_DENSITY_MEM", 512)), envInt("OPENDSEC_DENSITY_BATCH", 4)
	settle := time.Duration(envInt("OPENDSEC_DENSITY_SETTLE", 20)) * time.Second
	image := cmp.Or(os.Getenv("OPENDSEC_DENSITY_IMAGE"), "/var/cache/opendsec/rootfs/py-3.11")
	dir, why := guestAssets()
	if dir == "" {
		skipOrFail(t, why)
	}
	layer, err := erofsLayer(image, filepath.Join(t.TempDir(), "image.erofs"), "sha256:density")
	if err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(layer.Path)
	t.Logf("image %s: EROFS layer of %d MiB", image, fi.Size()>>20)
	off, on := false, true
	var rows []densityRow
	for _, c := range []struct {
		name, machine, layers string
		fpr                   *bool
		zram                  bool
	}{
		{"baseline: microvm, virtio-blk, no balloon", "microvm", LayerBlk, &off, false},
		{"+ balloon free page reporting (microvm)", "microvm", LayerBlk, &on, false},
		{"balloon, q35, virtio-blk (pmem's machine)", "q35", LayerBlk, &on, false},
		{"+ virtio-pmem layers with DAX (q35, balloon)", "q35", LayerPmem, &on, os.Getenv("OPENDSEC_DENSITY_ZRAM") == "1"},
	} {
		rt, err := New(context.Background(), Config{AssetsDir: dir, Accel: "tcg", NodeID: "density", Machine: c.machine, LayerDevice: c.layers,
			FreePageReporting: c.fpr, BootTimeoutSec: 600, NodeStateDir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		r := rt.(*Runtime)
		row, ids := densityRun(t, r, c.name, n, mem, batch, settle, layer)
		rows = append(rows, row)
		if c.zram {
			rows = append(rows, densityZram(t, r, ids, row))
		}
		for _, id := range ids {
			if err := r.Delete(context.Background(), id); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "| configuration | VMs | start to ready p50 / max | QEMU Rss sum | QEMU Pss sum | guest RAM files (allocated) | zram | **host memory (Pss + zram)** | per VM | vs baseline | MemAvailable drop |\n")
	fmt.Fprintf(&b, "|---|---|---|---|---|---|---|---|---|---|---|\n")
	base := rows[0].pss + rows[0].zramUsed
	for _, r := range rows {
		host := r.pss + r.zramUsed
		fmt.Fprintf(&b, "| %s | %d | %s / %s | %d MiB | %d MiB | %d MiB | %s | **%d MiB** | %d MiB | %.0f %% | %d MiB |\n",
			r.name, r.n, r.bootP50.Round(100*time.Millisecond), r.bootMax.Round(100*time.Millisecond), r.rss>>20, r.pss>>20, r.files>>20,
			r.zram, host>>20, host/int64(r.n)>>20, 100*float64(host)/float64(base), r.availDrop>>20)
	}
	t.Log("\n" + b.String())
	if out := os.Getenv("OPENDSEC_DENSITY_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

type densityRow struct {
	name             string
	n                int
	bootP50, bootMax time.Duration
	rss, pss, files  int64
	availDrop        int64
	zram             string
	zramUsed         int64
	availBefore      int64
}

func densityRun(t *testing.T, r *Runtime, name string, n int, mem int64, batch int, settle time.Duration, layer runtime.Layer) (densityRow, []string) {
	t.Helper()
	ctx := context.Background()
	row := densityRow{name: name, n: n, zram: "–", availBefore: memAvailable(t)}
	var ids []string
	var boots []time.Duration
	for i := 0; i < n; i += batch {
		var wg sync.WaitGroup
		var mu sync.Mutex
		var errs []error
		for j := i; j < min(i+batch, n); j++ {
			id := fmt.Sprintf("density-%d", j)
			ids = append(ids, id)
			spec := runtime.Spec{ID: id, StateDir: t.TempDir(), Rootfs: runtime.Rootfs{Image: "density", Layers: []runtime.Layer{layer}},
				Resources: runtime.Resources{CPU: 1, MemoryMB: mem, DiskMB: 256}}
			if _, err := r.Create(ctx, spec); err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				start := time.Now()
				err := r.Start(ctx, id)
				d := time.Since(start)
				if err == nil {
					// A sandbox that ran something once and went idle:
					// the image's Python in the guest's page cache, and
					// 128 MiB a process used and gave back at its end.
					_, err = runGuest(r, id, "python3 -c 'import json, re, asyncio; b = bytearray(128 << 20)' && echo ok")
				}
				mu.Lock()
				defer mu.Unlock()
				boots = append(boots, d)
				if err != nil {
					errs = append(errs, fmt.Errorf("%s: %w", id, err))
				}
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			for _, id := range ids {
				_ = r.Delete(ctx, id)
			}
			t.Fatalf("%s: %v", name, err)
		}
		t.Logf("%s: %d of %d VMs ready", name, len(ids), n)
	}
	slices.Sort(boots)
	row.bootP50, row.bootMax = boots[len(boots)/2], boots[len(boots)-1]
	settleAndMeasure(t, r, ids, settle, &row)
	return row, ids
}

// settleAndMeasure waits settle, then until the guests' RAM files stop
// shrinking (free page reporting done; at most 60 s more), and measures.
func settleAndMeasure(t *testing.T, r *Runtime, ids []string, settle time.Duration, row *densityRow) {
	t.Helper()
	time.Sleep(settle) // the idle period being measured
	prev := ramFiles(t, r, ids)
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); {
		time.Sleep(5 * time.Second) // sampling the files' size
		cur := ramFiles(t, r, ids)
		if prev-cur < 4<<20 {
			break
		}
		prev = cur
	}
	row.files = ramFiles(t, r, ids)
	row.rss, row.pss = 0, 0
	for _, id := range ids {
		sb, err := r.get(id)
		if err != nil {
			t.Fatal(err)
		}
		m := smapsRollup(t, sb.st.Pid)
		row.rss += m["Rss"]
		row.pss += m["Pss"]
	}
	row.availDrop = row.availBefore - memAvailable(t)
}

// densityZram lowers each VM cgroup's memory limit once (to half its
// usage, at least 96 MiB) so the kernel pushes cold guest pages into the
// node's zram swap, puts the limits back, and measures again.
func densityZram(t *testing.T, r *Runtime, ids []string, prev densityRow) densityRow {
	t.Helper()
	dev := zramSwap(t)
	if dev == "" {
		t.Fatal("OPENDSEC_DENSITY_ZRAM=1 but the node has no zram swap (deploy/zram-swap.sh up)")
	}
	row := densityRow{name: "+ zram swap (cold pages pushed once)", n: prev.n, bootP50: prev.bootP50, bootMax: prev.bootMax, availBefore: prev.availBefore}
	for _, id := range ids {
		sb, _ := r.get(id)
		lim := filepath.Join(cgroupRoot, "memory", sb.st.Cgroup, "memory.limit_in_bytes")
		usage := filepath.Join(cgroupRoot, "memory", sb.st.Cgroup, "memory.usage_in_bytes")
		if unified() {
			lim, usage = filepath.Join(cgroupRoot, sb.st.Cgroup, "memory.max"), filepath.Join(cgroupRoot, sb.st.Cgroup, "memory.current")
		}
		orig, err := os.ReadFile(lim)
		if err != nil {
			t.Fatal(err)
		}
		u, _ := readInt(usage)
		target := max(u/2, 96<<20)
		_ = os.WriteFile(lim, []byte(strconv.FormatInt(target, 10)), 0o644) // EBUSY: it got as low as it could
		if err := os.WriteFile(lim, orig, 0o644); err != nil {
			t.Fatalf("put back %s: %v", lim, err)
		}
	}
	settleAndMeasure(t, r, ids, 5*time.Second, &row)
	b, err := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/mm_stat")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	orig, _ := strconv.ParseInt(f[0], 10, 64)
	used, _ := strconv.ParseInt(f[2], 10, 64)
	row.zram = fmt.Sprintf("%d MiB of pages in %d MiB", orig>>20, used>>20)
	row.zramUsed = used
	return row
}

// zramSwap is the first active zram swap device ("" if none).
func zramSwap(t *testing.T) string {
	b, err := os.ReadFile("/proc/swaps")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 0 && strings.HasPrefix(f[0], "/dev/zram") {
			return f[0]
		}
	}
	return ""
}

func ramFiles(t *testing.T, r *Runtime, ids []string) int64 {
	var sum int64
	for _, id := range ids {
		sb, err := r.get(id)
		if err != nil {
			t.Fatal(err)
		}
		sum += allocated(t, sb.st.MemPath)
	}
	return sum
}

// smapsRollup is /proc/pid/smaps_rollup in bytes.
func smapsRollup(t *testing.T, pid int) map[string]int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]int64{}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 3 && f[2] == "kB" {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			m[strings.TrimSuffix(f[0], ":")] = v << 10
		}
	}
	return m
}

func memAvailable(t *testing.T) int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemAvailable:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	t.Fatal("no MemAvailable in /proc/meminfo")
	return 0
}

func envInt(k string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(k)); err == nil && v > 0 {
		return v
	}
	return def
}

// runGuest runs a shell script in the guest and returns its stdout.
func runGuest(r *Runtime, id, script string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	res, err := runtimetest.Run(ctx, r, id, "", "/bin/sh", "-c", script)
	if err != nil {
		return "", err
	}
	if res.ExitCode != 0 {
		return "", fmt.Errorf("%q: exit %d: %s", script, res.ExitCode, res.Stderr)
	}
	return res.Stdout, nil
}
