// Command e2btti measures time to interactive (TTI) as ComputeSDK's
// benchmark defines it (create a sandbox, an identity probe, `node -v`
// exiting 0; the destroy after it is not timed) through ComputeSDK's E2B
// provider against OpenDsec's E2B gateway (worker.mjs, a node process) and,
// side by side in the same run, the same loop through OpenDsec's Go client
// (CreateSandbox of the image the gateway's `base` maps to, RunShell of
// the same probe and `node -v`, StopSandbox), interleaved: on even
// iterations ComputeSDK first, on odd ones OpenDsec first. Every iteration
// of both must succeed. Driven by bench/e2b-tti.sh, which starts the
// system; writes a markdown report to -out.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"time"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

type config struct {
	endpoint, tokenFile, image, worker, out, command, versions string
	n                                                          int
}

// The probe tti.mjs runs, with the same markers: a fresh sandbox has none.
const probe = `found=; for p in /tmp/.bench_ephemeral_check /var/tmp/.bench_ephemeral_check; do [ -f "$p" ] && found=$p && break; done; ` +
	`echo "marker_path=$found"; echo "ns_mnt=$(readlink /proc/self/ns/mnt)"; echo "ns_pid=$(readlink /proc/self/ns/pid)"; ` +
	`echo "ns_uts=$(readlink /proc/self/ns/uts)"; echo "cgroup_hash=$(sha256sum </proc/self/cgroup | cut -d" " -f1)"; ` +
	`echo "boot_id=$(cat /proc/sys/kernel/random/boot_id)"; echo "pid1=$(tr -d '\0' </proc/1/cmdline)"; ` +
	`printf %s tti >/tmp/.bench_ephemeral_check; printf %s tti >/var/tmp/.bench_ephemeral_check`

func main() {
	var c config
	flag.StringVar(&c.endpoint, "endpoint", "", "OpenDsec API address")
	flag.StringVar(&c.tokenFile, "token-file", "", "token for the Go client")
	flag.StringVar(&c.image, "image", "root/base", "image of the native loop (what the gateway's base maps to)")
	flag.StringVar(&c.worker, "worker", "bench/e2btti/worker.mjs", "the ComputeSDK worker")
	flag.IntVar(&c.n, "n", 10, "iterations of each (ComputeSDK's benchmark runs 10)")
	flag.StringVar(&c.out, "out", "", "markdown report")
	flag.StringVar(&c.command, "command", "bash bench/e2b-tti.sh", "the command, for the report")
	flag.StringVar(&c.versions, "versions", "", "client versions, for the report")
	flag.Parse()
	if err := run(context.Background(), c); err != nil {
		fmt.Fprintln(os.Stderr, "e2btti:", err)
		os.Exit(1)
	}
}

type jsResult struct {
	TTIMs           float64 `json:"ttiMs"`
	Node            string  `json:"node"`
	RepeatedSignals int     `json:"repeatedSignals"`
	Error           string  `json:"error"`
}

type worker struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
}

func startWorker(path string) (*worker, error) {
	cmd := exec.Command("node", path)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("worker stdin: %w", err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("worker stdout: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start worker: %w", err)
	}
	return &worker{cmd: cmd, in: in, out: bufio.NewScanner(out)}, nil
}

func (w *worker) once() (jsResult, error) {
	var r jsResult
	if _, err := io.WriteString(w.in, "run\n"); err != nil {
		return r, fmt.Errorf("worker: %w", err)
	}
	if !w.out.Scan() {
		return r, errors.New("the ComputeSDK worker exited")
	}
	if err := json.Unmarshal(w.out.Bytes(), &r); err != nil {
		return r, fmt.Errorf("worker answer %q: %w", w.out.Text(), err)
	}
	if r.Error != "" {
		return r, fmt.Errorf("ComputeSDK iteration: %s", r.Error)
	}
	return r, nil
}

func (w *worker) close() {
	w.in.Close()
	w.cmd.Wait()
}

// native is one iteration through the Go client: TTI and node's version.
func native(ctx context.Context, cl *opendsec.Client, image string) (time.Duration, string, error) {
	start := time.Now()
	sb, err := cl.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: image, Labels: map[string]string{"bench": "e2b-tti"}})
	if err != nil {
		return 0, "", fmt.Errorf("create: %w", err)
	}
	defer cl.StopSandbox(context.WithoutCancel(ctx), sb.GetId())
	r, err := cl.RunShell(ctx, sb.GetId(), probe)
	if err != nil {
		return 0, "", fmt.Errorf("identity probe: %w", err)
	}
	if r.ExitCode != 0 || strings.Contains(r.Stdout, "marker_path=/") {
		return 0, "", fmt.Errorf("identity probe: exit %d, %q", r.ExitCode, r.Stdout)
	}
	r, err = cl.RunShell(ctx, sb.GetId(), "node -v")
	if err != nil {
		return 0, "", fmt.Errorf("node -v: %w", err)
	}
	if r.ExitCode != 0 {
		return 0, "", fmt.Errorf("node -v exited %d: %s", r.ExitCode, r.Stderr)
	}
	return time.Since(start), strings.TrimSpace(r.Stdout), nil
}

