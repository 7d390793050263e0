// Command forkapi measures ForkSandbox through the public API (Go SDK →
// apiserver → node → container backend) side by side with making the same
// number of sandboxes from the image, interleaved in every iteration: fork
// of count 1 and 8 of a source that wrote ~50 MiB, and CreateSandbox / a
// BatchCreate of 8 of the same spec (cold, skip_warm_pool). It reports p50
// and p95 of each call's wall time, the source's frozen time
// (source_frozen_us) of the forks, and the time to a first command in a
// fork. bench/fork-api.sh starts the throwaway system and runs it.
package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"time"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

type series []time.Duration

func (s series) p(q float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	c := slices.Clone(s)
	slices.Sort(c)
	return c[max(1, min(int(math.Ceil(q/100*float64(len(c)))), len(c)))-1]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond)) }

func main() {
	n := flag.Int("n", 10, "iterations")
	endpoint := flag.String("endpoint", os.Getenv("OPENDSEC_ENDPOINT"), "apiserver address")
	image := flag.String("image", "root/busybox", "image")
	out := flag.String("o", "", "write the markdown report here too")
	flag.Parse()
	if err := run(*endpoint, *image, *n, *out); err != nil {
		fmt.Fprintln(os.Stderr, "forkapi:", err)
		os.Exit(1)
	}
}

func run(endpoint, image string, n int, out string) error {
	ctx := context.Background()
	c, err := opendsec.New(endpoint, opendsec.WithToken(os.Getenv("OPENDSEC_TOKEN")))
	if err != nil {
		return err
	}
	spec := &opendsec.SandboxSpec{Image: image, Cpu: 0.25, DiskMb: 512}
	src, err := c.CreateSandboxWith(ctx, spec, opendsec.CreateOptions{SkipWarmPool: true})
	if err != nil {
		return fmt.Errorf("create source: %w", err)
	}
	defer c.StopSandbox(context.WithoutCancel(ctx), src.GetId())
	// ~50 MiB in the writable layer: one 40 MiB file and 100 of 100 KiB.
	r, err := c.RunShell(ctx, src.GetId(), `cd && dd if=/dev/urandom of=big bs=1M count=40 2>/dev/null && mkdir -p small && `+
		`for i in $(seq 1 100); do dd if=/dev/urandom of=small/$i bs=1k count=100 2>/dev/null; done && sync && du -sk . | cut -f1`)
	if err != nil || r.ExitCode != 0 {
		return fmt.Errorf("write source files: %v %+v", err, r)
	}
	written := strings.TrimSpace(r.Stdout)
	stopAll := func(ids []string) {
		for _, id := range ids {
			if err := c.StopSandbox(context.WithoutCancel(ctx), id); err != nil {
				fmt.Fprintln(os.Stderr, "stop:", err)
			}
		}
	}
	var (
		fork1, fork8, frozen1, frozen8, create1, create8, first series
	)
	fork := func(count int, wall, frozen *series, firstCmd bool) error {
		t0 := time.Now()
		res, err := c.ForkSandbox(ctx, src.GetId(), count, opendsec.ForkOptions{})
		d := time.Since(t0)
		if err != nil {
			return fmt.Errorf("fork %d: %w", count, err)
		}
		*wall = append(*wall, d)
		*frozen = append(*frozen, res.SourceFrozen)
		var ids []string
		for _, f := range res.Forks {
			ids = append(ids, f.Sandbox.GetId())
		}
		if firstCmd {
			r, err := c.RunShell(ctx, ids[0], "cd && ls small | wc -l")
			if err != nil || strings.TrimSpace(r.Stdout) != "100" {
				return fmt.Errorf("first command in a fork: %v %+v", err, r)
			}
			first = append(first, time.Since(t0))
		}
		stopAll(ids)
		return nil
	}
	for i := range n {
		if err := fork(1, &fork1, &frozen1, true); err != nil {
			return err
		}
		t0 := time.Now()
		sb, err := c.CreateSandboxWith(ctx, spec, opendsec.CreateOptions{SkipWarmPool: true})
		if err != nil {
			return fmt.Errorf("create: %w", err)
		}
		create1 = append(create1, time.Since(t0))
		stopAll([]string{sb.GetId()})
		if err := fork(8, &fork8, &frozen8, false); err != nil {
			return err
		}
		var ids []string
		var berr error
		t0 = time.Now()
		err = c.BatchCreateWith(ctx, spec, 8, opendsec.CreateOptions{SkipWarmPool: true}, func(b opendsec.BatchResult) {
			if b.Err != nil {
				berr = b.Err
				return
			}
			ids = append(ids, b.Sandbox.GetId())
		})
		create8 = append(create8, time.Since(t0))
		stopAll(ids)
		if err != nil || berr != nil {
			return fmt.Errorf("batch create: %v %v", err, berr)
		}
		fmt.Fprintf(os.Stderr, "iteration %d/%d done\n", i+1, n)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "source: %s, cpu 0.25, disk_mb 512, %s KiB written in its home; %d iterations, interleaved\n\n", image, written, n)
	fmt.Fprintf(&b, "| call | p50 ms | p95 ms | source frozen p50 ms | frozen p95 ms |\n|---|---|---|---|---|\n")
	fmt.Fprintf(&b, "| ForkSandbox count 1 | %s | %s | %s | %s |\n", ms(fork1.p(50)), ms(fork1.p(95)), ms(frozen1.p(50)), ms(frozen1.p(95)))
	fmt.Fprintf(&b, "| CreateSandbox (cold, same spec) | %s | %s | - | - |\n", ms(create1.p(50)), ms(create1.p(95)))
	fmt.Fprintf(&b, "| ForkSandbox count 8 | %s | %s | %s | %s |\n", ms(fork8.p(50)), ms(fork8.p(95)), ms(frozen8.p(50)), ms(frozen8.p(95)))
	fmt.Fprintf(&b, "| BatchCreate 8 (cold, same spec) | %s | %s | - | - |\n", ms(create8.p(50)), ms(create8.p(95)))
	fmt.Fprintf(&b, "| fork 1 + first command in it (`ls`) | %s | %s | - | - |\n\n", ms(first.p(50)), ms(first.p(95)))
	fmt.Fprintf(&b, "ratios (p50): fork 1 / create = %.2f, fork 8 / batch create 8 = %.2f, fork 8 / fork 1 = %.2f\n",
		float64(fork1.p(50))/float64(create1.p(50)), float64(fork8.p(50))/float64(create8.p(50)), float64(fork8.p(50))/float64(fork1.p(50)))
	fmt.Print(b.String())
	if out != "" {
		return os.WriteFile(out, []byte(b.String()), 0o644)
	}
	return nil
}
