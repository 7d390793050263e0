// Command network benchmarks OpenDsec's per-sandbox network on this machine:
// how long internal/netpolicy takes to set up, change and tear down a
// sandbox's network, and what the policy costs a TCP flow (round-trip
// latency, new-connection latency, bulk throughput) compared with an
// unpoliced veth pair, side by side and interleaved in one run.
//
// Everything happens in network namespaces the program makes and removes:
// no packet leaves them. Runs as root. See bench/README.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strings"
	"syscall"
	"time"
)

type config struct {
	setups   int
	rounds   int
	rr       int
	conns    int
	msg      int
	bulk     time.Duration
	out      string
	command  string
	revision string
	api      apiConfig
}

func main() {
	var c config
	flag.IntVar(&c.setups, "setups", 200, "sandbox networks to set up, change and tear down (timed one by one)")
	flag.IntVar(&c.rounds, "rounds", 7, "rounds; each runs every path once, in rotating order")
	flag.IntVar(&c.rr, "rr", 20000, "request/response round trips per path per round (on one connection)")
	flag.IntVar(&c.conns, "conns", 500, "new connections (connect + one round trip + close) per path per round")
	flag.IntVar(&c.msg, "msg", 64, "request/response size in bytes")
	flag.DurationVar(&c.bulk, "bulk", time.Second, "bulk transfer time per path per round")
	flag.StringVar(&c.api.endpoint, "endpoint", "", "also measure a sandbox port through this apiserver (host:port); empty skips the inbound section")
	flag.StringVar(&c.api.tokenFile, "token-file", "", "file with the token for -endpoint")
	flag.StringVar(&c.api.netnsDir, "netns-dir", "", "the node's network.netns_dir, for the in-sandbox baseline of the inbound section")
	flag.StringVar(&c.api.image, "image", "root/busybox", "image of the inbound section's sandbox (needs busybox nc and httpd)")
	flag.IntVar(&c.api.rr, "api-rr", 2000, "inbound: round trips per path per round")
	flag.IntVar(&c.api.conns, "api-conns", 200, "inbound: new connections per path per round")
	flag.IntVar(&c.api.bulkMiB, "api-bulk-mib", 64, "inbound: MiB downloaded per path per round")
	flag.StringVar(&c.out, "out", "", "write the markdown report here too (default: print only)")
	flag.StringVar(&c.command, "command", "", "command line to record in the report")
	flag.StringVar(&c.revision, "revision", "", "source revision to record in the report")
	flag.Parse()
	if c.setups < 1 || c.rounds < 1 || c.rr < 10 || c.conns < 10 || c.msg < 1 || c.bulk <= 0 {
		fmt.Fprintln(os.Stderr, "error: -setups and -rounds must be ≥ 1, -rr and -conns ≥ 10, -msg ≥ 1, -bulk > 0")
		os.Exit(2)
	}
	if c.command == "" {
		c.command = strings.Join(os.Args, " ")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	r, err := run(ctx, c)
	if err == nil && c.api.endpoint != "" {
		c.api.rounds = c.rounds
		r.inbound, err = inbound(ctx, c.api)
		r.elapsed = time.Since(r.started)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "error: %s\n", err)
		os.Exit(1)
	}
	r.machine.loadEnd = loadavg()
	md := r.markdown()
	fmt.Print(md)
	if c.out != "" {
		if err := os.MkdirAll(filepath.Dir(c.out), 0o755); err != nil {
			fmt.Fprintf(os.Stderr, "error: %s\n", err)
			os.Exit(1)
		}
		if err := os.WriteFile(c.out, []byte(md), 0o644); err != nil {
			fmt.Fprintf(os.Stderr, "error: %s\n", err)
			os.Exit(1)
		}
	}
}

// series is a set of durations.
type series []time.Duration

// pct returns the p-th percentile (nearest rank).
func (s series) pct(p float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	v := slices.Clone(s)
	slices.Sort(v)
	i := int(float64(len(v))*p/100+0.999999) - 1
	return v[max(0, min(i, len(v)-1))]
}

