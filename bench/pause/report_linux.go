package main

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

func p50(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func p50i(xs []int64) int64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d.Microseconds())/1000) }

func ratio(a, b time.Duration) string {
	if b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1fx", float64(a)/float64(b))
}

func (r *report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Task pause: latency and memory freed (%s)\n\n", r.when.Format("2006-01-02"))
	fmt.Fprintf(&b, "Revision %s, %s UTC. Host: %s.\n\n", r.c.revision, r.when.Format("15:04"), r.host)
	fmt.Fprintf(&b, "Command: `%s`\n\n", r.c.command)
	if len(r.pause) > 0 {
		fmt.Fprintf(&b, "## Pause and resume vs a bare cgroup freezer\n\n")
		fmt.Fprintf(&b, "%d interleaved rounds (after 5 warm-up rounds) on one busybox sandbox through the public API (Go SDK → apiserver → node → freezer) and on a bare cgroup holding one `sleep` (write FROZEN / THAWED, read until FROZEN).\n\n", len(r.pause))
		fmt.Fprintf(&b, "| operation | OpenDsec p50 | bare freezer p50 | ratio |\n|---|---|---|---|\n")
		fmt.Fprintf(&b, "| pause | %s | %s | %s |\n", ms(p50(r.pause)), ms(p50(r.freeze)), ratio(p50(r.pause), p50(r.freeze)))
		fmt.Fprintf(&b, "| resume | %s | %s | %s |\n\n", ms(p50(r.resume)), ms(p50(r.thaw)), ratio(p50(r.resume), p50(r.thaw)))
	}
	if len(r.runs) > 0 {
		fmt.Fprintf(&b, "## Task pause with reclaim\n\n")
		fmt.Fprintf(&b, "Each run: %d sandboxes of one task (memory_mb %d, cpu 0.1), each running memhog (internal/testutil/memhog) with %d MiB of written anonymous memory, counting every 100 ms; one `PauseTask(task, Reclaim)` call; MemAvailable, swap used and zram's mm_stat before and after; then one `ResumeTask` and, in every sandbox, its counter read (it must go on from its value before the pause) and its memory's CRC checked (which swaps every page back in).\n\n",
			r.runs[0].n, r.c.memoryMB, r.c.mib)
		fmt.Fprintf(&b, "Reading the columns: *reported freed* is what the nodes reported, the drop of each sandbox cgroup's charge in RAM: the %d MiB written plus what else the sandbox holds (its agent, memhog's Go runtime, page cache such as the uploaded binary). *Swap used grew* is what went out to swap. *MemAvailable gained* is the node's net gain: the kernel already counts page cache as available, so dropping cache does not raise it, and zram's compressed copy stays in RAM (*zram RAM used*). *Net RAM saved per MiB written* = MemAvailable gained / MiB of memhog data written.\n\n", r.c.mib)
		fmt.Fprintf(&b, "Patterns: `text` = log-like lines (`step=… reward=0.1234 action=… obs=[…]`, compressible), `random` = ChaCha8 output (incompressible).\n\n")
		fmt.Fprintf(&b, "| swap | pattern | pause_task | resume_task | reported freed (sum) | per sandbox p50 | MemAvailable gained | swap used grew | zram stored / zram RAM used | net RAM saved per MiB written | counters on | memory ok |\n")
		fmt.Fprintf(&b, "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
		for _, rr := range r.runs {
			gained := rr.availPaused - rr.availBefore
			written := int64(rr.n) * int64(r.c.mib) << 20
			z := "-"
			if rr.zramOrigPaused > 0 {
				z = fmt.Sprintf("%s / %s", mib(rr.zramOrigPaused), mib(rr.zramUsedPaused-rr.zramUsedBefore))
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %.2f | %d/%d | %d/%d |\n",
				rr.swap, rr.pattern, rr.pauseTook.Round(time.Millisecond), rr.resumeTook.Round(time.Millisecond),
				mib(rr.reported), mib(p50i(rr.perSandbox)), mib(gained), mib(rr.swapPaused-rr.swapBefore), z,
				float64(gained)/float64(max(written, 1)), rr.continued, rr.n, rr.memoryOK, rr.n)
		}
		fmt.Fprintln(&b)
		for _, rr := range r.runs {
			fmt.Fprintf(&b, "- %s/%s: setup (create, upload memhog, start, first count) %s; MemAvailable %s before, %s paused, %s after the resume and the memory checks; %d failures",
				rr.swap, rr.pattern, rr.setup.Round(time.Second), mib(rr.availBefore), mib(rr.availPaused), mib(rr.availResumed), rr.failures)
			if rr.startedOver > 0 {
				fmt.Fprintf(&b, "; %d counters STARTED OVER", rr.startedOver)
			}
			notes := make([]string, 0, len(rr.notes))
			for n, c := range rr.notes {
				notes = append(notes, fmt.Sprintf("%d× %q", c, n))
			}
			sort.Strings(notes)
			if len(notes) > 0 {
				fmt.Fprintf(&b, "; notes: %s", strings.Join(notes, ", "))
			}
			fmt.Fprintln(&b, ".")
		}
		fmt.Fprintln(&b)
	}
	for _, n := range r.notes {
		fmt.Fprintf(&b, "Note: %s\n\n", n)
	}
	return b.String()
}
