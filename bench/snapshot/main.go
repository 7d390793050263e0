// Command snapshot benchmarks named snapshots on the container backend,
// side by side in one run against one system, through the public API
// (sdk/go): CreateSnapshot of a sandbox that wrote W MiB vs PackDiff of the
// same sandbox (the same copy of the writable layer into the store: the
// snapshot's bookkeeping is the difference), and a create from the
// snapshot vs a create from a plain image (both cold: skip_warm_pool).
// bench/snapshot.sh builds it and runs it against a throwaway system.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

func main() {
	endpoint := flag.String("endpoint", "", "apiserver address (default $OPENDSEC_ENDPOINT)")
	tokenFile := flag.String("token-file", "", "file holding the API token (default $OPENDSEC_TOKEN)")
	rounds := flag.Int("rounds", 9, "measurements of each kind; the report gives medians")
	sizes := flag.String("write-mib", "1,64", "MiB the source writes before the snapshots, comma-separated")
	out := flag.String("out", filepath.Join("bench", "results", time.Now().Format("2006-01-02")+"-snapshot.md"), "report file")
	command := flag.String("command", strings.Join(os.Args, " "), "the command line to record in the report")
	flag.Parse()
	if err := run(*endpoint, *tokenFile, *rounds, *sizes, *out, *command); err != nil {
		fmt.Fprintln(os.Stderr, "snapshot bench:", err)
		os.Exit(1)
	}
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

func run(endpoint, tokenFile string, rounds int, sizes, out, command string) error {
	var opts []opendsec.Option
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return err
		}
		opts = append(opts, opendsec.WithToken(strings.TrimSpace(string(b))))
	}
	c, err := opendsec.New(endpoint, opts...)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx := context.Background()
	spec := func() *opendsec.SandboxSpec {
		return &opendsec.SandboxSpec{Image: "root/busybox", Cpu: 0.5, TimeoutSeconds: 1800}
	}
	var rep strings.Builder
	fmt.Fprintf(&rep, "# Snapshots on the container backend\n\nCommand: `%s`\n\n", command)
	fmt.Fprintf(&rep, "Medians of %d rounds, measured side by side in one run (one system, one source sandbox per size). "+
		"CreateSnapshot and PackDiff both copy the source's writable layer into one new store layer while the source is frozen; "+
		"creates are cold (`skip_warm_pool`), from the snapshot vs from root/busybox, each stopped after.\n\n", rounds)
	rep.WriteString("| source wrote | CreateSnapshot | PackDiff | ratio | create from snapshot | create from image | ratio |\n|---|---|---|---|---|---|---|\n")
	for _, s := range strings.Split(sizes, ",") {
		var mib int
		if _, err := fmt.Sscan(s, &mib); err != nil {
			return fmt.Errorf("write-mib %q: %w", s, err)
		}
		src, err := c.CreateSandbox(ctx, spec())
		if err != nil {
			return err
		}
		r, err := c.RunShell(ctx, src.GetId(), fmt.Sprintf("mkdir -p /data && dd if=/dev/urandom of=/data/blob bs=1M count=%d 2>&1 && sync", mib))
		if err != nil {
			return err
		}
		if r.ExitCode != 0 {
			return fmt.Errorf("write %d MiB in the source: %s %s", mib, r.Status, r.Stdout)
		}
		var snapT, packT, fromSnap, fromImg []time.Duration
		var snaps []string
		for i := range rounds {
			t := time.Now()
			snap, err := c.CreateSnapshot(ctx, src.GetId(), fmt.Sprintf("bench-%d-%d", mib, i))
			if err != nil {
				return err
			}
			snapT = append(snapT, time.Since(t))
			snaps = append(snaps, snap.GetId())
			name := fmt.Sprintf("bench/packed:%d-%d", mib, i)
			t = time.Now()
			if _, err := c.PackDiff(ctx, src.GetId(), name); err != nil {
				return err
			}
			packT = append(packT, time.Since(t))
			if err := c.RemoveImage(ctx, name); err != nil {
				return err
			}
		}
		for i := range rounds {
			for _, fromSnapshot := range []bool{true, false} {
				sp := spec()
				if fromSnapshot {
					sp = &opendsec.SandboxSpec{Snapshot: snaps[i]}
				}
				t := time.Now()
				sb, err := c.CreateSandboxWith(ctx, sp, opendsec.CreateOptions{SkipWarmPool: true})
				if err != nil {
					return err
				}
				d := time.Since(t)
				if fromSnapshot {
					fromSnap = append(fromSnap, d)
				} else {
					fromImg = append(fromImg, d)
				}
				if err := c.StopSandbox(ctx, sb.GetId()); err != nil {
					return err
				}
			}
		}
		for _, id := range snaps {
			if err := c.DeleteSnapshot(ctx, id); err != nil {
				return err
			}
		}
		if err := c.StopSandbox(ctx, src.GetId()); err != nil {
			return err
		}
		fmt.Fprintf(&rep, "| %d MiB | %s | %s | %.2fx | %s | %s | %.2fx |\n", mib, ms(median(snapT)), ms(median(packT)),
			float64(median(snapT))/float64(median(packT)), ms(median(fromSnap)), ms(median(fromImg)), float64(median(fromSnap))/float64(median(fromImg)))
	}
	if _, err := c.GarbageCollectImages(ctx); err != nil {
		return err
	}
	fmt.Print(rep.String())
	return os.WriteFile(out, []byte(rep.String()), 0o644)
}