// pct is the nearest-rank percentile.
func pct(xs []float64, p float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[max(0, int(math.Ceil(p/100*float64(len(s))))-1)]
}

func mean(xs []float64) float64 {
	var t float64
	for _, x := range xs {
		t += x
	}
	return t / float64(len(xs))
}

func run(ctx context.Context, c config) error {
	tok, err := os.ReadFile(c.tokenFile)
	if err != nil {
		return fmt.Errorf("read token: %w", err)
	}
	cl, err := opendsec.New(c.endpoint, opendsec.WithToken(strings.TrimSpace(string(tok))))
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	defer cl.Close()
	w, err := startWorker(c.worker)
	if err != nil {
		return err
	}
	defer w.close()
	host := machine()
	var js, nat []float64
	var jsNode, natNode string
	var repeated []int
	for i := range c.n {
		order := []string{"computesdk", "opendsec-go"}
		if i%2 == 1 {
			slices.Reverse(order)
		}
		for _, who := range order {
			if who == "computesdk" {
				r, err := w.once()
				if err != nil {
					return fmt.Errorf("iteration %d: %w", i+1, err)
				}
				js, jsNode = append(js, r.TTIMs), r.Node
				repeated = append(repeated, r.RepeatedSignals)
				continue
			}
			d, v, err := native(ctx, cl, c.image)
			if err != nil {
				return fmt.Errorf("iteration %d, opendsec go client: %w", i+1, err)
			}
			nat, natNode = append(nat, float64(d.Microseconds())/1000), v
		}
		fmt.Fprintf(os.Stderr, "\r%d/%d", i+1, c.n)
	}
	fmt.Fprintln(os.Stderr)

	var b strings.Builder
	fmt.Fprintf(&b, "# Time to interactive: ComputeSDK's E2B provider through OpenDsec's gateway vs OpenDsec's Go client\n\n")
	fmt.Fprintf(&b, "- Date: %s\n", time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Fprintf(&b, "- Machine: %s (shared with other work)\n", host)
	fmt.Fprintf(&b, "- Command: `%s`\n", c.command)
	fmt.Fprintf(&b, "- Clients: %s\n", c.versions)
	fmt.Fprintf(&b, "- Loop (ComputeSDK's benchmark, `src/sandbox/benchmark.ts` of computesdk/benchmarks): the clock runs from the create call through an identity probe (no marker of an earlier sandbox in /tmp or /var/tmp; namespaces, cgroup, boot id and PID 1 noted) to `node -v` exiting 0; the destroy is not timed. "+
		"ComputeSDK: `e2b({apiKey}).sandbox.create()` (template `base`, mapped to `%s`), `runCommand`, `destroy()`; OpenDsec: `CreateSandbox(%s)`, `RunShell`, `StopSandbox`. "+
		"%d iterations of each, interleaved (ComputeSDK first on even iterations, OpenDsec first on odd ones), no warm-up, sequential; every iteration succeeded (%d/%d and %d/%d).\n",
		c.image, c.image, c.n, len(js), c.n, len(nat), c.n)
	fmt.Fprintf(&b, "- `node -v`: %s (ComputeSDK), %s (OpenDsec). Repeated identity signals per ComputeSDK iteration (a warning in ComputeSDK's default mode, a failure with BENCH_STRICT_REUSE_SIGNALS=1): %s — containers share the node's kernel, so boot id and PID 1 repeat, cgroup namespaces show `0::/`, and the kernel reuses freed namespace numbers.\n\n", jsNode, natNode, fmt.Sprint(repeated))
	fmt.Fprintf(&b, "Milliseconds, client wall clock; percentiles nearest rank (p95 of 10 is the slowest).\n\n")
	fmt.Fprintf(&b, "| client | median | p95 | min | mean | max |\n|---|---|---|---|---|---|\n")
	for _, r := range []struct {
		name string
		xs   []float64
	}{{"ComputeSDK @computesdk/e2b → gateway", js}, {"OpenDsec Go client → API", nat}} {
		fmt.Fprintf(&b, "| %s | %.1f | %.1f | %.1f | %.1f | %.1f |\n", r.name, pct(r.xs, 50), pct(r.xs, 95), slices.Min(r.xs), mean(r.xs), slices.Max(r.xs))
	}
	fmt.Fprintf(&b, "\nMedian ratio ComputeSDK / OpenDsec Go: %.2fx.\n\nEach iteration, in order (ms): ComputeSDK %s; OpenDsec Go %s.\n",
		pct(js, 50)/pct(nat, 50), list(js), list(nat))
	fmt.Print(b.String())
	if c.out != "" {
		if err := os.WriteFile(c.out, []byte(b.String()), 0o644); err != nil {
			return fmt.Errorf("write report: %w", err)
		}
	}
	return nil
}

func list(xs []float64) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprintf("%.0f", x)
	}
	return strings.Join(s, ", ")
}

func machine() string {
	cpu := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				cpu = strings.TrimSpace(l[strings.Index(l, ":")+1:])
				break
			}
		}
	}
	load := "?"
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		load = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	return fmt.Sprintf("%s, %d CPUs, %s/%s, load average at the start %s", cpu, runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, load)
}
