// Command burst measures one batch create of many small sandboxes against
// its peer, a sequential `runc run` loop of the same root filesystem, in
// the same run; then stopping them all; then (with -mode kill and -mode
// retry, driven by bench/burst.sh) a batch whose system is killed with
// SIGKILL mid-way and retried with the same request ID.
//
// Modes:
//
//	-mode main     runc loop, batch create, stop all; writes -out-json.
//	               The batch skips the warm pool (-skip-warm-pool, default
//	               true): every create is cold; -name labels the run.
//	               With -prewarm, PrewarmSandboxes of -count (wait) runs
//	               before the batch (timed) and the batch takes from the
//	               pool (give -skip-warm-pool=false)
//	-mode kill     batch create with -request-id; SIGKILL -kill-pid after
//	               -kill-after results; writes -out-json
//	-mode retry    the same batch again with -request-id; then lists the
//	               sandboxes: exactly -count, distinct, all running; stops
//	               them; writes -out-json
//	-mode report   merges the JSON files given as arguments into -out (markdown)
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
)

type config struct {
	mode, endpoint, tokenFile, image, rootfs, runc, outJSON, out, requestID, nodeLog, command, name string
	skipWarmPool, prewarm                                                                           bool
	count, runcN, killAfter, killPid, stopConcurrency, restartMS, upPid                             int
	cpu                                                                                             float64
	memoryMB                                                                                        int64
}

// result is what one mode measured (the report's input).
type result struct {
	Mode  string  `json:"mode"`
	Name  string  `json:"name,omitempty"` // main: which system (before, after)
	Count int     `json:"count"`
	CPU   float64 `json:"cpu"`
	MemMB int64   `json:"memory_mb"`

	RuncN       int       `json:"runc_n,omitempty"`
	RuncRunMS   []float64 `json:"runc_run_ms,omitempty"`
	RuncTotalMS float64   `json:"runc_total_ms,omitempty"`
	// QuietMS is how long the bench waited for the kernel to finish
	// cleaning up before the runc loop and before the batch (waitQuiet).
	QuietMS []float64 `json:"quiet_ms,omitempty"`

	BatchTotalMS float64   `json:"batch_total_ms,omitempty"`
	ArrivalMS    []float64 `json:"arrival_ms,omitempty"`    // since the batch's start, per sandbox
	NodeTotalMS  []float64 `json:"node_total_ms,omitempty"` // the node's own create time per sandbox (its log)
	// The node's phases of the cold creates (its log): network, prepare
	// (layer, bundle, network), start (`runc run`).
	NodeNetMS    []float64 `json:"node_net_ms,omitempty"`
	NodeCreateMS []float64 `json:"node_create_ms,omitempty"`
	NodeStartMS  []float64 `json:"node_start_ms,omitempty"`
	FromPool     int       `json:"from_warm_pool"` // creates the node took from its warm pool
	// OCIRuntime is what ran the node's containers ("crun 1.8.1"), from
	// its log's "container OCI runtime" line; empty: no such line (a node
	// from before oci_runtime: runc).
	OCIRuntime string `json:"oci_runtime,omitempty"`
	// Prewarm (main with -prewarm): PrewarmSandboxes of Count with wait,
	// right before the batch.
	Prewarm       bool    `json:"prewarm,omitempty"`
	PrewarmMS     float64 `json:"prewarm_ms,omitempty"`
	PrewarmHeld   int     `json:"prewarm_held,omitempty"`
	PrewarmReady  int     `json:"prewarm_ready,omitempty"`
	PrewarmReason string  `json:"prewarm_reason,omitempty"`
	SkipWarmPool  bool    `json:"skip_warm_pool"`
	Failed        int     `json:"failed"`
	FirstError    string  `json:"first_error,omitempty"`

	// BatchCPU is the CPU time spent during the batch (ms, all creates):
	// of `opendsec up` (-up-pid) and of the whole host.
	BatchCPU *cpuTimes `json:"batch_cpu,omitempty"`
	// Inits and InitThreads: the opendsec-init processes on the host right
	// after the batch (every sandbox's PID 1, idle) and their threads in
	// all: each thread costs every later create (crun's pivot_root walks
	// them all).
	Inits       int `json:"inits,omitempty"`
	InitThreads int `json:"init_threads,omitempty"`
	// BatchInodes is how many more inodes the file system of the node's
	// data dir (the dir of -node-log) had in use after the batch than
	// before (everything on that file system counts, other work too).
	BatchInodes *int64 `json:"batch_inodes,omitempty"`

	StopTotalMS float64   `json:"stop_total_ms,omitempty"`
	StopMS      []float64 `json:"stop_ms,omitempty"`

	Received  int    `json:"received,omitempty"` // kill: results before the kill
	Listed    int    `json:"listed,omitempty"`   // retry: sandboxes listed afterwards
	Distinct  int    `json:"distinct,omitempty"`
	Running   int    `json:"running,omitempty"`
	RequestID string `json:"request_id,omitempty"`
	RestartMS int    `json:"restart_ms,omitempty"` // retry: restart until ready
}

