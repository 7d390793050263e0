package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/testutil"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

type bench struct {
	c   config
	cl  *opendsec.Client
	bin []byte
}

// reclaimRun is one task pause with reclaim on one swap and one pattern.
type reclaimRun struct {
	swap, pattern                  string
	n                              int
	setup                          time.Duration // create, upload, start, wait for every counter
	pauseTook, resumeTook          time.Duration
	availBefore, availPaused       int64 // MemAvailable
	availResumed                   int64 // after every sandbox checked its memory (all swapped back in)
	swapBefore, swapPaused         int64 // SwapTotal - SwapFree
	zramOrigPaused, zramUsedPaused int64 // mm_stat of the run's zram device, while paused
	zramUsedBefore                 int64
	reported                       int64 // bytes_freed summed over the node
	perSandbox                     []int64
	notes                          map[string]int
	failures                       int
	continued, memoryOK            int // sandboxes whose counter went on / whose memory checked out
	startedOver                    int // counter below its value at the pause
}

type report struct {
	c                           config
	when                        time.Time
	host                        string
	pause, resume, freeze, thaw []time.Duration
	runs                        []*reclaimRun
	notes                       []string
}

func run(ctx context.Context, c config) (*report, error) {
	r := &report{c: c, when: time.Now().UTC(), host: hostLine()}
	tok, err := os.ReadFile(c.tokenFile)
	if err != nil {
		return r, err
	}
	cl, err := opendsec.New(c.endpoint, opendsec.WithToken(strings.TrimSpace(string(tok))))
	if err != nil {
		return r, err
	}
	defer cl.Close()
	bin, err := os.ReadFile(c.memhog)
	if err != nil {
		return r, err
	}
	b := &bench{c: c, cl: cl, bin: bin}
	if c.rounds > 0 {
		fmt.Fprintln(os.Stderr, "== latency: pause/resume vs a bare cgroup freezer")
		if err := b.latency(ctx, r); err != nil {
			return r, fmt.Errorf("latency: %w", err)
		}
	}
	if c.sandboxes > 0 {
		// Consecutive runs on one swap kind share its setup.
		var kinds []string
		patterns := map[int][]string{}
		for _, run := range split(c.runs) {
			kind, pattern, ok := strings.Cut(run, "/")
			if !ok || pattern == "" {
				return r, fmt.Errorf("-runs: %q is not SWAP/PATTERN", run)
			}
			if len(kinds) == 0 || kinds[len(kinds)-1] != kind {
				kinds = append(kinds, kind)
			}
			patterns[len(kinds)-1] = append(patterns[len(kinds)-1], pattern)
		}
		for i, kind := range kinds {
			if err := b.onSwap(ctx, r, kind, patterns[i]); err != nil {
				return r, err
			}
		}
	}
	return r, nil
}

// onSwap sets up the swap kind, runs every pattern on it and removes it.
func (b *bench) onSwap(ctx context.Context, r *report, kind string, patterns []string) error {
	// Room for the data and what else each sandbox holds (its agent, the
	// memhog runtime): about 16 MiB.
	size := min(max(int64(b.c.sandboxes)*int64(b.c.mib+16)<<20*5/4, 1<<30), 12<<30)
	var (
		undo func() error
		zram string
	)
	switch kind {
	case "host":
		if testutil.SwapBytes() == 0 {
			r.notes = append(r.notes, "swap \"host\": the host has no swap, so only page cache can be reclaimed in that run")
		}
	case "zram", "file":
		if testutil.SwapBytes() > 0 {
			return fmt.Errorf("swap %q: the host has swap already; run with -swap host", kind)
		}
		var err error
		if kind == "zram" {
			zram, undo, err = testutil.MakeZramSwap(size)
		} else {
			undo, err = swapFile(filepath.Join(b.c.swapFileDir, fmt.Sprintf("odbench-pause-%d.swap", os.Getpid())), size)
		}
		if err != nil {
			return fmt.Errorf("swap %s: %w", kind, err)
		}
		fmt.Fprintf(os.Stderr, "== swap %s: %d MiB %s\n", kind, size>>20, zram)
	default:
		return fmt.Errorf("-swap: %q is not zram, file or host", kind)
	}
	var errs []error
	for _, p := range patterns {
		fmt.Fprintf(os.Stderr, "== reclaim: %d sandboxes x %d MiB (%s) on %s swap\n", b.c.sandboxes, b.c.mib, p, kind)
		rr := &reclaimRun{swap: kind, pattern: p, n: b.c.sandboxes, notes: map[string]int{}}
		r.runs = append(r.runs, rr)
		if err := b.reclaim(ctx, rr, zram); err != nil {
			errs = append(errs, fmt.Errorf("reclaim run %s/%s: %w", kind, p, err))
			break
		}
	}
	if undo != nil {
		if err := undo(); err != nil {
			errs = append(errs, fmt.Errorf("remove the %s swap: %w", kind, err))
		}
	}
	return errors.Join(errs...)
}

