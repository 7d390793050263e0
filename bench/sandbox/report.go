package main

import (
	"fmt"
	"strings"
	"time"
)

// Targets of issue 2.
const (
	targetCreateRatio = 1.5
	targetExecRatio   = 0.5
	targetIdleBytes   = 8 << 20
)

type report struct {
	cfg     config
	machine machine
	started time.Time
	elapsed time.Duration
	// hostPerSandbox is the host MemAvailable drop per idle sandbox.
	hostPerSandbox int64

	loadStart, loadEnd string // /proc/loadavg around the run

	createPool             poolSeries // default creates
	createCold, createRunc series     // skip_warm_pool; runc run
	// time to first command: totals by kind, and each total's first part
	// (create; runc run) and exec part (first Exec+Wait; runc exec)
	fcPool                        poolSeries
	fcCold, fcRunc                series
	fcFirst, fcExec               [numKinds]series
	execOurs, execRunc, shellOurs series
	execErrs                      []string
	// pause and resume through the API; the freezer written directly
	pauseOurs, resumeOurs, freezeRaw, thawRaw series
	mem                                       []memSample
	concOurs                                  poolSeries
	concWall                                  time.Duration
	concN                                     int
	concErrs                                  []string

	// exec true: into the running sandbox, into the paused one (an
	// auto-resume first), and an explicit resume then the exec
	arRunning, arAuto, arExplicit series

	// create breakdown: ours, and our config.json replayed by hand
	bdOurs, bdCreate, bdStart, bdAgent, bdSum series
}

func ratio(a, b time.Duration) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

func verdict(ok bool) string {
	if ok {
		return "**met**"
	}
	return "**NOT met**"
}

// idleServerStats counts the idle sandboxes whose agent server still ran
// and gives the first-exec latencies after the idle spell: all, and (as
// text) the p50 of those whose server had exited.
func (r *report) idleServerStats() (running int, all series, idle string) {
	var exited series
	for _, s := range r.mem {
		all = append(all, s.firstExecAfterSample)
		if s.serverPid > 0 {
			running++
		} else {
			exited = append(exited, s.firstExecAfterSample)
		}
	}
	if len(exited) == 0 {
		return running, all, "no server had exited"
	}
	return running, all, ms(exited.percentile(50)) + " ms"
}

func (r *report) memPssFileMedian() int64 {
	v := make([]int64, len(r.mem))
	for i, s := range r.mem {
		v[i] = s.cgUsage + s.agentPssFile
	}
	return medianInt64(v)
}

func (r *report) memMedians() (usage, anon, file, kmem, rss, rssAnon, rssFile, sum int64) {
	col := func(f func(memSample) int64) int64 {
		v := make([]int64, len(r.mem))
		for i, s := range r.mem {
			v[i] = f(s)
		}
		return medianInt64(v)
	}
	return col(func(s memSample) int64 { return s.cgUsage }),
		col(func(s memSample) int64 { return s.cgAnon }),
		col(func(s memSample) int64 { return s.cgFile }),
		col(func(s memSample) int64 { return s.cgKmem }),
		col(func(s memSample) int64 { return s.agentRSS }),
		col(func(s memSample) int64 { return s.agentAnon }),
		col(func(s memSample) int64 { return s.agentFi }),
		col(func(s memSample) int64 { return s.cgUsage + s.agentRSS })
}