func (s series) mean() time.Duration {
	if len(s) == 0 {
		return 0
	}
	var t time.Duration
	for _, d := range s {
		t += d
	}
	return t / time.Duration(len(s))
}

// pathResult is what one path measured over all rounds.
type pathResult struct {
	name, what string
	rr         series
	conn       series
	mbps       []float64 // one per round
}

type machine struct {
	cpu, kernel, goVersion, mem string
	nproc                       int
	loadStart, loadEnd          string // /proc/loadavg around the run
}

type report struct {
	cfg        config
	machine    machine
	started    time.Time
	elapsed    time.Duration
	paths      []*pathResult
	setup      series
	change     series // SetRules with a nearly empty conntrack table
	changeFull series // SetRules after the TCP phase
	down       series
	// conntrack entries in the node namespace before each SetRules pass
	ctBefore, ctAfter int
	// nftRules is the number of rules in one sandbox's two chains.
	nftRules int
	inbound  *apiResult
}

func us(d time.Duration) string { return fmt.Sprintf("%.1f µs", float64(d)/float64(time.Microsecond)) }
func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond)) }

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func (r *report) markdown() string {
	var w strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&w, format+"\n", args...) }
	m := r.machine
	p("# OpenDsec network benchmark, %s", r.started.Format("2006-01-02 15:04 MST"))
	p("")
	p("Per-sandbox network setup time (`internal/netpolicy`), and a TCP flow from a sandbox's namespace through the policy (veth, nftables chains, NAT) side by side with unpoliced paths, interleaved in one run. All traffic stays in namespaces the benchmark made.")
	p("")
	p("## Machine")
	p("")
	p("| | |")
	p("|---|---|")
	p("| CPU | %s, %d logical cores |", m.cpu, m.nproc)
	p("| memory | %s |", m.mem)
	p("| kernel | %s |", m.kernel)
	p("| Go | %s |", m.goVersion)
	if r.cfg.revision != "" {
		p("| revision | %s |", r.cfg.revision)
	}
	p("| command | `%s` |", r.cfg.command)
	p("| run time | %s |", r.elapsed.Round(time.Second))
	p("| load average (start → end) | %s → %s |", m.loadStart, m.loadEnd)
	p("")
	p("## Network setup (%d sandboxes, one at a time; all exist during the TCP phase below)", r.cfg.setups)
	p("")
	p("| step | p50 | p95 | mean | max |")
	p("|---|---|---|---|---|")
	for _, row := range []struct {
		name string
		s    series
	}{
		{"`Setup`: netns, veth pair, guest address + /31, neighbours, routes, NAT in the netns, nftables chains + map entries, state file", r.setup},
		{fmt.Sprintf("`SetRules`: replace the rules atomically and cut flows no longer allowed; %d conntrack entries on the node", r.ctBefore), r.change},
		{fmt.Sprintf("`SetRules` again after the TCP phase: %d conntrack entries on the node", r.ctAfter), r.changeFull},
		{"`Teardown`: chains, map entries, veth, netns, address, state", r.down},
	} {
		p("| %s | %s | %s | %s | %s |", row.name, ms(row.s.pct(50)), ms(row.s.pct(95)), ms(row.s.mean()), ms(row.s.pct(100)))
	}
	p("")
	p("`SetRules` cuts flows by dumping the node's whole conntrack table (`ConntrackDeleteFilters`), so its cost grows with the table, not with the sandbox.")
	p("")
	p("## TCP through the policy vs unpoliced (%d rounds, paths interleaved)", r.cfg.rounds)
	p("")
	p("| path | what | round trip p50 | round trip p99 | new connection p50 | new connection p99 | bulk MB/s (median of rounds) |")
	p("|---|---|---|---|---|---|---|")
	for _, pr := range r.paths {
		p("| %s | %s | %s | %s | %s | %s | %.0f |", pr.name, pr.what, us(pr.rr.pct(50)), us(pr.rr.pct(99)), us(pr.conn.pct(50)), us(pr.conn.pct(99)), median(pr.mbps))
	}
	p("")
	if len(r.paths) > 0 {
		base, pol := r.paths[0], r.paths[len(r.paths)-1]
		p("Policed vs direct veth: round trip p50 %+.1f µs (%.2fx), new connection p50 %+.1f µs (%.2fx), bulk %.2fx.",
			float64(pol.rr.pct(50)-base.rr.pct(50))/1e3, ratio(pol.rr.pct(50), base.rr.pct(50)),
			float64(pol.conn.pct(50)-base.conn.pct(50))/1e3, ratio(pol.conn.pct(50), base.conn.pct(50)),
			median(pol.mbps)/max(median(base.mbps), 1e-9))
		if len(r.paths) == 3 {
			rt := r.paths[1]
			p("Policed vs routed unpoliced (the policy's own cost: per-sandbox chains, NAT): round trip p50 %+.1f µs (%.2fx), new connection p50 %+.1f µs (%.2fx), bulk %.2fx.",
				float64(pol.rr.pct(50)-rt.rr.pct(50))/1e3, ratio(pol.rr.pct(50), rt.rr.pct(50)),
				float64(pol.conn.pct(50)-rt.conn.pct(50))/1e3, ratio(pol.conn.pct(50), rt.conn.pct(50)),
				median(pol.mbps)/max(median(rt.mbps), 1e-9))
		}
		p("")
	}
	if in := r.inbound; in != nil {
		p("## Inbound: a port inside a sandbox, through the API vs from inside the sandbox (%d rounds, interleaved)", in.cfg.rounds)
		p("")
		p("A `%s` sandbox on the system at `%s` runs `nc -ll -p %d -e /bin/cat` (a fork+exec of cat per connection) and `httpd` serving a %d MiB file.", in.cfg.image, in.cfg.endpoint, echoPort, in.cfg.bulkMiB)
		p("")
		p("| path | what | round trip p50 | round trip p99 | new connection p50 | new connection p99 | download MB/s (median of rounds) |")
		p("|---|---|---|---|---|---|---|")
		for _, pr := range []*pathResult{in.api, in.local} {
			if len(pr.rr) == 0 {
				continue
			}
			p("| %s | %s | %s | %s | %s | %s | %.0f |", pr.name, pr.what, us(pr.rr.pct(50)), us(pr.rr.pct(99)), us(pr.conn.pct(50)), us(pr.conn.pct(99)), median(pr.mbps))
		}
		p("")
		p("Round trip: 64 bytes to the echo server and back on one open stream, %d per round. New connection: open the stream (`ConnectPort` returns once the agent connected to the port), one round trip, close; %d per round — it includes nc's fork+exec of cat. Download: one HTTP/1.0 GET of the file, MB = 10^6 bytes.", in.cfg.rr, in.cfg.conns)
		p("")
	}
	p("How it was measured:")
	p("")
	p("- **round trip**: one TCP connection per path per round; the client writes %d bytes, the server echoes them, the client reads them; %d timed round trips per round after 200 untimed ones.", r.cfg.msg, r.cfg.rr)
	p("- **new connection**: dial, one %d-byte round trip, close; %d per path per round. The first packet of each flow walks the sandbox's chain and creates a conntrack (and, policed, a NAT) entry; the rest match `ct state established`.", r.cfg.msg, r.cfg.conns)
	p("- **bulk**: the client writes 128 KiB buffers for %s, half-closes, and waits for the server's byte count; MB/s = bytes / (time until the count arrives), 1 MB = 10^6 bytes.", r.cfg.bulk)
	p("- The sandbox's policy allows exactly the server's address and ports (tcp 5001-5002); its chains hold %d rules.", r.nftRules)
	p("- Client and server are Go programs' goroutines with sockets opened inside the namespaces (setns on a locked thread); both run on this machine's %d cores, so the numbers include the stack's CPU cost on both ends.", m.nproc)
	return w.String()
}

func ratio(a, b time.Duration) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func machineInfo() machine {
	m := machine{nproc: goruntime.NumCPU(), goVersion: goruntime.Version(), kernel: kernelRelease(), loadStart: loadavg()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.cpu = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			var kb int64
			if _, err := fmt.Sscanf(line, "MemTotal: %d kB", &kb); err == nil {
				m.mem = fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
			}
		}
	}
	return m
}
