// Command pause measures task pause (bench/pause.sh starts a throwaway
// system for it):
//
//   - latency: PauseSandbox and ResumeSandbox through the public API, p50
//     over -rounds, interleaved with the least a pause can cost: a write of
//     a bare cgroup's freezer (FROZEN / THAWED on v1, cgroup.freeze on v2)
//     with one sleeping process in it, and the wait until the kernel says
//     frozen.
//   - reclaim: a task of -sandboxes sandboxes, each running memhog with
//     -mib MiB of written anonymous memory (-pattern), paused in one
//     PauseTask(reclaim) call: the node's MemAvailable and zram's mm_stat
//     before and after, the bytes freed as reported against that; then
//     ResumeTask and every counter and memory checksum checked. Each -runs
//     entry SWAP/PATTERN is one run on its swap: "zram" (made here when the
//     host has no swap) or "file" (a swap file on disk made here; both
//     removed after) or "host" (what the host has).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

type config struct {
	endpoint, tokenFile string
	image               string
	rounds              int
	sandboxes           int
	mib                 int
	runs                string
	memoryMB            int64
	swapFileDir         string
	memhog              string
	out, command        string
	revision            string
}

func main() {
	var c config
	flag.StringVar(&c.endpoint, "endpoint", "127.0.0.1:7070", "the API server")
	flag.StringVar(&c.tokenFile, "token-file", "/var/lib/opendsec/bootstrap.token", "a file holding an admin token")
	flag.StringVar(&c.image, "image", "root/busybox", "image of the sandboxes")
	flag.IntVar(&c.rounds, "rounds", 50, "pause/resume rounds of the latency phase (0: skip it)")
	flag.IntVar(&c.sandboxes, "sandboxes", 200, "sandboxes of the task in the reclaim phase (0: skip it)")
	flag.IntVar(&c.mib, "mib", 20, "MiB of written anonymous memory in each sandbox")
	flag.StringVar(&c.runs, "runs", "zram/text,zram/random,file/random", "reclaim runs, SWAP/PATTERN each: swap zram, file or host; memhog pattern text (log-like lines) or random (incompressible)")
	flag.Int64Var(&c.memoryMB, "memory-mb", 64, "memory_mb of each sandbox")
	flag.StringVar(&c.swapFileDir, "swap-file-dir", "/var/tmp", "where the \"file\" run puts its swap file")
	flag.StringVar(&c.memhog, "memhog", "", "the memhog binary (go build ./internal/testutil/memhog)")
	flag.StringVar(&c.out, "out", "", "also write the report to this file")
	flag.StringVar(&c.command, "command", "bench/pause", "the command line, for the report")
	flag.StringVar(&c.revision, "revision", "dev", "the revision, for the report")
	flag.Parse()
	if c.memhog == "" {
		fmt.Fprintln(os.Stderr, "pause: -memhog is required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	r, err := run(ctx, c)
	if r != nil {
		text := r.String()
		fmt.Print(text)
		if c.out != "" {
			if werr := os.WriteFile(c.out, []byte(text), 0o644); werr != nil {
				fmt.Fprintln(os.Stderr, "write report:", werr)
			}
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "pause:", err)
		os.Exit(1)
	}
}

func split(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