func (r *report) markdown() string {
	var w strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&w, format+"\n", args...) }
	m := r.machine
	p("# OpenDsec core benchmark, %s", r.started.Format("2006-01-02 15:04 MST"))
	p("")
	p("Container sandboxes (`root/busybox` image) through the public API, side by side with plain `runc` of the same rootfs, in one run.")
	p("")
	p("## Machine")
	p("")
	p("| | |")
	p("|---|---|")
	p("| nproc | %d |", m.nproc)
	p("| cpu | %s |", m.cpuModel)
	p("| memory | %s |", m.memTotal)
	p("| kernel | %s |", m.kernel)
	p("| os | %s |", m.osID)
	p("| cgroups | %s |", m.cgroupMode)
	p("| runc --version | %s |", m.runcVersion)
	p("| bench built with | %s |", m.goVersion)
	if r.cfg.revision != "" {
		p("| source revision | %s |", r.cfg.revision)
	}
	p("")
	p("Command:")
	p("")
	p("```")
	p("%s", r.cfg.command)
	p("```")
	p("")
	p("Load average (1/5/15 min) at start: %s; at end: %s. The machine is shared; a load near or above nproc means other work", r.loadStart, r.loadEnd)
	p("competed with this run (both sides of every interleaved comparison alike).")
	p("")
	p("Whole run: %s. Sandbox and baseline limits: %d MiB memory (no swap), %g CPU, %d pids.",
		r.elapsed.Round(time.Second), r.cfg.lim.memoryMB, r.cfg.lim.cpu, r.cfg.lim.pids)
	p("")

	runcP50 := r.createRunc.percentile(50)
	crPool := ratio(r.createPool.all.percentile(50), runcP50)
	crCold := ratio(r.createCold.percentile(50), runcP50)
	er := ratio(r.execOurs.percentile(50), r.execRunc.percentile(50))
	usage, anon, file, kmem, rss, rssAnon, rssFile, sum := r.memMedians()
	concOK := len(r.concErrs) == 0 && len(r.concOurs.all) == r.concN
	p("## Targets (issue 2)")
	p("")
	p("| metric | ours | baseline | value | target | |")
	p("|---|---|---|---|---|---|")
	p("| create p50 (warm pool; %s) / `runc run` p50 | %s ms | %s ms | %.2fx | <= %.1fx | %s |",
		r.createPool.hitText(), ms(r.createPool.all.percentile(50)), ms(runcP50), crPool, targetCreateRatio, verdict(crPool <= targetCreateRatio))
	p("| create p50 (cold, skip_warm_pool) / `runc run` p50 | %s ms | %s ms | %.2fx | <= %.1fx | %s |",
		ms(r.createCold.percentile(50)), ms(runcP50), crCold, targetCreateRatio, verdict(crCold <= targetCreateRatio))
	if len(r.fcRunc) > 0 {
		fcRunc := r.fcRunc.percentile(50)
		p("| time to first command p50 (warm pool; %s) / `runc run` + `runc exec` p50 | %s ms | %s ms | %.2fx | no target | |",
			r.fcPool.hitText(), ms(r.fcPool.all.percentile(50)), ms(fcRunc), ratio(r.fcPool.all.percentile(50), fcRunc))
		p("| time to first command p50 (cold) / `runc run` + `runc exec` p50 | %s ms | %s ms | %.2fx | no target | |",
			ms(r.fcCold.percentile(50)), ms(fcRunc), ratio(r.fcCold.percentile(50), fcRunc))
	}
	p("| exec `true` p50 / `runc exec` p50 | %s ms | %s ms | %.2fx | <= %.1fx | %s |",
		ms(r.execOurs.percentile(50)), ms(r.execRunc.percentile(50)), er, targetExecRatio, verdict(er <= targetExecRatio))
	if len(r.pauseOurs) > 0 {
		p("| pause p50 / freezer write p50 | %s ms | %s ms | %.2fx | no target | |",
			ms(r.pauseOurs.percentile(50)), ms(r.freezeRaw.percentile(50)), ratio(r.pauseOurs.percentile(50), r.freezeRaw.percentile(50)))
		p("| resume p50 / freezer write p50 | %s ms | %s ms | %.2fx | no target | |",
			ms(r.resumeOurs.percentile(50)), ms(r.thawRaw.percentile(50)), ratio(r.resumeOurs.percentile(50), r.thawRaw.percentile(50)))
	}
	if len(r.arAuto) > 0 {
		p("| exec `true` into a paused sandbox (auto-resume) p50 / exec into it running p50 | %s ms | %s ms | %.2fx | no target | |",
			ms(r.arAuto.percentile(50)), ms(r.arRunning.percentile(50)), ratio(r.arAuto.percentile(50), r.arRunning.percentile(50)))
		p("| exec `true` into a paused sandbox (auto-resume) p50 / ResumeSandbox + exec p50 | %s ms | %s ms | %.2fx | no target | |",
			ms(r.arAuto.percentile(50)), ms(r.arExplicit.percentile(50)), ratio(r.arAuto.percentile(50), r.arExplicit.percentile(50)))
	}
	p("| our execs that failed | %d of %d | | | | %s |", len(r.execErrs), 2*r.cfg.execs, verdict(len(r.execErrs) == 0))
	p("| idle sandbox, cgroup-accounted (median) | %s MiB | | | <= 8 MiB | %s |", mib(usage), verdict(usage <= targetIdleBytes))
	idleServers, firstExec, firstExecIdle := r.idleServerStats()
	p("| idle sandbox, init + agent server VmRSS (median; RssAnon %s + RssFile %s; servers still running: %d of %d) | %s MiB | | | | |", mib(rssAnon), mib(rssFile), idleServers, len(r.mem), mib(rss))
	p("| idle sandbox, cgroup + init/server VmRSS (median; counts their anon twice) | %s MiB | | | <= 8 MiB | %s |", mib(sum), verdict(sum <= targetIdleBytes))
	p("| idle sandbox, cgroup + init/server share of mapped file pages (median; cgroup usage + Pss_File) | %s MiB | | | <= 8 MiB | %s |", mib(r.memPssFileMedian()), verdict(r.memPssFileMedian() <= targetIdleBytes))
	p("| first exec `true` after the idle spell (p50 all; p50 where the server had exited) | %s ms; %s | | | | |", ms(firstExec.percentile(50)), firstExecIdle)
	p("| idle sandbox, host MemAvailable drop per sandbox (%d idle sandboxes; noisy) | %s MiB | | | | |", len(r.mem), mib(r.hostPerSandbox))
	p("| %d concurrent creates all succeed | %d/%d running | | | all | %s |", r.concN, len(r.concOurs.all), r.concN, verdict(concOK))
	p("")

	p("## Create latency (sequential; warm pool, cold and runc interleaved)")
	p("")
	p("Ours: `CreateSandbox` through the apiserver, client-measured. It returns once the sandbox runs and its agent's socket")
	p("listens: the node binds the agent's unix socket before `runc start` and hands it to the sandbox's init, so a first")
	p("request waits in the socket's backlog; the agent's own start overlaps the answer (see \"Time to first command\" for")
	p("whether that cost reappears in the first exec). Two kinds:")
	p("")
	p("- **warm pool** (a default create): the node keeps a few prestarted sandboxes per shape (image, limits, user, workdir,")
	p("  network rules) it has seen recently, already `runc create`d (namespaces, mounts, cgroups in place, nothing running).")
	p("  A matching create takes one and only lets it run (it reads runc's exec fifo, all `runc start` does) with the caller's env; the pool refills in")
	p("  the background at low CPU priority. %s; a miss is a cold create.", r.createPool.hitText())
	p("- **cold** (`skip_warm_pool`): made from scratch: image hold, overlay mount, network namespace and policy,")
	p("  config.json with seccomp, `runc run --detach`, table writes.")
	p("")
	p("Baseline: `runc --root <tmp> run --detach --bundle <b> <id>` of `/bin/sleep` until it returns; the overlay mount")
	p("(same rootfs as lowerdir, fresh upper/work) and config.json are made before the timer starts, `runc delete --force` and")
	p("umount after it stops. Baseline config: `runc spec`, with root path, terminal false, readonly false, our namespaces")
	p("(pid, mount, uts, ipc, net, cgroup) and our memory/cpu/pids limits; no seccomp profile (runc spec has none).")
	p("")
	p("Each round times one of each kind, in an order that rotates every round. Our stops and the baseline's deletes happen")
	p("outside the timed parts. Before every timed operation the benchmark pauses %s (`-settle`): benchmark methodology,", r.cfg.settle)
	p("not synchronisation, so that each measurement starts on a machine where the pool refill and the previous teardown")
	p("are done, as for a caller whose creates are not back to back (with 2 cores, a refill running at the same moment")
	p("would compete with the create being timed). Untimed warm-up rounds first: %d.", r.cfg.warmup)
	p("")
	names := []string{"ours, warm pool (all default creates)"}
	ss := []series{r.createPool.all}
	if len(r.createPool.hits) > 0 && len(r.createPool.misses) > 0 {
		names = append(names, "ours, warm pool: the pool hits", "ours, warm pool: the misses (made cold)")
		ss = append(ss, r.createPool.hits, r.createPool.misses)
	}
	names = append(names, "ours, cold (skip_warm_pool)", "runc run --detach")
	ss = append(ss, r.createCold, r.createRunc)
	r.seriesTable(p, names, ss)
	p("- create p50 (warm pool) / `runc run` p50: %.2fx; target <= %.1fx: %s.", crPool, targetCreateRatio, verdict(crPool <= targetCreateRatio))
	p("- create p50 (cold, skip_warm_pool) / `runc run` p50: %.2fx; target <= %.1fx: %s.", crCold, targetCreateRatio, verdict(crCold <= targetCreateRatio))
	p("")

	if len(r.fcRunc) > 0 {
		fcRunc := r.fcRunc.percentile(50)
		p("## Time to first command (sequential; warm pool, cold and runc interleaved)")
		p("")
		p("Ours: `CreateSandbox` + the first `Exec([\"true\"])` + `Wait`, client-measured from the create call to the exit")
		p("code, warm pool (default create; %s) and cold (`skip_warm_pool`). Baseline: `runc run --detach`", r.fcPool.hitText())
		p("+ `runc exec <id> true` of the same rootfs and config as the create baseline, until the exec returns. Rounds,")
		p("rotation, settle gap and untimed stops as above. Our create returns before the agent has answered, so this is where")
		p("a cost moved out of the create would show: the \"first exec\" rows below against the steady-state exec round trip")
		p("(next sections).")
		p("")
		r.seriesTable(p, []string{"ours, warm pool: create + first exec", "ours, cold: create + first exec", "runc run + runc exec",
			"ours, warm pool: the create", "ours, warm pool: the first exec", "ours, cold: the create", "ours, cold: the first exec",
			"runc run", "runc exec (first)"},
			[]series{r.fcPool.all, r.fcCold, r.fcRunc, r.fcFirst[kindPool], r.fcExec[kindPool], r.fcFirst[kindCold], r.fcExec[kindCold],
				r.fcFirst[kindRunc], r.fcExec[kindRunc]})
		p("- warm pool / runc: p50 %.2fx, p95 %.2fx.", ratio(r.fcPool.all.percentile(50), fcRunc), ratio(r.fcPool.all.percentile(95), r.fcRunc.percentile(95)))
		p("- cold / runc: p50 %.2fx, p95 %.2fx.", ratio(r.fcCold.percentile(50), fcRunc), ratio(r.fcCold.percentile(95), r.fcRunc.percentile(95)))
		p("- first exec after create p50 (warm pool %s ms, cold %s ms) vs steady-state `Exec true` p50 %s ms (exec section).",
			ms(r.fcExec[kindPool].percentile(50)), ms(r.fcExec[kindCold].percentile(50)), ms(r.execOurs.percentile(50)))
		p("")
	}

	if len(r.bdOurs) > 0 {
		p("### Where our cold create time goes")
		p("")
		p("Ours here is the cold create (`skip_warm_pool`), with the settle gap before each timed step. The config.json our")
		p("node wrote for a sandbox (seccomp profile, masked paths, agent bind mount, tmpfs mounts), replayed by hand on a")
		p("fresh overlay of the same rootfs: `runc create` (the agent's socket bound and listening before the timer")
		p("starts and handed to init with `--preserve-fds 1`, as the node does), `runc start`, then the agent's first `/health`")
		p("answer on its unix socket, polled every 1 ms (a request waits in the socket's backlog until the agent accepts it).")
		p("Interleaved with real `CreateSandbox` calls (ours). Ours returns after `runc start` without waiting for the agent, so")
		p("the replay's create + start is its peer and the agent's start is shown apart: it overlaps the answer. What ours costs")
		p("beyond the replay's create + start is the API path: client → apiserver → node, image hold, mounts, network, bbolt")
		p("table writes and the answer back.")
		p("")
		r.seriesTable(p, []string{"ours CreateSandbox (cold)", "runc create (our config)", "runc start", "replay create + start", "agent /health after start (overlaps the answer)"},
			[]series{r.bdOurs, r.bdCreate, r.bdStart, r.bdSum, r.bdAgent})
		over := r.bdOurs.percentile(50) - r.bdSum.percentile(50)
		p("- API path and node overhead, p50 ours - p50 replay create + start: %s ms (%.0f%% of ours' p50).", ms(over), 100*ratio(over, r.bdOurs.percentile(50)))
		p("- Our config vs `runc spec`'s: p50 `runc create` (our config) + `runc start` - p50 `runc run` (section above): %s ms.",
			ms(r.bdCreate.percentile(50)+r.bdStart.percentile(50)-runcP50))
		p("")
	}

	p("## Exec round trip of `true` (interleaved)")
	p("")
	p("Ours: `Exec([\"true\"])` + `Wait` (client → apiserver → node → agent over its unix socket → fork/exec in the sandbox → exit")
	p("code streamed back), and `RunShell(\"true\")` (`/bin/sh -c true`, output collected). Baseline: `runc --root <tmp> exec <id> true`")
	p("in a running `runc run` container of the same rootfs, until it returns. One sandbox and one container for the whole phase.")
	p("")
	r.seriesTable(p, []string{"ours Exec true", "runc exec true", "ours RunShell true"}, []series{r.execOurs, r.execRunc, r.shellOurs})
	if len(r.pauseOurs) > 0 {
		p("")
		p("Pause and resume, %d interleaved rounds: ours through the public API (apiserver → node → freezer, recorded in the node's table) and a freezer write of a plain runc container (write, then read until the kernel reports the state).", len(r.pauseOurs))
		p("")
		r.seriesTable(p, []string{"ours PauseSandbox", "freezer FROZEN", "ours ResumeSandbox", "freezer THAWED"}, []series{r.pauseOurs, r.freezeRaw, r.resumeOurs, r.thawRaw})
	}
	if len(r.arAuto) > 0 {
		p("")
		p("Auto-resume, %d interleaved rounds on one sandbox: exec `true` into it running; paused, exec `true` (the node resumes it first, then the exec runs); paused, an explicit `ResumeSandbox` then exec `true` (timed together). The pauses are not timed.", len(r.arAuto))
		p("")
		r.seriesTable(p, []string{"exec, running", "exec, paused (auto-resume)", "ResumeSandbox + exec"}, []series{r.arRunning, r.arAuto, r.arExplicit})
	}
	if len(r.execErrs) > 0 {
		p("**%d of our execs failed** (left out of the latencies above):", len(r.execErrs))
		p("")
		for _, e := range r.execErrs {
			p("- %s", e)
		}
		p("")
	}

	p("## Idle sandbox memory (host side)")
	p("")
	p("%d sandboxes, read after %s idle. Columns:", len(r.mem), r.cfg.idleWait)
	p("")
	p("- **cgroup usage**: what the kernel charges the sandbox's memory cgroup (`%s/<id>`): v1 `memory.usage_in_bytes`,", r.cfg.cgParent)
	p("  v2 `memory.current`. Includes the agent's anonymous memory and page cache charged to the sandbox (overlay upper, tmpfs,")
	p("  file pages first touched by it). This is what the sandbox's memory limit acts on.")
	p("- **anon / cache**: its `memory.stat` breakdown (v1 `total_rss` / `total_cache`, v2 `anon` / `file`).")
	p("- **kmem**: kernel memory (v1 `memory.kmem.usage_in_bytes`, v2 `kernel`), already inside cgroup usage.")
	p("- **VmRSS**: resident set of the container's init (opendsec-init, PID 1 inside, from `runc --root %s state <id>`)", r.cfg.stateRoot)
	p("  plus, when it still runs, the agent server (init's child; it exits after `node.agent_idle_exit_ms` idle and init")
	p("  starts it again on the next connection), from `/proc/<pid>/status`, split into RssAnon and RssFile (**init** and")
	p("  **server** give each one's VmRSS; server `-` = exited). RssFile is mostly the static binaries' pages, shared by all")
	p("  sandboxes through the host page cache. Their anon pages are counted in cgroup usage too, so")
	p("  **cgroup + VmRSS** double-counts them: an upper bound.")
	p("- **Pss_File**: their proportional share of the file pages they map (`/proc/<pid>/smaps_rollup`")
	p("  Pss_File + Pss_Shmem): the binaries' resident pages divided among every process mapping them. **cgroup +")
	p("  Pss_File** is what one more idle sandbox costs in memory, without counting anything twice.")
	p("- **1st exec**: one `true` exec right after the sample; where the server had exited it includes starting it.")
	p("- **host drop**: MemAvailable (`/proc/meminfo`) before the idle sandboxes were created minus after they idled, per")
	p("  sandbox. Everything the host spends (kernel objects, node bookkeeping, page tables) but noisy: anything else on")
	p("  the machine moves it.")
	p("")
	p("| sandbox | procs | cgroup usage | anon | cache | kmem | init | server | VmRSS | RssAnon | RssFile | Pss_File | cgroup + VmRSS | cgroup + Pss_File | 1st exec |")
	p("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, s := range r.mem {
		server := "-"
		if s.serverPid > 0 {
			server = mib(s.serverRSS)
		}
		p("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s ms |", s.id, s.procs, mib(s.cgUsage), mib(s.cgAnon), mib(s.cgFile),
			mibOrNA(s.cgKmem), mib(s.initRSS), server, mib(s.agentRSS), mib(s.agentAnon), mib(s.agentFi), mib(s.agentPssFile), mib(s.cgUsage+s.agentRSS), mib(s.cgUsage+s.agentPssFile), ms(s.firstExecAfterSample))
	}
	p("| **median (MiB)** | | **%s** | %s | %s | %s | | | **%s** | %s | %s | | **%s** | **%s** | |", mib(usage), mib(anon), mib(file), mibOrNA(kmem), mib(rss), mib(rssAnon), mib(rssFile), mib(sum), mib(r.memPssFileMedian()))
	p("")

	p("## %d concurrent creates", r.concN)
	p("")
	p("Default creates, all started at once from %d goroutines sharing one client; each create is client-measured; \"all", r.concN)
	p("running\" is the time from the start until the last create returned (each returns once its sandbox runs and its")
	p("agent's socket listens; each is then confirmed running with `GetSandbox`). A burst larger than the node's warm pool")
	p("takes what the pool holds and the rest fall back to cold creates: %s.", r.concOurs.hitText())
	p("")
	p("| | |")
	p("|---|---|")
	p("| succeeded and running | %d/%d |", len(r.concOurs.all), r.concN)
	p("| time until all running | %s ms |", ms(r.concWall))
	p("| took a warm-pool sandbox | %d of %d |", len(r.concOurs.hits), len(r.concOurs.all))
	p("| per-create p50 | %s ms |", ms(r.concOurs.all.percentile(50)))
	p("| per-create p95 | %s ms |", ms(r.concOurs.all.percentile(95)))
	p("| per-create max | %s ms |", ms(r.concOurs.all.max()))
	for _, e := range r.concErrs {
		p("| error | %s |", strings.ReplaceAll(e, "|", `\|`))
	}
	p("")
	return w.String()
}

func (r *report) seriesTable(p func(string, ...any), names []string, ss []series) {
	p("| | n | p50 ms | p95 ms | min ms | mean ms | max ms |")
	p("|---|---|---|---|---|---|---|")
	for i, s := range ss {
		p("| %s | %d | %s | %s | %s | %s | %s |", names[i], len(s), ms(s.percentile(50)), ms(s.percentile(95)), ms(s.min()), ms(s.mean()), ms(s.max()))
	}
	p("")
}

func mibOrNA(b int64) string {
	if b < 0 {
		return "n/a"
	}
	return mib(b)
}
