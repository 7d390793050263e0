package main

import (
	"fmt"
	"os"
	"os/exec"
	goruntime "runtime"
	"slices"
	"strings"
	"time"
)

type report struct {
	cfg                config
	started            time.Time
	elapsed            time.Duration
	loadStart, loadEnd string
	disk, cgMode       string
	freeStart          int64 // free bytes on the data disk before the run
	images             []*benchImage
	results            map[string][]result       // key(side, image, n) -> rounds
	imports            map[string][]importResult // image label -> rounds
}

// median of a non-empty slice (the lower middle for an even count).
func median[T int64 | time.Duration](xs []T) T {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[(len(s)-1)/2]
}

// pct is the nearest-rank percentile p of xs.
func pct(xs []time.Duration, p float64) time.Duration {
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(p*float64(len(s))+0.999999) - 1
	return s[max(0, min(i, len(s)-1))]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.0f ms", float64(d)/float64(time.Millisecond)) }

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

func field[T any](rs []result, f func(result) T) []T {
	out := make([]T, len(rs))
	for i, r := range rs {
		out[i] = f(r)
	}
	return out
}

func joinAll[T any](xs []T, f func(T) string) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = f(x)
	}
	return strings.Join(parts, ", ")
}

func (r *report) markdown() string {
	var b strings.Builder
	c := r.cfg
	w := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	w("# Images benchmark: layered store vs extracting the layer tarball per sandbox")
	w("")
	w("Date: %s. Command: `%s`. Revision: %s. Took %s.", r.started.UTC().Format("2006-01-02 15:04 MST"), c.command, c.revision, r.elapsed.Round(time.Second))
	w("")
	w("## Machine")
	w("")
	w("- kernel %s, %d CPUs, %s", kernelRelease(), goruntime.NumCPU(), memTotal())
	w("- data disk %s (the system's data dir and the baseline's roots are on it); cgroups %s; %s", r.disk, r.cgMode, runcVersion(c.runc))
	w("- load average at start %s, at end %s", r.loadStart, r.loadEnd)
	w("")
	w("## What ran")
	w("")
	w("Both images are a busybox layer plus one data layer of %d KiB files of pseudo-random base64 text, gzip (Huffman only) to ~76%%:", c.fileKiB)
	w("")
	w("| image | file content | .tar.gz (what the baseline extracts, the blobs we import) |")
	w("|---|---|---|")
	for _, im := range r.images {
		w("| %s (`%s`) | %s | %s |", im.label, im.name, human(im.content), human(im.gz))
	}
	w("")
	w("- **ours**: the image imported once through the API (`ImportImage(\"oci-layout:…\")`), then `BatchCreate` of N sandboxes (the apiserver runs 8 creates at once). The node mounts each layer's EROFS file once and gives every sandbox an overlay with a fresh upper on local disk. A sandbox counts as running when its create returns (its agent answered `/health`); each is then checked with `GetSandbox`.")
	w("- **baseline**: per container, `tar --numeric-owner -xzf` of every layer tarball into a fresh root directory, config.json, `runc run --detach` (`/bin/sleep`), %d containers at a time. Running = `runc run` returned, then checked with `runc state`.", c.parallel)
	w("- Both: %d MiB memory, %.2g CPU, %d pids per sandbox/container; the same namespaces (pid, mount, uts, ipc, net, cgroup).", c.memoryMB, c.cpu, c.pids)
	w("- **bytes written**: the data disk's sectors-written counter (`/sys/dev/block/…/stat`, field 7, x512) read after `sync` before and after the run: everything the disk wrote, including the node's own bookkeeping and any other writer on the machine. **du**: allocated blocks added under the system's data dir (ours) or the baseline's roots, not crossing mounts.")
	w("- %d rounds; tables give the median and every round in order. Every sandbox and container is removed after each run.", c.rounds)
	w("")
	w("## Time to all running and bytes written")
	w("")
	w("| sandboxes x image | side | time to all running (median) | rounds | bytes written (median) | per sandbox | du added (median) |")
	w("|---|---|---|---|---|---|---|")
	type row struct {
		im *benchImage
		n  int
	}
	var rows []row
	seen := map[string]bool{}
	for i, im := range r.images {
		counts := []int{c.baselineBig, c.count} // the big image is last
		if i < len(r.images)-1 {
			counts = []int{c.smallCount}
		}
		for _, n := range counts {
			k := fmt.Sprintf("%s|%d", im.label, n)
			if n > 0 && !seen[k] && (r.results[key("ours", im, n)] != nil || r.results[key("baseline", im, n)] != nil) {
				seen[k] = true
				rows = append(rows, row{im, n})
			}
		}
	}
	for _, x := range rows {
		for _, side := range []string{"ours", "baseline"} {
			rs := r.results[key(side, x.im, x.n)]
			if rs == nil {
				w("| %d x %s | %s | not run (see below) | | | | |", x.n, x.im.label, side)
				continue
			}
			all := field(rs, func(r result) time.Duration { return r.allRunning })
			wr := field(rs, func(r result) int64 { return r.written })
			dus := field(rs, func(r result) int64 { return r.du })
			w("| %d x %s | %s | **%s** | %s | **%s** | %s | %s |", x.n, x.im.label, side, secs(median(all)), joinAll(all, secs), human(median(wr)), human(median(wr)/int64(x.n)), human(median(dus)))
		}
		o, bl := r.results[key("ours", x.im, x.n)], r.results[key("baseline", x.im, x.n)]
		if o != nil && bl != nil {
			ot := median(field(o, func(r result) time.Duration { return r.allRunning }))
			bt := median(field(bl, func(r result) time.Duration { return r.allRunning }))
			ow := median(field(o, func(r result) int64 { return r.written }))
			bw := median(field(bl, func(r result) int64 { return r.written }))
			w("| | baseline / ours | %.1fx | | %.1fx | | |", bt.Seconds()/ot.Seconds(), float64(bw)/float64(max(ow, 1)))
		}
	}
	w("")
	for _, x := range rows {
		bl := r.results[key("baseline", x.im, x.n)]
		if bl == nil {
			continue
		}
		var each []time.Duration
		for _, res := range bl {
			each = append(each, res.each...)
		}
		w("Baseline, %d x %s: one container's extract + `runc run` p50 %s, p95 %s, max %s (all rounds).", x.n, x.im.label, ms(pct(each, 0.5)), ms(pct(each, 0.95)), ms(slices.Max(each)))
		w("")
	}
	if big := r.images[len(r.images)-1]; c.count > c.baselineBig {
		need := int64(c.count)*(big.content+big.content/16) + int64(c.marginGiB)<<30
		why := fmt.Sprintf("%d extracted roots of %s need about %s with the %d GiB margin, more than the %s free at the start", c.count, human(big.content), human(need), c.marginGiB, human(r.freeStart))
		if need <= r.freeStart {
			why = "flag -baseline-big chose it"
		}
		w("The baseline of the %s image ran at %d containers, not %d: %s. Ours ran at %d (and at %d when both rows show it). Nothing above is extrapolated.",
			big.label, c.baselineBig, c.count, why, c.count, c.baselineBig)
		w("")
	}
	w("## Time to first sandbox from a freshly imported image")
	w("")
	w("The image removed and its layers collected first, then `ImportImage` from the OCI layout through the API (decompress, unpack, verify digests, `mkfs.erofs`, commit), then one `CreateSandbox` (mounts the new EROFS layers).")
	w("")
	w("| image | import (median) | first create (median) | import + first create | rounds (import / create) | bytes written by the import | store du |")
	w("|---|---|---|---|---|---|---|")
	for _, im := range r.images {
		irs := r.imports[im.label]
		if len(irs) == 0 {
			continue
		}
		imp := make([]time.Duration, len(irs))
		first := make([]time.Duration, len(irs))
		tot := make([]time.Duration, len(irs))
		wr := make([]int64, len(irs))
		sdu := make([]int64, len(irs))
		var rounds []string
		for i, ir := range irs {
			imp[i], first[i], tot[i], wr[i], sdu[i] = ir.importDur, ir.first, ir.importDur+ir.first, ir.written, ir.storeDu
			rounds = append(rounds, secs(ir.importDur)+" / "+ms(ir.first))
		}
		w("| %s | %s | %s | **%s** | %s | %s | %s |", im.label, secs(median(imp)), ms(median(first)), secs(median(tot)), strings.Join(rounds, ", "), human(median(wr)), human(median(sdu)))
	}
	w("")
	return b.String()
}

func memTotal() string {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return "memory unknown"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "MemTotal:"); ok {
			var kb int64
			fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &kb)
			return fmt.Sprintf("%.1f GiB RAM", float64(kb)/(1<<20))
		}
	}
	return "memory unknown"
}

func runcVersion(runc string) string {
	out, err := exec.Command(runc, "--version").Output()
	if err != nil {
		return "runc version unknown"
	}
	return strings.SplitN(strings.TrimSpace(string(out)), "\n", 2)[0]
}