// swapFile makes a swap file of size bytes at path and turns it on.
func swapFile(path string, size int64) (func() error, error) {
	if out, err := exec.Command("fallocate", "-l", strconv.FormatInt(size, 10), path).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("fallocate: %v: %s", err, out)
	}
	undo := func() error {
		var errs []error
		if b, _ := os.ReadFile("/proc/swaps"); strings.Contains(string(b), path) {
			if out, err := exec.Command("swapoff", path).CombinedOutput(); err != nil {
				errs = append(errs, fmt.Errorf("swapoff: %v: %s", err, out))
			}
		}
		if err := os.Remove(path); err != nil {
			errs = append(errs, err)
		}
		return errors.Join(errs...)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		return nil, errors.Join(err, undo())
	}
	for _, args := range [][]string{{"mkswap", path}, {"swapon", "-p", "100", path}} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			return nil, errors.Join(fmt.Errorf("%s: %v: %s", args[0], err, out), undo())
		}
	}
	return undo, nil
}

// each runs fn for every index with 16 workers and returns the first error.
func each(n int, fn func(i int) error) error {
	var (
		next atomic.Int64
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	for range 16 {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := fn(i); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		return fmt.Errorf("%d of %d failed, first: %w", len(errs), n, errs[0])
	}
	return nil
}

func (b *bench) count(ctx context.Context, id string) (int, error) {
	res, err := b.cl.RunShell(ctx, id, "cat /count 2>/dev/null || echo 0")
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(res.Stdout))
}

func (b *bench) countAtLeast(ctx context.Context, id string, n int) (int, error) {
	deadline := time.Now().Add(60 * time.Second)
	for {
		c, err := b.count(ctx, id)
		if err == nil && c >= n {
			return c, nil
		}
		if time.Now().After(deadline) {
			return c, fmt.Errorf("counter of %s stayed below %d (last %d, %v)", id, n, c, err)
		}
		time.Sleep(50 * time.Millisecond) // polling a condition with a deadline
	}
}

