package main

import (
	"fmt"
	"os"
	goruntime "runtime"
	"slices"
	"strings"
	"time"
)

// writeReport merges the modes' results into the markdown report.
func writeReport(c config, paths []string) error {
	var b strings.Builder
	host, _ := os.Hostname()
	fmt.Fprintf(&b, "# Burst: one batch of small sandboxes vs a `runc run` loop\n\n")
	fmt.Fprintf(&b, "%s, host %s, %d CPUs. Command: `%s`\n\n", time.Now().UTC().Format("2006-01-02 15:04 UTC"), host, goruntime.NumCPU(), c.command)
	var mains []*result
	for _, p := range paths {
		r, err := readResult(p)
		if err != nil {
			return err
		}
		switch r.Mode {
		case "main":
			runcEach := pct(r.RuncRunMS, 50)
			runcRate := 1000 / runcEach
			created := len(r.ArrivalMS)
			rate := float64(created) / (r.BatchTotalMS / 1000)
			stopRate := float64(len(r.StopMS)) / (r.StopTotalMS / 1000)
			title := ""
			if r.Name != "" {
				title = ": " + r.Name
			}
			fmt.Fprintf(&b, "## Create and stop (cpu %g, %d MiB each), side by side%s\n\n", r.CPU, r.MemMB, title)
			fmt.Fprintf(&b, "| | count | total | throughput | per sandbox p50 / p95 |\n|---|---|---|---|---|\n")
			fmt.Fprintf(&b, "| `runc run --detach` loop, sequential | %d | %.0f ms | %.1f /s | %.1f / %.1f ms |\n",
				len(r.RuncRunMS), r.RuncTotalMS, runcRate, runcEach, pct(r.RuncRunMS, 95))
			fmt.Fprintf(&b, "| one BatchCreateSandboxes | %d (%d failed) | %.0f ms | %.1f /s | node %.1f / %.1f ms; result arrival %.0f / %.0f ms after the call |\n",
				created, r.Failed, r.BatchTotalMS, rate, pct(r.NodeTotalMS, 50), pct(r.NodeTotalMS, 95), pct(r.ArrivalMS, 50), pct(r.ArrivalMS, 95))
			fmt.Fprintf(&b, "| StopSandbox of all, %d in flight | %d | %.0f ms | %.1f /s | %.1f / %.1f ms |\n\n",
				c.stopConcurrency, len(r.StopMS), r.StopTotalMS, stopRate, pct(r.StopMS, 50), pct(r.StopMS, 95))
			fmt.Fprintf(&b, "Batch create throughput / sequential runc run: **%.2fx**. Stop throughput / create throughput: **%.2fx**.\n\n", rate/runcRate, stopRate/rate)
			fmt.Fprintf(&b, "The node's OCI runtime: %s. The baseline is always `runc run` (issue 12).\n\n", ociText(r.OCIRuntime))
			if len(r.QuietMS) == 2 {
				fmt.Fprintf(&b, "Each side started on a quiet machine (sync, then the kernel's count of network namespaces steady for 2 s): waited %.1f s before the runc loop and %.1f s before the batch.\n\n", r.QuietMS[0]/1000, r.QuietMS[1]/1000)
			}
			fmt.Fprintf(&b, "Cold: skip_warm_pool %v; %d of %d creates came from the warm pool (node log). ", r.SkipWarmPool, r.FromPool, len(r.NodeTotalMS))
			if len(r.NodeStartMS) == 0 {
				fmt.Fprintf(&b, "No cold creates.\n\n")
			} else {
				fmt.Fprintf(&b, "Node phases of the cold creates, p50 (first tenth / last tenth of the batch): net %.1f (%.1f / %.1f) ms, prepare %.1f (%.1f / %.1f) ms, start (`<oci runtime> run`) %.1f (%.1f / %.1f) ms.\n\n",
					pct(r.NodeNetMS, 50), pctPart(r.NodeNetMS, false), pctPart(r.NodeNetMS, true),
					pct(r.NodeCreateMS, 50), pctPart(r.NodeCreateMS, false), pctPart(r.NodeCreateMS, true),
					pct(r.NodeStartMS, 50), pctPart(r.NodeStartMS, false), pctPart(r.NodeStartMS, true))
			}
			if r.BatchCPU != nil && created > 0 {
				n := float64(created)
				fmt.Fprintf(&b, "CPU per create during the batch (/proc): ")
				if r.BatchCPU.Self > 0 {
					fmt.Fprintf(&b, "`opendsec up` (apiserver and node) **%.1f ms**, its waited-for children (`runc run`) %.1f ms; ",
						r.BatchCPU.Self/n, r.BatchCPU.Children/n)
				}
				fmt.Fprintf(&b, "the whole host %.1f ms (%d CPUs busy %.0f%% of the batch).\n\n",
					r.BatchCPU.HostBusy/n, goruntime.NumCPU(), 100*r.BatchCPU.HostBusy/r.BatchTotalMS/float64(goruntime.NumCPU()))
			}
			if r.Inits > 0 {
				fmt.Fprintf(&b, "Right after the batch: %d opendsec-init processes with **%d threads** (%.2f each).\n\n",
					r.Inits, r.InitThreads, float64(r.InitThreads)/float64(r.Inits))
			}
			if r.BatchInodes != nil && created > 0 {
				fmt.Fprintf(&b, "Inodes in use on the data dir's file system: %+d during the batch, **%.1f per create** (statfs; other work on that file system counts too).\n\n",
					*r.BatchInodes, float64(*r.BatchInodes)/float64(created))
			}
			if r.Prewarm {
				total := r.PrewarmMS + r.BatchTotalMS
				totalRate := float64(created) / (total / 1000)
				fmt.Fprintf(&b, "Prewarm: PrewarmSandboxes of %d (wait) right before the batch: held %d, %d ready after **%.0f ms**%s. ",
					r.Count, r.PrewarmHeld, r.PrewarmReady, r.PrewarmMS, reasonText(r.PrewarmReason))
				fmt.Fprintf(&b, "Prewarmed creates hide the prestart cost: it is paid in the prewarm, before the batch starts. "+
					"Batch alone %.1f /s (**%.2fx** the runc loop); prewarm + batch %.0f ms, %.1f /s (**%.2fx** the runc loop).\n\n",
					rate, rate/runcRate, total, totalRate, totalRate/runcRate)
			}
			if r.FirstError != "" {
				fmt.Fprintf(&b, "First failure: `%s`\n\n", r.FirstError)
			}
			mains = append(mains, r)
		case "kill":
			fmt.Fprintf(&b, "## Kill -9 mid-batch, then the same request again\n\n")
			fmt.Fprintf(&b, "Batch of %d with request_id `%s`: `opendsec up` (apiserver, and the node with it) got SIGKILL after %d results (%.0f ms into the call).\n\n",
				r.Count, r.RequestID, r.Received, r.BatchTotalMS)
		case "retry":
			fmt.Fprintf(&b, "Restart until ready (the node re-attaching every sandbox it has): %.1f s.\n\n", float64(r.RestartMS)/1000)
			fmt.Fprintf(&b, "Then the same BatchCreateSandboxes (same request_id) again: %d results, %d failed, %.0f ms. Afterwards %d sandboxes listed with the batch's label, %d distinct, %d running (want exactly %d). Stopped them in %.0f ms.\n\n",
				len(r.ArrivalMS), r.Failed, r.BatchTotalMS, r.Listed, r.Distinct, r.Running, r.Count, r.StopTotalMS)
			if r.FirstError != "" {
				fmt.Fprintf(&b, "First failure: `%s`\n\n", r.FirstError)
			}
		}
	}
	if len(mains) > 1 {
		fmt.Fprintf(&b, "## Side by side\n\n| run | node's OCI runtime | runc loop p50 | batch | batch throughput | batch / runc loop | node start p50 | stop |\n|---|---|---|---|---|---|---|---|\n")
		for _, r := range mains {
			rate := float64(len(r.ArrivalMS)) / (r.BatchTotalMS / 1000)
			fmt.Fprintf(&b, "| %s | %s | %.1f ms (%.1f /s) | %d in %.0f ms | %.1f /s | **%.2fx** | %.1f ms | %.1f /s |\n", r.Name, ociText(r.OCIRuntime), pct(r.RuncRunMS, 50), 1000/pct(r.RuncRunMS, 50),
				len(r.ArrivalMS), r.BatchTotalMS, rate, rate*pct(r.RuncRunMS, 50)/1000, pct(r.NodeStartMS, 50), float64(len(r.StopMS))/(r.StopTotalMS/1000))
		}
		fmt.Fprintln(&b)
		b.WriteString(repeatMedians(mains))
	}
	if slices.ContainsFunc(mains, func(r *result) bool { return r.Prewarm }) {
		fmt.Fprintf(&b, "## Cold and prewarmed, side by side\n\n")
		fmt.Fprintf(&b, "Prewarmed creates hide the prestart cost (paid during the prewarm, while a trainer would compute); the total column includes it.\n\n")
		fmt.Fprintf(&b, "| run | runc loop p50 | prewarm (wait) | batch | batch throughput | batch / runc loop | prewarm + batch | total throughput | total / runc loop | from warm pool |\n|---|---|---|---|---|---|---|---|---|---|\n")
		for _, r := range mains {
			created := len(r.ArrivalMS)
			runcRate := 1000 / pct(r.RuncRunMS, 50)
			rate := float64(created) / (r.BatchTotalMS / 1000)
			total := r.PrewarmMS + r.BatchTotalMS
			totalRate := float64(created) / (total / 1000)
			pw := "none (cold)"
			if r.Prewarm {
				pw = fmt.Sprintf("%d held in %.0f ms", r.PrewarmHeld, r.PrewarmMS)
			}
			fmt.Fprintf(&b, "| %s | %.1f ms (%.1f /s) | %s | %d in %.0f ms (%d failed) | %.1f /s | **%.2fx** | %.0f ms | %.1f /s | **%.2fx** | %d of %d |\n",
				r.Name, pct(r.RuncRunMS, 50), runcRate, pw, created, r.BatchTotalMS, r.Failed, rate, rate/runcRate, total, totalRate, totalRate/runcRate, r.FromPool, len(r.NodeTotalMS))
		}
		fmt.Fprintln(&b)
	}
	fmt.Print(b.String())
	if c.out == "" {
		return nil
	}
	if err := os.WriteFile(c.out, []byte(b.String()), 0o644); err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	return nil
}

