//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/bench/internal/benchns"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

func machine() string {
	var u unix.Utsname
	_ = unix.Uname(&u)
	return fmt.Sprintf("Linux %s, %d cores", unix.ByteSliceToString(u.Release[:]), goruntime.NumCPU())
}

func run(ctx context.Context, c config) (*report, error) {
	tok, err := os.ReadFile(c.tokenFile)
	if err != nil {
		return nil, fmt.Errorf("read token: %w", err)
	}
	cl, err := opendsec.New(c.endpoint, opendsec.WithToken(strings.TrimSpace(string(tok))))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	b := &bench{cl: cl, c: c, label: fmt.Sprintf("security-%d", os.Getpid())}
	defer b.cleanup()
	r := &report{cfg: c, started: time.Now()}
	for _, p := range strings.Split(c.phases, ",") {
		var s section
		switch strings.TrimSpace(p) {
		case "dns":
			s, err = b.dns(ctx)
		case "forkbomb":
			s, err = b.forkbomb(ctx)
		case "disk":
			s, err = b.disk(ctx)
		case "":
			continue
		default:
			return r, fmt.Errorf("unknown phase %q (dns, forkbomb, disk)", p)
		}
		if err != nil {
			return r, fmt.Errorf("%s: %w", p, err)
		}
		r.sections = append(r.sections, s)
		b.cleanup()
	}
	return r, nil
}

type bench struct {
	cl    *opendsec.Client
	c     config
	label string

	mu  sync.Mutex
	ids []string
}

func (b *bench) create(ctx context.Context, spec *opendsec.SandboxSpec) (*opendsec.Sandbox, error) {
	if spec.Labels == nil {
		spec.Labels = map[string]string{}
	}
	spec.Labels["opendsec-bench"] = b.label
	sb, err := b.cl.CreateSandbox(ctx, spec)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	b.ids = append(b.ids, sb.Id)
	b.mu.Unlock()
	return sb, nil
}

// cleanup stops every sandbox this run made.
func (b *bench) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	b.mu.Lock()
	ids := b.ids
	b.ids = nil
	b.mu.Unlock()
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := b.cl.StopSandbox(ctx, id); err != nil {
				fmt.Fprintf(os.Stderr, "stop %s: %v\n", id, err)
			}
		}()
	}
	wg.Wait()
}

// dns sends c.queries A queries for one allowed name from a sandbox's
// network namespace to its resolver (the node's DNS proxy) and compares the
// node's RSS before and after.
func (b *bench) dns(ctx context.Context) (section, error) {
	s := section{title: fmt.Sprintf("%d DNS queries for one allowed name", b.c.queries), bound: "node RSS grows less than 5 MiB"}
	if b.c.netnsDir == "" || b.c.nodePID == 0 {
		return s, errors.New("needs -netns-dir and -node-pid")
	}
	const name = "bench.opendsec.test"
	sb, err := b.create(ctx, &opendsec.SandboxSpec{Image: b.c.image, Network: &opendsecv1.NetworkPolicy{Allow: []*opendsecv1.NetworkRule{{Domain: name}}}})
	if err != nil {
		return s, fmt.Errorf("create sandbox: %w", err)
	}
	res, err := b.cl.RunShell(ctx, sb.Id, "cat /etc/resolv.conf")
	if err != nil {
		return s, fmt.Errorf("read resolv.conf: %w", err)
	}
	var resolver string
	for _, l := range strings.Split(res.Stdout, "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == "nameserver" {
			resolver = net.JoinHostPort(f[1], "53")
			break
		}
	}
	if resolver == "" {
		return s, fmt.Errorf("no nameserver in the sandbox's resolv.conf: %q", res.Stdout)
	}
	nsPath := filepath.Join(b.c.netnsDir, sb.Id)
	const workers = 4
	conns := make([]net.Conn, workers)
	for i := range conns {
		if err := benchns.In(nsPath, func() (err error) { conns[i], err = net.Dial("udp4", resolver); return err }); err != nil {
			return s, fmt.Errorf("dial the resolver in the sandbox's namespace: %w", err)
		}
		defer conns[i].Close()
	}
	var ok, refused, failed atomic.Int64
	send := func(n int) {
		var wg sync.WaitGroup
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cl := &dns.Client{Timeout: 5 * time.Second}
				for i := w; i < n && ctx.Err() == nil; i += workers {
					m := new(dns.Msg)
					m.SetQuestion(dns.Fqdn(name), dns.TypeA)
					r, _, err := cl.ExchangeWithConn(m, &dns.Conn{Conn: conns[w]})
					switch {
					case err != nil:
						failed.Add(1)
					case r.Rcode == dns.RcodeSuccess && len(r.Answer) > 0:
						ok.Add(1)
					default:
						refused.Add(1)
					}
				}
			}()
		}
		wg.Wait()
	}
	send(1000) // warm-up: the proxy's paths, the sandbox's set
	ok.Store(0)
	refused.Store(0)
	failed.Store(0)
	rss0, err := rssKiB(b.c.nodePID)
	if err != nil {
		return s, err
	}
	t0 := time.Now()
	send(b.c.queries)
	el := time.Since(t0)
	rss1, err := rssKiB(b.c.nodePID)
	if err != nil {
		return s, err
	}
	if ctx.Err() != nil {
		return s, ctx.Err()
	}
	grow := rss1 - rss0
	s.pass = grow < 5*1024 && ok.Load() >= int64(b.c.queries)*99/100
	s.lines = append(s.lines,
		fmt.Sprintf("queries: %d answered, %d refused, %d failed, in %s (%.0f/s), %d sockets in the sandbox's network namespace", ok.Load(), refused.Load(), failed.Load(), el.Round(time.Millisecond), float64(b.c.queries)/el.Seconds(), workers),
		fmt.Sprintf("node RSS: %d KiB before, %d KiB after: %+d KiB", rss0, rss1, grow),
		"the node's per-sandbox rate limit is raised for this phase (bench/security.sh) so every query reaches the answer cache; at the default (200/s) most would be refused",
	)
	return s, nil
}

