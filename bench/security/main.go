// Command security repeats the red-team figures of issue 11 against a
// running system (bench/security.sh starts a throwaway one):
//
//   - dns: 120k DNS queries for one allowed name from a sandbox's network
//     namespace; the node's RSS growth.
//   - forkbomb: a fork bomb in each of 4 sandboxes; the host's tasks in use
//     against the sandboxes' PID ceiling, and whether a new sandbox still
//     starts and runs a command meanwhile.
//   - disk: one sandbox fills its writable layer (bytes, then inodes);
//     whether another sandbox still creates and writes.
//
// With -serve-dns it is instead the DNS upstream the dns phase needs: it
// answers every A query with one fixed address (no packet goes there; the
// address only lands in the sandbox's nftables set).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

type config struct {
	endpoint, tokenFile string
	netnsDir            string
	nodePID             int
	image, pyImage      string
	phases              string
	queries             int
	bombs               int
	bombPids            int64
	bombTime            time.Duration
	out, command        string
	revision            string
}

func main() {
	var c config
	serveDNS := flag.String("serve-dns", "", "serve as the DNS upstream on this UDP address (e.g. 127.0.0.1:5399) instead of benchmarking")
	flag.StringVar(&c.endpoint, "endpoint", "127.0.0.1:7070", "the API server")
	flag.StringVar(&c.tokenFile, "token-file", "/var/lib/opendsec/bootstrap.token", "a file holding an admin token")
	flag.StringVar(&c.netnsDir, "netns-dir", "", "the node's network.netns_dir (the dns phase queries from a sandbox's namespace)")
	flag.IntVar(&c.nodePID, "node-pid", 0, "PID of the process running the node (its RSS is measured)")
	flag.StringVar(&c.image, "image", "root/busybox", "image for the dns and fork bomb phases")
	flag.StringVar(&c.pyImage, "py-image", "root/py:3.11", "image with python3 for the disk phase")
	flag.StringVar(&c.phases, "phases", "dns,forkbomb,disk", "phases to run, comma-separated")
	flag.IntVar(&c.queries, "queries", 120000, "DNS queries in the dns phase")
	flag.IntVar(&c.bombs, "bombs", 4, "sandboxes running a fork bomb at once")
	flag.Int64Var(&c.bombPids, "bomb-pids", 4096, "pids_limit of each fork bomb's sandbox (the node's default max_pids_limit)")
	flag.DurationVar(&c.bombTime, "bomb-time", 10*time.Second, "how long the fork bombs run while the host is sampled")
	flag.StringVar(&c.out, "out", "", "also write the report to this file")
	flag.StringVar(&c.command, "command", "bench/security", "the command line, for the report")
	flag.StringVar(&c.revision, "revision", "dev", "the revision, for the report")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *serveDNS != "" {
		if err := serveUpstream(ctx, *serveDNS); err != nil {
			fmt.Fprintln(os.Stderr, "serve dns:", err)
			os.Exit(1)
		}
		return
	}
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
		fmt.Fprintln(os.Stderr, "bench/security:", err)
		os.Exit(1)
	}
	if r != nil && r.failed() {
		os.Exit(2)
	}
}

// report collects each phase's lines and whether its bound held.
type report struct {
	cfg      config
	started  time.Time
	sections []section
}

type section struct {
	title string
	lines []string
	pass  bool
	bound string
}

func (r *report) failed() bool {
	for _, s := range r.sections {
		if !s.pass {
			return true
		}
	}
	return false
}

func (r *report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Security figures (issue 11)\n\n")
	fmt.Fprintf(&b, "- Date: %s; revision %s; command `%s`\n", r.started.UTC().Format(time.RFC3339), r.cfg.revision, r.cfg.command)
	fmt.Fprintf(&b, "- Machine: %s\n\n", machine())
	fmt.Fprintf(&b, "| figure | bound | result |\n|---|---|---|\n")
	for _, s := range r.sections {
		res := "held"
		if !s.pass {
			res = "**NOT held**"
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", s.title, s.bound, res)
	}
	for _, s := range r.sections {
		fmt.Fprintf(&b, "\n## %s\n\n", s.title)
		for _, l := range s.lines {
			fmt.Fprintf(&b, "- %s\n", l)
		}
	}
	return b.String()
}