// ociText names the node's OCI runtime for the report.
func ociText(s string) string {
	if s == "" {
		return "runc (the node's log names none: a node from before oci_runtime)"
	}
	return s
}

func reasonText(s string) string {
	if s == "" {
		return ""
	}
	return " (" + s + ")"
}

// pctPart is the p50 of the first (last: the last) tenth of v, in batch
// order: how a phase grows with the sandboxes already running.
func pctPart(v []float64, last bool) float64 {
	n := len(v) / 10
	if n == 0 {
		return pct(v, 50)
	}
	if last {
		return pct(v[len(v)-n:], 50)
	}
	return pct(v[:n], 50)
}

// repeatMedians says, for each revision run more than once (REPEAT: names
// "<rev> #<i>"), the medians of its runs: the same-run ratio, the runc
// loop's p50 and the batch's throughput.
func repeatMedians(mains []*result) string {
	type runs struct{ ratio, runc, rate []float64 }
	by := map[string]*runs{}
	var order []string
	for _, r := range mains {
		name, _, ok := strings.Cut(r.Name, " #")
		if !ok || r.BatchTotalMS <= 0 {
			continue
		}
		g := by[name]
		if g == nil {
			g = &runs{}
			by[name] = g
			order = append(order, name)
		}
		rate := float64(len(r.ArrivalMS)) / (r.BatchTotalMS / 1000)
		g.ratio = append(g.ratio, rate*pct(r.RuncRunMS, 50)/1000)
		g.runc = append(g.runc, pct(r.RuncRunMS, 50))
		g.rate = append(g.rate, rate)
	}
	var b strings.Builder
	for _, name := range order {
		g := by[name]
		if len(g.ratio) < 2 {
			continue
		}
		fmt.Fprintf(&b, "%s, %d runs (each on a fresh system, its own runc loop right before its batch): median batch / runc loop **%.2fx** (%.2f-%.2fx); median runc loop p50 %.1f ms, median batch throughput %.1f /s.\n\n",
			name, len(g.ratio), median(g.ratio), slices.Min(g.ratio), slices.Max(g.ratio), median(g.runc), median(g.rate))
	}
	return b.String()
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}