// forkbomb runs a fork bomb in b.c.bombs sandboxes at once and samples the
// host's tasks and the sandboxes' parent cgroup; meanwhile it starts one
// more sandbox and runs a command in it.
func (b *bench) forkbomb(ctx context.Context) (section, error) {
	s := section{title: fmt.Sprintf("a fork bomb in each of %d sandboxes", b.c.bombs), bound: "host tasks stay below the sandboxes' PID ceiling plus what ran before; a new sandbox still starts"}
	var sbs []*opendsec.Sandbox
	mem := int64(1024)
	for range b.c.bombs {
		sb, err := b.create(ctx, &opendsec.SandboxSpec{Image: b.c.image, PidsLimit: b.c.bombPids, MemoryMb: &mem})
		if err != nil {
			return s, fmt.Errorf("create sandbox: %w", err)
		}
		sbs = append(sbs, sb)
	}
	parent, err := cgroupParent(sbs[0].Id)
	if err != nil {
		return s, err
	}
	ceiling := readInt(filepath.Join(parent, "pids.max"))
	limit := readInt(filepath.Join(parent, sbs[0].Id, "pids.max"))
	pidMax := readInt("/proc/sys/kernel/pid_max")
	base := tasks()
	bctx, stopBombs := context.WithCancel(ctx)
	defer stopBombs()
	for _, sb := range sbs {
		// The classic bomb collapses in ash (it exits at its first failed
		// fork), so a flood of sleeps keeps the sandbox at its limit too.
		if _, err := b.cl.Exec(bctx, sb.Id, opendsec.ExecOptions{Command: []string{"/bin/sh", "-c", bombScript}}); err != nil {
			return s, fmt.Errorf("start the fork bomb: %w", err)
		}
	}
	var maxTasks, maxParent int64
	sample := func() {
		maxTasks = max(maxTasks, tasks())
		maxParent = max(maxParent, readInt(filepath.Join(parent, "pids.current")))
	}
	type probe struct {
		el  time.Duration
		out string
		err error
	}
	probed := make(chan probe, 1)
	go func() {
		// Let the bombs reach their limits first.
		t := time.NewTimer(b.c.bombTime / 3)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			probed <- probe{err: ctx.Err()}
			return
		}
		t0 := time.Now()
		sb, err := b.create(ctx, &opendsec.SandboxSpec{Image: b.c.image})
		if err != nil {
			probed <- probe{err: fmt.Errorf("create: %w", err)}
			return
		}
		res, err := b.cl.RunShell(ctx, sb.Id, "echo ok")
		if err != nil {
			probed <- probe{err: fmt.Errorf("exec: %w", err)}
			return
		}
		probed <- probe{el: time.Since(t0), out: strings.TrimSpace(res.Stdout)}
	}()
	end := time.Now().Add(b.c.bombTime)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for time.Now().Before(end) && ctx.Err() == nil {
		sample()
		<-tick.C
	}
	p := <-probed
	stopBombs()
	t0 := time.Now()
	b.cleanup()
	stopTime := time.Since(t0)
	if ctx.Err() != nil {
		return s, ctx.Err()
	}
	held := ceiling > 0 && maxParent <= ceiling && maxTasks < base+ceiling && maxTasks < pidMax
	s.pass = held && p.err == nil && p.out == "ok"
	ceil := "max (no ceiling)"
	if ceiling > 0 {
		ceil = strconv.FormatInt(ceiling, 10)
	}
	lim := "max"
	if limit > 0 {
		lim = strconv.FormatInt(limit, 10)
	}
	s.lines = append(s.lines,
		fmt.Sprintf("ceiling: %s pids.max = %s; each sandbox's pids.max = %s; kernel pid_max = %d", parent, ceil, lim, pidMax),
		fmt.Sprintf("host tasks (threads, /proc/loadavg): %d before, at most %d during %s of bombs (sampled every 100 ms)", base, maxTasks, b.c.bombTime),
		fmt.Sprintf("sandboxes' parent cgroup pids.current: at most %d", maxParent),
		fmt.Sprintf("stopping the %d bombed sandboxes (and the probe): %s", b.c.bombs, stopTime.Round(time.Millisecond)),
	)
	if p.err != nil {
		s.lines = append(s.lines, fmt.Sprintf("a new sandbox during the bombs: FAILED: %v", p.err))
	} else {
		s.lines = append(s.lines, fmt.Sprintf("a new sandbox during the bombs: created and ran `echo ok` (printed %q) in %s", p.out, p.el.Round(time.Millisecond)))
	}
	return s, nil
}