func main() {
	var c config
	flag.StringVar(&c.mode, "mode", "main", "main | kill | retry | report")
	flag.StringVar(&c.endpoint, "endpoint", "", "apiserver host:port")
	flag.StringVar(&c.tokenFile, "token-file", "", "file holding an admin token")
	flag.StringVar(&c.image, "image", "root/busybox", "image of the sandboxes")
	flag.StringVar(&c.rootfs, "rootfs", "/var/cache/opendsec/rootfs/busybox", "the same rootfs as a directory, lowerdir of the runc loop")
	flag.StringVar(&c.runc, "runc", "runc", "runc binary")
	flag.IntVar(&c.count, "count", 1000, "sandboxes in the batch")
	flag.IntVar(&c.runcN, "runc-n", 100, "containers in the sequential runc run loop")
	flag.Float64Var(&c.cpu, "cpu", 0.1, "cpu of every sandbox and runc container")
	flag.Int64Var(&c.memoryMB, "memory-mb", 128, "memory of every sandbox and runc container (MiB)")
	flag.IntVar(&c.stopConcurrency, "stop-concurrency", 8, "StopSandbox calls in flight while stopping all")
	flag.StringVar(&c.requestID, "request-id", "", "batch request ID (kill, retry)")
	flag.IntVar(&c.killAfter, "kill-after", 300, "kill: SIGKILL -kill-pid after this many results")
	flag.IntVar(&c.killPid, "kill-pid", 0, "kill: the pid of `opendsec up`")
	flag.IntVar(&c.restartMS, "restart-ms", 0, "retry: how long the restart took until ready (recorded)")
	flag.StringVar(&c.nodeLog, "node-log", "", "the system's log (debug or info), for the node's per-sandbox create times")
	flag.StringVar(&c.outJSON, "out-json", "", "where a mode writes its result")
	flag.StringVar(&c.out, "out", "", "report: the markdown file")
	flag.StringVar(&c.command, "command", "", "report: the command line to record")
	flag.StringVar(&c.name, "name", "", "main: the name of this run in the report (e.g. before, after)")
	flag.BoolVar(&c.skipWarmPool, "skip-warm-pool", true, "main: make every sandbox of the batch from scratch (cold), never from the node's warm pool")
	flag.IntVar(&c.upPid, "up-pid", 0, "main: the pid of `opendsec up`, whose CPU time during the batch is recorded (0: the host's only)")
	flag.BoolVar(&c.prewarm, "prewarm", false, "main: PrewarmSandboxes of -count (waiting until the pool holds them) before the batch")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	switch c.mode {
	case "main":
		err = runMain(ctx, c)
	case "kill":
		err = runKill(ctx, c)
	case "retry":
		err = runRetry(ctx, c)
	case "report":
		err = writeReport(c, flag.Args())
	default:
		err = fmt.Errorf("-mode %q: give main, kill, retry or report", c.mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "burst:", err)
		os.Exit(1)
	}
}

type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, r connect.AnyRequest) (connect.AnyResponse, error) {
		r.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, r)
	}
}

func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, s connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, s)
		conn.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return conn
	}
}

func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