func (b *bench) reclaim(ctx context.Context, rr *reclaimRun, zram string) error {
	task := fmt.Sprintf("bench-pause-%d-%s-%s", os.Getpid(), rr.swap, rr.pattern)
	ids := make([]string, rr.n)
	defer func() {
		_ = each(rr.n, func(i int) error {
			if ids[i] == "" {
				return nil
			}
			return b.cl.StopSandbox(context.WithoutCancel(ctx), ids[i])
		})
	}()
	t0 := time.Now()
	mem := b.c.memoryMB
	line := fmt.Sprintf("chmod +x /memhog && (/memhog -mib %d -pattern %s -tick 100ms >/dev/null 2>&1 </dev/null &)", b.c.mib, rr.pattern)
	err := each(rr.n, func(i int) error {
		sb, err := b.cl.CreateSandbox(ctx, &opendsecv1.SandboxSpec{Image: b.c.image, TaskId: task, Cpu: 0.1, MemoryMb: &mem})
		if err != nil {
			return fmt.Errorf("create: %w", err)
		}
		ids[i] = sb.GetId()
		if _, err := b.cl.WriteFile(ctx, ids[i], "/memhog", bytes.NewReader(b.bin), int64(len(b.bin))); err != nil {
			return fmt.Errorf("upload memhog: %w", err)
		}
		if res, err := b.cl.RunShell(ctx, ids[i], line); err != nil || res.ExitCode != 0 {
			return fmt.Errorf("start memhog: %v %+v", err, res)
		}
		_, err = b.countAtLeast(ctx, ids[i], 1)
		return err
	})
	rr.setup = time.Since(t0)
	if err != nil {
		return err
	}
	at := make([]int, rr.n)
	if err := each(rr.n, func(i int) error {
		var err error
		at[i], err = b.count(ctx, ids[i])
		return err
	}); err != nil {
		return err
	}
	rr.availBefore, rr.swapBefore = meminfo()
	if zram != "" {
		_, rr.zramUsedBefore, _ = testutil.ZramStats(zram)
	}
	t0 = time.Now()
	out, err := b.cl.PauseTask(ctx, task, opendsec.PauseTaskOptions{Reclaim: true})
	rr.pauseTook = time.Since(t0)
	if err != nil {
		return fmt.Errorf("pause task: %w", err)
	}
	rr.availPaused, rr.swapPaused = meminfo()
	if zram != "" {
		rr.zramOrigPaused, rr.zramUsedPaused, _ = testutil.ZramStats(zram)
	}
	rr.reported, rr.failures = out.BytesFreed, len(out.Failures)
	for _, rc := range out.Reclaimed {
		rr.perSandbox = append(rr.perSandbox, rc.GetBytesFreed())
		if rc.GetNote() != "" {
			rr.notes[rc.GetNote()]++
		}
	}
	t0 = time.Now()
	if _, err := b.cl.ResumeTask(ctx, task, nil); err != nil {
		return fmt.Errorf("resume task: %w", err)
	}
	rr.resumeTook = time.Since(t0)
	var mu sync.Mutex
	err = each(rr.n, func(i int) error {
		c1, err := b.count(ctx, ids[i])
		if err != nil {
			return err
		}
		if c1 < at[i] {
			mu.Lock()
			rr.startedOver++
			mu.Unlock()
			return fmt.Errorf("%s counted %d before the pause, %d after", ids[i], at[i], c1)
		}
		if _, err := b.countAtLeast(ctx, ids[i], c1+1); err != nil {
			return err
		}
		ans, err := b.verify(ctx, ids[i])
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		rr.continued++
		if strings.HasPrefix(ans, "ok ") {
			rr.memoryOK++
			return nil
		}
		return fmt.Errorf("memory of %s after the resume: %q", ids[i], ans)
	})
	rr.availResumed, _ = meminfo()
	return err
}

// verify asks memhog to check its memory (every page is read, so swapped
// back in, at the sandbox's CPU quota) and waits up to 10 min for its
// answer.
func (b *bench) verify(ctx context.Context, id string) (string, error) {
	if _, err := b.cl.RunShell(ctx, id, "rm -f /verify.out; touch /verify"); err != nil {
		return "", err
	}
	deadline := time.Now().Add(10 * time.Minute)
	for {
		res, err := b.cl.RunShell(ctx, id, "cat /verify.out 2>/dev/null")
		if err == nil && res.Stdout != "" {
			return res.Stdout, nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("memhog in %s did not check its memory within 10 min (%v)", id, err)
		}
		time.Sleep(200 * time.Millisecond) // polling a condition with a deadline
	}
}

// meminfo returns MemAvailable and SwapTotal-SwapFree in bytes.
func meminfo() (avail, swapUsed int64) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	var total, free int64
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), ":")
		fs := strings.Fields(v)
		if len(fs) == 0 {
			continue
		}
		n, _ := strconv.ParseInt(fs[0], 10, 64)
		switch k {
		case "MemAvailable":
			avail = n << 10
		case "SwapTotal":
			total = n << 10
		case "SwapFree":
			free = n << 10
		}
	}
	return avail, total - free
}

// latency interleaves PauseSandbox/ResumeSandbox of one sandbox with a
// freeze and thaw of a bare cgroup holding one sleeping process.
func (b *bench) latency(ctx context.Context, r *report) error {
	sb, err := b.cl.CreateSandbox(ctx, &opendsecv1.SandboxSpec{Image: b.c.image})
	if err != nil {
		return err
	}
	id := sb.GetId()
	defer b.cl.StopSandbox(context.WithoutCancel(ctx), id)
	if _, err := b.cl.RunShell(ctx, id, "true"); err != nil { // the agent runs
		return err
	}
	bare, err := newBareCgroup()
	if err != nil {
		return err
	}
	defer bare.remove()
	for i := -5; i < b.c.rounds; i++ {
		t := time.Now()
		if _, err := b.cl.PauseSandbox(ctx, id); err != nil {
			return fmt.Errorf("pause: %w", err)
		}
		dp := time.Since(t)
		t = time.Now()
		if _, err := b.cl.ResumeSandbox(ctx, id, 0); err != nil {
			return fmt.Errorf("resume: %w", err)
		}
		dr := time.Since(t)
		t = time.Now()
		if err := bare.set(true); err != nil {
			return err
		}
		df := time.Since(t)
		t = time.Now()
		if err := bare.set(false); err != nil {
			return err
		}
		dt := time.Since(t)
		if i >= 0 {
			r.pause, r.resume, r.freeze, r.thaw = append(r.pause, dp), append(r.resume, dr), append(r.freeze, df), append(r.thaw, dt)
		}
	}
	return nil
}