// disk fills one sandbox's writable layer with empty files until inodes
// run out, then with bytes until space runs out, and then creates another
// sandbox and writes in it. It refuses to fill when the writable layer has
// no quota of its own (the host's disk would fill).
func (b *bench) disk(ctx context.Context) (section, error) {
	s := section{title: "a disk and inode fill in one sandbox", bound: "another sandbox's create and write still succeed"}
	a, err := b.create(ctx, &opendsec.SandboxSpec{Image: b.c.pyImage})
	if err != nil {
		return s, fmt.Errorf("create sandbox: %w", err)
	}
	m, err := b.cl.SandboxMetrics(ctx, a.Id)
	if err != nil {
		return s, fmt.Errorf("metrics: %w", err)
	}
	quota := m.GetDiskTotalBytes()
	var st unix.Statfs_t
	if err := unix.Statfs("/", &st); err != nil {
		return s, err
	}
	hostFree := int64(st.Bavail) * st.Bsize
	if quota <= 0 || quota > hostFree/2 {
		s.lines = append(s.lines, fmt.Sprintf("the writable layer reports %d MiB total against %d MiB free on the host: no per-sandbox quota, not filling the host's disk", quota>>20, hostFree>>20))
		return s, nil
	}
	// Bytes first (then the file goes: a layer out of inodes could not
	// even open it), then inodes, which stay used.
	t0 := time.Now()
	dd, err := b.cl.RunShell(ctx, a.Id, fmt.Sprintf("dd if=/dev/zero of=/fill-bytes bs=1M count=%d 2>&1 | tail -n 4", quota>>20+64), opendsec.WithTimeout(10*time.Minute))
	if err != nil {
		return s, fmt.Errorf("byte fill: %w", err)
	}
	ddTime := time.Since(t0)
	full, err := b.cl.SandboxMetrics(ctx, a.Id)
	if err != nil {
		return s, fmt.Errorf("metrics: %w", err)
	}
	if _, err := b.cl.RunShell(ctx, a.Id, "rm -f /fill-bytes"); err != nil {
		return s, fmt.Errorf("remove the byte fill: %w", err)
	}
	t0 = time.Now()
	files, err := b.cl.RunShell(ctx, a.Id, `python3 -c '
import os
os.makedirs("/fill-inodes", exist_ok=True)
n = 0
try:
    while n < 20000000:
        open("/fill-inodes/%d" % n, "w").close()
        n += 1
    print(n, "no error")
except OSError as e:
    print(n, os.strerror(e.errno))
'`, opendsec.WithTimeout(10*time.Minute))
	if err != nil {
		return s, fmt.Errorf("inode fill: %w", err)
	}
	inodeTime := time.Since(t0)
	m2, err := b.cl.SandboxMetrics(ctx, a.Id)
	if err != nil {
		return s, fmt.Errorf("metrics: %w", err)
	}
	if err := unix.Statfs("/", &st); err != nil {
		return s, err
	}
	hostFree2 := int64(st.Bavail) * st.Bsize
	t0 = time.Now()
	other, err := b.create(ctx, &opendsec.SandboxSpec{Image: b.c.image})
	var otherOut string
	if err == nil {
		var res *opendsec.Result
		res, err = b.cl.RunShell(ctx, other.Id, "dd if=/dev/zero of=/x bs=1M count=8 2>/dev/null && touch /y && echo ok")
		if err == nil {
			otherOut = strings.TrimSpace(res.Stdout + res.Stderr)
		}
	}
	otherTime := time.Since(t0)
	s.pass = err == nil && otherOut == "ok"
	s.lines = append(s.lines,
		fmt.Sprintf("the sandbox's writable layer: %d MiB quota (metrics disk_total_bytes)", quota>>20),
		fmt.Sprintf("dd of %d MiB: %q in %s; metrics then: disk_used_bytes %d MiB of %d MiB", quota>>20+64, strings.TrimSpace(dd.Stdout), ddTime.Round(time.Millisecond), full.GetDiskUsedBytes()>>20, full.GetDiskTotalBytes()>>20),
		fmt.Sprintf("after removing it, empty files until refused: %s (files created, error) in %s", strings.TrimSpace(files.Stdout+files.Stderr), inodeTime.Round(time.Millisecond)),
		fmt.Sprintf("metrics with the files left: disk_used_bytes %d MiB of %d MiB", m2.GetDiskUsedBytes()>>20, m2.GetDiskTotalBytes()>>20),
		fmt.Sprintf("host free space on /: %d MiB before, %d MiB after", hostFree>>20, hostFree2>>20),
	)
	if err != nil {
		s.lines = append(s.lines, fmt.Sprintf("another sandbox: FAILED: %v", err))
	} else {
		s.lines = append(s.lines, fmt.Sprintf("another sandbox: created, wrote 8 MiB and a file, printed %q, in %s", otherOut, otherTime.Round(time.Millisecond)))
	}
	return s, nil
}

