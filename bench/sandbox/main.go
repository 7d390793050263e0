// Command sandbox benchmarks OpenDsec's container sandboxes against plain
// runc on the same machine, in the same run: create latency through the
// node's warm pool and cold (vs `runc run`), time to the first command (vs
// `runc run` + `runc exec`), exec round trip of `true` (vs `runc exec`),
// host-side memory of an idle sandbox, and concurrent creates. It talks to a running system through the
// public API (sdk/go), prints a markdown report and writes it to
// bench/results/<date>-core.md. It runs as root and removes everything it
// made, even on error or interrupt. See bench/README.md.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/protobuf/proto"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

const opendsecv1StateRunning = opendsecv1.SandboxState_SANDBOX_STATE_RUNNING

type config struct {
	endpoint, tokenFile, image, rootfs string
	runc, stateRoot, cgParent          string
	creates, execs, idle, concurrent   int
	pauses                             int
	warmup, breakdown, firstCommand    int
	idleWait, settle                   time.Duration
	out, command, revision             string
	lim                                limits
}

func main() {
	var c config
	flag.StringVar(&c.endpoint, "endpoint", "", "apiserver address (default $OPENDSEC_ENDPOINT)")
	flag.StringVar(&c.tokenFile, "token-file", "", "file holding the API token (default $OPENDSEC_TOKEN)")
	flag.StringVar(&c.image, "image", "root/busybox", "image of our sandboxes")
	flag.StringVar(&c.rootfs, "rootfs", "/var/cache/opendsec/rootfs/busybox", "the same rootfs as a directory, lowerdir of the runc baseline")
	flag.StringVar(&c.runc, "runc", "runc", "runc binary")
	flag.StringVar(&c.stateRoot, "state-root", "/run/opendsec/n001/runc", "the node's runc --root (to find a sandbox's agent pid; /run/opendsec/<node id>/runc by default)")
	flag.StringVar(&c.cgParent, "cgroup-parent", "/opendsec-n001", "the node's cgroup parent of sandboxes (/opendsec-<node id> by default)")
	flag.IntVar(&c.creates, "creates", 50, "sequential creates of each kind (ours through the warm pool, ours cold, runc run)")
	flag.IntVar(&c.firstCommand, "first-command", 30, "time-to-first-command iterations of each kind (ours warm, ours cold, runc run + runc exec; 0: skip)")
	flag.DurationVar(&c.settle, "settle", 300*time.Millisecond, "pause between one timed operation and the next, so the pool refill and the last teardown are done")
	flag.IntVar(&c.execs, "execs", 200, "exec round trips of each kind")
	flag.IntVar(&c.pauses, "pauses", 100, "pause+resume rounds of each kind (ours through the API, a raw freezer write of a runc container; 0: skip)")
	flag.IntVar(&c.idle, "idle", 10, "idle sandboxes whose memory is measured")
	flag.DurationVar(&c.idleWait, "idle-wait", 5*time.Second, "how long sandboxes stay idle before their memory is read")
	flag.IntVar(&c.concurrent, "concurrent", 20, "concurrent creates")
	flag.IntVar(&c.breakdown, "breakdown", 20, "iterations of the create time breakdown (0: skip it)")
	flag.IntVar(&c.warmup, "warmup", 3, "untimed iterations of each kind before each latency phase")
	flag.StringVar(&c.out, "out", "", "report file (default bench/results/<YYYY-MM-DD>-core.md)")
	flag.StringVar(&c.command, "command", "", "the command line to record in the report (default: this program's arguments)")
	flag.StringVar(&c.revision, "revision", "", "source revision to record in the report")
	flag.Int64Var(&c.lim.memoryMB, "memory-mb", 512, "memory limit of every sandbox and baseline container (MiB)")
	flag.Float64Var(&c.lim.cpu, "cpu", 1, "cpu limit of every sandbox and baseline container (cores)")
	flag.Int64Var(&c.lim.pids, "pids", 1024, "pids limit of every sandbox and baseline container")
	flag.Parse()
	if c.command == "" {
		c.command = strings.Join(os.Args, " ")
	}
	if c.out == "" {
		c.out = filepath.Join("bench", "results", time.Now().Format("2006-01-02")+"-core.md")
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, c); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func validate(c config) error {
	switch {
	case c.creates < 1:
		return fmt.Errorf("flag -creates is %d; give at least 1 (the issue asks for >= 50)", c.creates)
	case c.execs < 1:
		return fmt.Errorf("flag -execs is %d; give at least 1 (the issue asks for >= 200)", c.execs)
	case c.idle < 1:
		return fmt.Errorf("flag -idle is %d; give at least 1", c.idle)
	case c.concurrent < 1:
		return fmt.Errorf("flag -concurrent is %d; give at least 1", c.concurrent)
	case c.breakdown < 0:
		return fmt.Errorf("flag -breakdown is %d; give 0 (skip) or more", c.breakdown)
	case c.firstCommand < 0:
		return fmt.Errorf("flag -first-command is %d; give 0 (skip) or more", c.firstCommand)
	case c.settle < 0:
		return fmt.Errorf("flag -settle is %s; give 0 or more (e.g. 300ms)", c.settle)
	case c.warmup < 0:
		return fmt.Errorf("flag -warmup is %d; give 0 or more", c.warmup)
	case c.lim.memoryMB < 16 || c.lim.cpu <= 0 || c.lim.pids < 1:
		return fmt.Errorf("flags -memory-mb, -cpu, -pids must be >= 16, > 0, >= 1")
	case os.Geteuid() != 0:
		return errors.New("must run as root (runc, mounts, cgroups)")
	}
	return nil
}

// bench holds what a run made, so cleanup can remove it.
type bench struct {
	cfg    config
	client *opendsec.Client
	base   *baseline
	cg     cgroupInfo
	label  map[string]string // on every sandbox we create

	mu   sync.Mutex
	ours map[string]bool // sandboxes created and not yet stopped
	log  io.Writer
}

func run(ctx context.Context, c config) (retErr error) {
	if err := validate(c); err != nil {
		return err
	}
	token := os.Getenv(opendsec.EnvToken)
	if c.tokenFile != "" {
		b, err := os.ReadFile(c.tokenFile)
		if err != nil {
			return fmt.Errorf("read token (flag -token-file): %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	client, err := opendsec.New(c.endpoint, opendsec.WithToken(token))
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	defer client.Close()
	cg, err := detectCgroups()
	if err != nil {
		return err
	}
	b := &bench{
		cfg: c, client: client, cg: cg, ours: map[string]bool{}, log: os.Stderr,
		label: map[string]string{"opendsec-bench": fmt.Sprintf("core-%d", os.Getpid())},
	}
	if _, err := client.ListSandboxes(ctx, opendsec.ListFilter{}); err != nil {
		return fmt.Errorf("reach apiserver at %s: %w", client.Endpoint(), err)
	}
	if b.base, err = newBaseline(ctx, c.runc, c.rootfs, cg, c.lim); err != nil {
		return err
	}
	defer func() {
		if err := b.cleanup(context.WithoutCancel(ctx)); err != nil {
			retErr = errors.Join(retErr, fmt.Errorf("cleanup: %w", err))
		}
	}()

	r := &report{cfg: c, started: time.Now()}
	r.machine = machineInfo(ctx, c.runc, cg)
	r.loadStart = loadAvg()
	phases := []struct {
		name string
		fn   func(context.Context, *report) error
	}{
		{"create latency", b.createPhase},
		{"time to first command", b.firstCommandPhase},
		{"create breakdown", b.breakdownPhase},
		{"exec round trip", b.execPhase},
		{"pause and resume", b.pausePhase},
		{"auto-resume", b.autoResumePhase},
		{"idle memory", b.memoryPhase},
		{"concurrent creates", b.concurrentPhase},
	}
	for _, p := range phases {
		b.logf("== %s", p.name)
		if err := p.fn(ctx, r); err != nil {
			return fmt.Errorf("%s: %w", p.name, err)
		}
	}
	r.elapsed = time.Since(r.started)
	r.loadEnd = loadAvg()
	md := r.markdown()
	fmt.Print(md)
	if err := os.MkdirAll(filepath.Dir(c.out), 0o755); err != nil {
		return fmt.Errorf("make results dir: %w", err)
	}
	if err := os.WriteFile(c.out, []byte(md), 0o644); err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	b.logf("report written to %s", c.out)
	return nil
}

func (b *bench) logf(format string, args ...any) {
	fmt.Fprintf(b.log, format+"\n", args...)
}

func (b *bench) spec() *opendsec.SandboxSpec {
	return &opendsec.SandboxSpec{
		Image: b.cfg.image, Backend: "container", Labels: b.label,
		MemoryMb: proto.Int64(b.cfg.lim.memoryMB), Cpu: b.cfg.lim.cpu, PidsLimit: b.cfg.lim.pids,
	}
}

// create makes one of our sandboxes with a default create (the node may
// take it from its warm pool) and returns it with its client-measured
// latency.
func (b *bench) create(ctx context.Context) (*opendsec.Sandbox, time.Duration, error) {
	return b.createWith(ctx, false)
}

// createWith is create; with cold the node makes the sandbox from scratch
// (skip_warm_pool). CreateSandbox returns once the sandbox runs and its
// agent's socket listens.
func (b *bench) createWith(ctx context.Context, cold bool) (*opendsec.Sandbox, time.Duration, error) {
	start := time.Now()
	sb, err := b.client.CreateSandboxWith(ctx, b.spec(), opendsec.CreateOptions{SkipWarmPool: cold})
	d := time.Since(start)
	if err != nil {
		return nil, 0, fmt.Errorf("create sandbox: %w", err)
	}
	if err := b.track(sb); err != nil {
		return sb, 0, err
	}
	return sb, d, nil
}

// track records sb as ours (cleanup stops it) and checks it runs.
func (b *bench) track(sb *opendsec.Sandbox) error {
	b.mu.Lock()
	b.ours[sb.GetId()] = true
	b.mu.Unlock()
	if st := sb.GetState(); st != opendsecv1StateRunning {
		return fmt.Errorf("sandbox %s is %s after create, want running", sb.GetId(), st)
	}
	return nil
}

func (b *bench) stop(ctx context.Context, id string) error {
	if err := b.client.StopSandbox(ctx, id); err != nil && !opendsec.IsNotFound(err) {
		return fmt.Errorf("stop sandbox %s: %w", id, err)
	}
	b.mu.Lock()
	delete(b.ours, id)
	b.mu.Unlock()
	return nil
}

// cleanup stops every sandbox we made (also any carrying our label, in case
// a create answer was lost) and removes the baseline's containers.
func (b *bench) cleanup(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var errs []error
	if list, err := b.client.ListSandboxes(ctx, opendsec.ListFilter{Labels: b.label}); err == nil {
		b.mu.Lock()
		for _, sb := range list {
			b.ours[sb.GetId()] = true
		}
		b.mu.Unlock()
	} else {
		errs = append(errs, fmt.Errorf("list our sandboxes: %w", err))
	}
	b.mu.Lock()
	ids := make([]string, 0, len(b.ours))
	for id := range b.ours {
		ids = append(ids, id)
	}
	b.mu.Unlock()
	for _, id := range ids {
		errs = append(errs, b.stop(ctx, id))
	}
	if b.base != nil {
		errs = append(errs, b.base.close(ctx))
	}
	return errors.Join(errs...)
}

// The kinds of create compared in the create and first-command phases.
type kind int

const (
	kindPool kind = iota // ours, default create: the node may take a warm-pool sandbox
	kindCold             // ours with skip_warm_pool: made from scratch
	kindRunc             // the baseline, `runc run --detach`
	numKinds
)

// roundOrder returns the order of the kinds in round i: rotated every
// round, so each kind follows each other kind equally often.
func roundOrder(i int) [numKinds]kind {
	var o [numKinds]kind
	for j := range o {
		o[j] = kind(((i+j)%int(numKinds) + int(numKinds)) % int(numKinds))
	}
	return o
}

// settle waits the -settle gap. It is benchmark methodology, not
// synchronisation: each timed operation should start on a machine where the
// node's pool refill and the previous teardown are done, as for a caller
// whose creates are not back to back.
func (b *bench) settle(ctx context.Context) error {
	if b.cfg.settle <= 0 {
		return nil
	}
	select {
	case <-time.After(b.cfg.settle):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// createPhase: sequential creates of the three kinds, interleaved (the
// order rotates each round), a settle gap before each timed create. Stops
// and baseline deletes are outside the timed parts.
func (b *bench) createPhase(ctx context.Context, r *report) error {
	for i := -b.cfg.warmup; i < b.cfg.creates; i++ {
		var d [numKinds]time.Duration
		hit := false
		for _, k := range roundOrder(i) {
			if err := b.settle(ctx); err != nil {
				return err
			}
			switch k {
			case kindPool, kindCold:
				sb, t, err := b.createWith(ctx, k == kindCold)
				if err != nil {
					return err
				}
				d[k] = t
				if k == kindPool {
					hit = sb.GetFromWarmPool()
				} else if sb.GetFromWarmPool() {
					return fmt.Errorf("sandbox %s: a create with skip_warm_pool reports from_warm_pool", sb.GetId())
				}
				if err := b.stop(ctx, sb.GetId()); err != nil {
					return err
				}
			case kindRunc:
				c, err := b.base.prepare()
				if err != nil {
					return err
				}
				if d[k], err = b.base.run(ctx, c); err != nil {
					return err
				}
				if err := b.base.remove(ctx, c); err != nil {
					return err
				}
			}
		}
		if i < 0 {
			continue
		}
		r.createPool.add(d[kindPool], hit)
		r.createCold = append(r.createCold, d[kindCold])
		r.createRunc = append(r.createRunc, d[kindRunc])
		if (i+1)%10 == 0 {
			b.logf("  %d/%d rounds: last pool %s ms (hit %t), cold %s ms, runc %s ms; pool hits %d of %d",
				i+1, b.cfg.creates, ms(d[kindPool]), hit, ms(d[kindCold]), ms(d[kindRunc]), len(r.createPool.hits), len(r.createPool.all))
		}
	}
	return nil
}

// execPhase: `true` through the public API (Exec and RunShell) and
// `runc exec`, interleaved, on one long-lived sandbox and container.
func (b *bench) execPhase(ctx context.Context, r *report) error {
	sb, _, err := b.create(ctx)
	if err != nil {
		return err
	}
	id := sb.GetId()
	c, err := b.base.prepare()
	if err != nil {
		return err
	}
	if _, err := b.base.run(ctx, c); err != nil {
		return err
	}
	// A failed exec of ours is counted and reported, not fatal, unless
	// more than a tenth of them fail.
	fail := func(kind string, err error) error {
		r.execErrs = append(r.execErrs, kind+": "+err.Error())
		b.logf("  error: %s: %v", kind, err)
		if len(r.execErrs) > max(2, b.cfg.execs/10) {
			return fmt.Errorf("%d execs failed, the last: %w", len(r.execErrs), err)
		}
		return nil
	}
	for i := -b.cfg.warmup; i < b.cfg.execs; i++ {
		d, err := b.execTrue(ctx, id)
		if err != nil {
			if err := fail("Exec true", err); err != nil {
				return err
			}
		} else if i >= 0 {
			r.execOurs = append(r.execOurs, d)
		}
		rd, err := b.base.exec(ctx, c)
		if err != nil {
			return err
		}
		if i >= 0 {
			r.execRunc = append(r.execRunc, rd)
		}
		sd, err := b.runShellTrue(ctx, id)
		if err != nil {
			if err := fail("RunShell true", err); err != nil {
				return err
			}
		} else if i >= 0 {
			r.shellOurs = append(r.shellOurs, sd)
		}
		if i >= 0 && (i+1)%50 == 0 {
			b.logf("  %d/%d execs: last ours %s ms, runc %s ms, ours sh -c %s ms", i+1, b.cfg.execs, ms(d), ms(rd), ms(sd))
		}
	}
	if err := b.stop(ctx, id); err != nil {
		return err
	}
	return b.base.remove(ctx, c)
}

func (b *bench) execTrue(ctx context.Context, id string) (time.Duration, error) {
	var out bytes.Buffer
	start := time.Now()
	p, err := b.client.Exec(ctx, id, opendsec.ExecOptions{Command: []string{"true"}, Stdout: &out, Stderr: &out})
	if err != nil {
		return 0, fmt.Errorf("exec true: %w", err)
	}
	st, err := p.Wait()
	d := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("exec true: %w", err)
	}
	if st.ExitCode != 0 {
		return 0, fmt.Errorf("exec true: %s: %q", st.Status, out.String())
	}
	return d, nil
}

func (b *bench) runShellTrue(ctx context.Context, id string) (time.Duration, error) {
	start := time.Now()
	res, err := b.client.RunShell(ctx, id, "true")
	d := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("run shell true: %w", err)
	}
	if res.ExitCode != 0 {
		return 0, fmt.Errorf("run shell true: %s: %q", res.Status, res.Stderr)
	}
	return d, nil
}

// memoryPhase: idle sandboxes' cgroup-accounted memory and agent RSS.
func (b *bench) memoryPhase(ctx context.Context, r *report) error {
	before, err := memAvailable()
	if err != nil {
		return err
	}
	var ids []string
	for range b.cfg.idle {
		sb, _, err := b.create(ctx)
		if err != nil {
			return err
		}
		ids = append(ids, sb.GetId())
	}
	// The condition measured is "idle for a while", so this is a wait for
	// time itself, not a synchronisation.
	b.logf("  %d sandboxes idle for %s", len(ids), b.cfg.idleWait)
	select {
	case <-time.After(b.cfg.idleWait):
	case <-ctx.Done():
		return ctx.Err()
	}
	after, err := memAvailable()
	if err != nil {
		return err
	}
	r.hostPerSandbox = (before - after) / int64(len(ids))
	for _, id := range ids {
		s, err := sampleMemory(ctx, b.cfg.runc, b.cfg.stateRoot, b.cfg.cgParent, b.cg, id)
		if err != nil {
			return fmt.Errorf("memory of %s: %w", id, err)
		}
		r.mem = append(r.mem, s)
	}
	// The first exec after the idle spell: it pays the agent server's start
	// where the server had exited.
	for i, id := range ids {
		d, err := b.execTrue(ctx, id)
		if err != nil {
			return fmt.Errorf("exec after idle in %s: %w", id, err)
		}
		r.mem[i].firstExecAfterSample = d
	}
	for _, id := range ids {
		if err := b.stop(ctx, id); err != nil {
			return err
		}
	}
	return nil
}

// concurrentPhase: n default creates at once; all must succeed and be
// running. A burst larger than the node's warm pool takes what the pool
// holds and the rest are cold creates.
func (b *bench) concurrentPhase(ctx context.Context, r *report) error {
	// The burst starts with the pool refilled after the previous phase.
	if err := b.settle(ctx); err != nil {
		return err
	}
	n := b.cfg.concurrent
	lat := make(series, n)
	errs := make([]error, n)
	ids := make([]string, n)
	hits := make([]bool, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-gate
			sb, d, err := b.create(ctx)
			lat[i], errs[i] = d, err
			if sb != nil {
				ids[i] = sb.GetId()
				hits[i] = sb.GetFromWarmPool()
			}
		})
	}
	start := time.Now()
	close(gate)
	wg.Wait()
	r.concWall = time.Since(start)
	r.concN = n
	for i, err := range errs {
		if err != nil {
			r.concErrs = append(r.concErrs, err.Error())
			continue
		}
		sb, err := b.client.GetSandbox(ctx, ids[i])
		if err != nil {
			r.concErrs = append(r.concErrs, fmt.Sprintf("get %s: %v", ids[i], err))
			continue
		}
		if sb.GetState() != opendsecv1StateRunning {
			r.concErrs = append(r.concErrs, fmt.Sprintf("%s is %s, want running", ids[i], sb.GetState()))
			continue
		}
		r.concOurs.add(lat[i], hits[i])
	}
	var stopErrs []error
	for _, id := range ids {
		if id != "" {
			stopErrs = append(stopErrs, b.stop(ctx, id))
		}
	}
	return errors.Join(stopErrs...)
}

type machine struct {
	nproc                         int
	cpuModel, memTotal, kernel    string
	cgroupMode, runcVersion, osID string
	goVersion                     string
}

func machineInfo(ctx context.Context, runc string, cg cgroupInfo) machine {
	m := machine{nproc: goruntime.NumCPU(), kernel: kernelRelease(), cgroupMode: cg.mode, goVersion: goruntime.Version()}
	if kv, err := readKV("/proc/meminfo"); err == nil {
		m.memTotal = fmt.Sprintf("%.1f GiB", float64(kv["MemTotal:"])/(1<<20))
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.cpuModel = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/etc/os-release"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "PRETTY_NAME="); ok {
				m.osID = strings.Trim(v, `"`)
			}
		}
	}
	if out, err := exec.CommandContext(ctx, runc, "--version").Output(); err == nil {
		m.runcVersion = strings.Join(strings.Split(strings.TrimSpace(string(out)), "\n"), "; ")
	}
	return m
}

// loadAvg returns /proc/loadavg's 1, 5 and 15 minute averages: other work on
// the machine during a run shows here.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}