// bareCgroup is a freezer cgroup with one `sleep` in it.
type bareCgroup struct {
	dir  string
	v2   bool
	cmd  *exec.Cmd
	done chan struct{}
}

func newBareCgroup() (*bareCgroup, error) {
	mnt, v2, err := freezerMount()
	if err != nil {
		return nil, err
	}
	g := &bareCgroup{dir: filepath.Join(mnt, fmt.Sprintf("odbench-pause-%d", os.Getpid())), v2: v2, done: make(chan struct{})}
	if err := os.Mkdir(g.dir, 0o755); err != nil {
		return nil, err
	}
	g.cmd = exec.Command("sleep", "3600")
	if err := g.cmd.Start(); err != nil {
		_ = os.Remove(g.dir)
		return nil, err
	}
	go func() { _ = g.cmd.Wait(); close(g.done) }()
	if err := os.WriteFile(filepath.Join(g.dir, "cgroup.procs"), []byte(strconv.Itoa(g.cmd.Process.Pid)), 0); err != nil {
		g.remove()
		return nil, fmt.Errorf("move sleep into the bare cgroup: %w", err)
	}
	return g, nil
}

func (g *bareCgroup) set(frozen bool) error {
	file, val, want := filepath.Join(g.dir, "freezer.state"), "THAWED", ""
	if frozen {
		val = "FROZEN"
	}
	if g.v2 {
		file, val = filepath.Join(g.dir, "cgroup.freeze"), "0"
		if frozen {
			val = "1"
		}
	}
	if err := os.WriteFile(file, []byte(val), 0); err != nil {
		return err
	}
	if !frozen {
		return nil
	}
	for {
		if g.v2 {
			b, err := os.ReadFile(filepath.Join(g.dir, "cgroup.events"))
			if err != nil {
				return err
			}
			if strings.Contains(string(b), "frozen 1") {
				return nil
			}
		} else {
			b, err := os.ReadFile(file)
			if err != nil {
				return err
			}
			if want = strings.TrimSpace(string(b)); want == "FROZEN" {
				return nil
			}
		}
	}
}

func (g *bareCgroup) remove() {
	_ = g.set(false)
	_ = g.cmd.Process.Kill()
	<-g.done
	for range 100 {
		if err := os.Remove(g.dir); err == nil || os.IsNotExist(err) {
			return
		}
		time.Sleep(10 * time.Millisecond) // the killed task leaves the cgroup
	}
}

// freezerMount is the v1 freezer hierarchy, or the v2 mount.
func freezerMount() (string, bool, error) {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return "", false, err
	}
	var v2 string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		if f[2] == "cgroup" && slices.Contains(strings.Split(f[3], ","), "freezer") {
			return f[1], false, nil
		}
		if f[2] == "cgroup2" && v2 == "" {
			v2 = f[1]
		}
	}
	if v2 != "" {
		return v2, true, nil
	}
	return "", false, errors.New("no freezer cgroup hierarchy is mounted")
}

func hostLine() string {
	kernel, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	avail, _ := meminfo()
	var total int64
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				f := strings.Fields(v)
				if len(f) > 0 {
					total, _ = strconv.ParseInt(f[0], 10, 64)
				}
			}
		}
	}
	cpus := 0
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		cpus = strings.Count(string(b), "\nprocessor") + 1
	}
	cg := "v1 (hybrid)"
	if _, v2, err := freezerMount(); err == nil && v2 {
		cg = "v2"
	}
	return fmt.Sprintf("Linux %s, %d CPUs, %.1f GiB RAM (%.1f GiB available at the start), cgroup %s, swap before the run: %d MiB",
		strings.TrimSpace(string(kernel)), cpus, float64(total)/(1<<20), float64(avail)/(1<<30), cg, testutil.SwapBytes()>>20)
}