const bombScript = `(b(){ b|b& }; b) 2>/dev/null; while :; do awk 'BEGIN{while(1) system("sleep 600 &")}' 2>/dev/null; done`

// cgroupParent finds the directory holding sandbox id's pids cgroup.
func cgroupParent(id string) (string, error) {
	var found string
	for _, root := range []string{"/sys/fs/cgroup/pids", "/sys/fs/cgroup"} {
		_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil || found != "" {
				return fs.SkipDir
			}
			if !d.IsDir() {
				return nil
			}
			if d.Name() == id {
				found = filepath.Dir(p)
				return fs.SkipAll
			}
			if strings.Count(strings.TrimPrefix(p, root), "/") >= 3 {
				return fs.SkipDir
			}
			return nil
		})
		if found != "" {
			return found, nil
		}
	}
	return "", fmt.Errorf("no pids cgroup named %s under /sys/fs/cgroup", id)
}

// readInt reads a number from a file; "max" and errors read as 0.
func readInt(path string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

// tasks is the number of threads on the host (/proc/loadavg's 4th field).
func tasks() int64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 4 {
		return 0
	}
	_, total, _ := strings.Cut(f[3], "/")
	n, _ := strconv.ParseInt(total, 10, 64)
	return n
}

func rssKiB(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("read the node's status: %w", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, errors.New("no VmRSS in the node's status")
}