func client(c config) (opendsecv1connect.SandboxServiceClient, error) {
	tok, err := os.ReadFile(c.tokenFile)
	if err != nil {
		return nil, fmt.Errorf("read token (flag -token-file): %w", err)
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	return opendsecv1connect.NewSandboxServiceClient(hc, "http://"+c.endpoint,
		connect.WithInterceptors(bearer(strings.TrimSpace(string(tok))))), nil
}

func (c config) spec(label string) *v1.SandboxSpec {
	mem := c.memoryMB
	return &v1.SandboxSpec{Image: c.image, Cpu: c.cpu, MemoryMb: &mem, TimeoutSeconds: 3600,
		Labels: map[string]string{"opendsec-bench": label}}
}

// batch runs one BatchCreateSandboxes and records each result's arrival;
// onResult (may be nil) sees the running count and may end the batch.
func batch(ctx context.Context, cl opendsecv1connect.SandboxServiceClient, c config, label, rid string, onResult func(n int) bool, r *result) ([]string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	st, err := cl.BatchCreateSandboxes(ctx, connect.NewRequest(&v1.BatchCreateSandboxesRequest{
		Spec: c.spec(label), Count: int32(c.count), RequestId: rid, //nolint:gosec // flag-bounded
		SkipWarmPool: c.skipWarmPool && c.mode == "main",
	}))
	if err != nil {
		return nil, fmt.Errorf("batch create: %w", err)
	}
	defer st.Close()
	var ids []string
	n := 0
	for st.Receive() {
		m := st.Msg()
		n++
		if m.GetErrorCode() != "" {
			r.Failed++
			if r.FirstError == "" {
				r.FirstError = m.GetErrorCode() + ": " + m.GetErrorMessage()
			}
		} else {
			ids = append(ids, m.GetSandbox().GetId())
			r.ArrivalMS = append(r.ArrivalMS, ms(time.Since(start)))
		}
		if onResult != nil && !onResult(n) {
			r.BatchTotalMS = ms(time.Since(start))
			return ids, nil
		}
	}
	r.BatchTotalMS = ms(time.Since(start))
	if err := st.Err(); err != nil {
		return ids, fmt.Errorf("batch stream after %d results: %w", n, err)
	}
	return ids, nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// stopAll stops ids with stopConcurrency calls in flight.
func stopAll(ctx context.Context, cl opendsecv1connect.SandboxServiceClient, c config, ids []string, r *result) error {
	var (
		next atomic.Int64
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	start := time.Now()
	for range c.stopConcurrency {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= len(ids) {
					return
				}
				t := time.Now()
				_, err := cl.StopSandbox(context.WithoutCancel(ctx), connect.NewRequest(&v1.StopSandboxRequest{Id: ids[i]}))
				d := ms(time.Since(t))
				mu.Lock()
				if err != nil {
					errs = append(errs, fmt.Errorf("stop %s: %w", ids[i], err))
				} else {
					r.StopMS = append(r.StopMS, d)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	r.StopTotalMS = ms(time.Since(start))
	return errors.Join(errs...)
}

var (
	runningRE = regexp.MustCompile(`sandbox running"? sandbox\.id=(\S+) (.*)`)
	ociRE     = regexp.MustCompile(`container OCI runtime"?.*? oci_runtime=(\S+) version=(\S+)`)
	fieldRE   = regexp.MustCompile(`(\w+)=("[^"]*"|\S+)`)
)

// nodeTimes reads the node's create times of ids from its log ("sandbox
// running" lines) into r: total, and the phases of the cold ones.
func nodeTimes(path string, ids []string, r *result) {
	if path == "" {
		return
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	if m := ociRE.FindAllStringSubmatch(string(b), -1); len(m) > 0 {
		last := m[len(m)-1]
		r.OCIRuntime = strings.Trim(last[1], `"`) + " " + strings.Trim(last[2], `"`)
	}
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	for _, m := range runningRE.FindAllStringSubmatch(string(b), -1) {
		if !want[m[1]] {
			continue
		}
		f := map[string]float64{}
		for _, kv := range fieldRE.FindAllStringSubmatch(m[2], -1) {
			if kv[1] == "from_warm_pool" && kv[2] == "true" {
				r.FromPool++
			}
			if v, err := strconv.ParseFloat(kv[2], 64); err == nil {
				f[kv[1]] = v
			}
		}
		if v, ok := f["total_ms"]; ok {
			r.NodeTotalMS = append(r.NodeTotalMS, v)
		}
		if v, ok := f["start_ms"]; ok {
			r.NodeNetMS = append(r.NodeNetMS, f["net_ms"])
			r.NodeCreateMS = append(r.NodeCreateMS, f["create_ms"])
			r.NodeStartMS = append(r.NodeStartMS, v)
		}
	}
}

func writeJSON(path string, r *result) error {
	if path == "" {
		return nil
	}
	b, err := json.MarshalIndent(r, "", " ")
	if err != nil {
		return fmt.Errorf("encode result: %w", err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("write result: %w", err)
	}
	return nil
}

func runMain(ctx context.Context, c config) error {
	cl, err := client(c)
	if err != nil {
		return err
	}
	r := &result{Mode: "main", Name: c.name, Count: c.count, CPU: c.cpu, MemMB: c.memoryMB, RuncN: c.runcN, SkipWarmPool: c.skipWarmPool}
	quiet := func(before string) error {
		d, n, err := waitQuiet(ctx, 120*time.Second)
		if err != nil {
			return fmt.Errorf("wait for a quiet machine before %s: %w", before, err)
		}
		r.QuietMS = append(r.QuietMS, ms(d))
		fmt.Fprintf(os.Stderr, "   quiet before %s after %.1f s (%d network namespaces)\n", before, d.Seconds(), n)
		return nil
	}
	if err := quiet("the runc loop"); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "== runc run loop of %d\n", c.runcN)
	if err := runcLoop(ctx, c, r); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "   %.1f ms each (p50)\n", pct(r.RuncRunMS, 50))
	if err := quiet("the batch"); err != nil {
		return err
	}
	label := fmt.Sprintf("burst-%d", os.Getpid())
	if c.prewarm {
		fmt.Fprintf(os.Stderr, "== prewarm %d\n", c.count)
		r.Prewarm = true
		t := time.Now()
		resp, err := cl.PrewarmSandboxes(ctx, connect.NewRequest(&v1.PrewarmSandboxesRequest{
			Spec: c.spec(label), Count: int32(c.count), TtlSeconds: 600, Wait: true, //nolint:gosec // flag-bounded
		}))
		if err != nil {
			return fmt.Errorf("prewarm: %w", err)
		}
		r.PrewarmMS = ms(time.Since(t))
		r.PrewarmHeld, r.PrewarmReady, r.PrewarmReason = int(resp.Msg.GetHeld()), int(resp.Msg.GetReady()), resp.Msg.GetReason()
		fmt.Fprintf(os.Stderr, "   held %d, ready %d in %.0f ms %s\n", r.PrewarmHeld, r.PrewarmReady, r.PrewarmMS, r.PrewarmReason)
	}
	fmt.Fprintf(os.Stderr, "== batch create of %d\n", c.count)
	cpu0, cerr := readCPU(c.upPid)
	ino0, ierr := inodesUsed(c.nodeLog)
	ids, berr := batch(ctx, cl, c, label, fmt.Sprintf("burst-%d", time.Now().UnixNano()), nil, r)
	if ino1, err := inodesUsed(c.nodeLog); err == nil && ierr == nil {
		d := ino1 - ino0
		r.BatchInodes = &d
		fmt.Fprintf(os.Stderr, "   inodes per create on the data dir's file system: %.1f\n", float64(d)/float64(c.count))
	}
	if cpu1, err := readCPU(c.upPid); err == nil && cerr == nil {
		d := cpu1.sub(cpu0)
		r.BatchCPU = &d
		fmt.Fprintf(os.Stderr, "   cpu per create: opendsec up %.1f ms (+ %.1f ms its waited children), host %.1f ms\n",
			d.Self/float64(c.count), d.Children/float64(c.count), d.HostBusy/float64(c.count))
		if c.upPid > 0 {
			if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", c.upPid)); err == nil {
				for _, l := range strings.Split(string(b), "\n") {
					if strings.HasPrefix(l, "VmRSS:") || strings.HasPrefix(l, "VmHWM:") {
						fmt.Fprintf(os.Stderr, "   opendsec up %s\n", strings.Join(strings.Fields(l), " "))
					}
				}
			}
		}
	}
	r.Inits, r.InitThreads = initThreads()
	fmt.Fprintf(os.Stderr, "   %d opendsec-init processes, %d threads\n", r.Inits, r.InitThreads)
	fmt.Fprintf(os.Stderr, "   %d created, %d failed in %.0f ms\n", len(ids), r.Failed, r.BatchTotalMS)
	nodeTimes(c.nodeLog, ids, r)
	fmt.Fprintf(os.Stderr, "== stop all %d\n", len(ids))
	serr := stopAll(ctx, cl, c, ids, r)
	fmt.Fprintf(os.Stderr, "   stopped in %.0f ms\n", r.StopTotalMS)
	if err := writeJSON(c.outJSON, r); err != nil {
		return err
	}
	return errors.Join(berr, serr)
}

func runKill(ctx context.Context, c config) error {
	cl, err := client(c)
	if err != nil {
		return err
	}
	if c.killPid == 0 || c.requestID == "" {
		return errors.New("-mode kill needs -kill-pid and -request-id")
	}
	r := &result{Mode: "kill", Count: c.count, CPU: c.cpu, MemMB: c.memoryMB, RequestID: c.requestID}
	ids, err := batch(ctx, cl, c, "burst-retry", c.requestID, func(n int) bool {
		if n < c.killAfter {
			return true
		}
		if err := syscall.Kill(c.killPid, syscall.SIGKILL); err != nil {
			fmt.Fprintln(os.Stderr, "kill:", err)
		}
		return false
	}, r)
	r.Received = len(ids)
	fmt.Fprintf(os.Stderr, "   killed pid %d after %d results (%.0f ms)\n", c.killPid, r.Received, r.BatchTotalMS)
	if err != nil {
		return err
	}
	return writeJSON(c.outJSON, r)
}

func runRetry(ctx context.Context, c config) error {
	cl, err := client(c)
	if err != nil {
		return err
	}
	r := &result{Mode: "retry", Count: c.count, CPU: c.cpu, MemMB: c.memoryMB, RequestID: c.requestID, RestartMS: c.restartMS}
	ids, berr := batch(ctx, cl, c, "burst-retry", c.requestID, nil, r)
	fmt.Fprintf(os.Stderr, "   retry: %d results, %d failed in %.0f ms\n", len(ids), r.Failed, r.BatchTotalMS)
	list, err := cl.ListSandboxes(ctx, connect.NewRequest(&v1.ListSandboxesRequest{Labels: map[string]string{"opendsec-bench": "burst-retry"}}))
	if err != nil {
		return fmt.Errorf("list sandboxes: %w", err)
	}
	seen := map[string]bool{}
	var all []string
	for _, sb := range list.Msg.GetSandboxes() {
		r.Listed++
		if !seen[sb.GetId()] {
			seen[sb.GetId()] = true
			all = append(all, sb.GetId())
		}
		if sb.GetState() == v1.SandboxState_SANDBOX_STATE_RUNNING {
			r.Running++
		}
	}
	r.Distinct = len(seen)
	fmt.Fprintf(os.Stderr, "   listed %d, distinct %d, running %d (want %d)\n", r.Listed, r.Distinct, r.Running, c.count)
	serr := stopAll(ctx, cl, c, all, r)
	if err := writeJSON(c.outJSON, r); err != nil {
		return err
	}
	if r.Listed != c.count || r.Distinct != c.count || r.Running != c.count {
		return errors.Join(berr, serr, fmt.Errorf("after the retry: %d sandboxes listed, %d distinct, %d running; want exactly %d", r.Listed, r.Distinct, r.Running, c.count))
	}
	return errors.Join(berr, serr)
}

// pct is the p-th percentile (nearest rank) of xs.
func pct(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(p/100*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

func readResult(path string) (*result, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read result: %w", err)
	}
	var r result
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("decode %s: %w", filepath.Base(path), err)
	}
	return &r, nil
}

// initThreads counts the opendsec-init processes of sandboxes on the host
// and their threads.
func initThreads() (procs, threads int) {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		// In a sandbox it runs as /.opendsec/init (comm "init").
		b, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil || !strings.HasPrefix(string(b), "Name:\tinit\n") {
			continue
		}
		if cl, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline"); !strings.HasPrefix(string(cl), "/.opendsec/init\x00") {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "Threads:"); ok {
				n, _ := strconv.Atoi(strings.TrimSpace(v))
				procs, threads = procs+1, threads+n
			}
		}
	}
	return procs, threads
}
