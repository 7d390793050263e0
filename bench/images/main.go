// Command images benchmarks OpenDsec's layered image store against the
// alternative the DSec paper rejects (§4.8): N sandboxes of one image with a
// large layer started through our store (the layer an EROFS file mounted
// once, an overlay with a fresh upper per sandbox) vs extracting the layer
// tarballs into a fresh root per sandbox and `runc run` on it. Both run in
// one process, on one machine, with the same parallelism and limits, and
// report time to all running, bytes written to the data disk
// (/sys/dev/block/<dev>/stat, after sync) and disk usage added (du), plus
// the time to the first sandbox from a freshly imported image. It talks to
// a running system through the public API (sdk/go), imports through it
// too (ImportImage of an oci-layout: reference), runs as root and removes
// everything it made.
// bench/images.sh builds it and runs it against a throwaway system.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

type config struct {
	endpoint, tokenFile       string
	dataDir                   string // the system's data dir (du of what sandboxes add)
	busybox                   string // rootfs dir: the base layer of both images
	work                      string
	runc                      string
	bigMiB, smallMiB, fileKiB int
	count, smallCount         int
	baselineBig               int
	oursAtBaseline            bool
	parallel, rounds          int
	marginGiB                 int
	memoryMB                  int64
	cpu                       float64
	pids                      int64
	out, command, revision    string
}

func main() {
	var c config
	flag.StringVar(&c.endpoint, "endpoint", "", "apiserver address (default $OPENDSEC_ENDPOINT)")
	flag.StringVar(&c.tokenFile, "token-file", "", "file holding the API token (default $OPENDSEC_TOKEN)")
	flag.StringVar(&c.dataDir, "data-dir", "", "the system's data dir: its image store and sandbox dirs are measured (du)")
	flag.StringVar(&c.busybox, "busybox", "/var/cache/opendsec/rootfs/busybox", "busybox rootfs directory: the base layer of both images (deploy/images/build.sh --no-import)")
	flag.StringVar(&c.work, "work", "/var/tmp", "where the layer tarballs, layouts and baseline roots go (on the data disk; under the system's node.import_dir, since layouts are imported through the API)")
	flag.StringVar(&c.runc, "runc", "runc", "runc binary of the baseline")
	flag.IntVar(&c.bigMiB, "big-mib", 1024, "size of the big image's data layer (MiB of file content)")
	flag.IntVar(&c.smallMiB, "small-mib", 100, "size of the small image's data layer (MiB); 0 skips the small image")
	flag.IntVar(&c.fileKiB, "file-kib", 1024, "size of each file in a data layer (KiB)")
	flag.IntVar(&c.count, "count", 100, "our sandboxes of the big image")
	flag.IntVar(&c.smallCount, "small-count", 100, "sandboxes of the small image, ours and baseline")
	flag.IntVar(&c.baselineBig, "baseline-big", 40, "baseline containers of the big image (each extracts the whole image: keep count x size well under the free disk)")
	flag.BoolVar(&c.oursAtBaseline, "ours-at-baseline", true, "also run ours at -baseline-big sandboxes of the big image (same count as the baseline)")
	flag.IntVar(&c.parallel, "parallel", 8, "baseline workers; match the apiserver's batch concurrency (8 by default)")
	flag.IntVar(&c.rounds, "rounds", 3, "rounds of every measurement; the report gives medians and every round")
	flag.IntVar(&c.marginGiB, "margin-gib", 15, "free disk the baseline must leave untouched, else it refuses to start")
	flag.Int64Var(&c.memoryMB, "memory-mb", 64, "memory limit of every sandbox and baseline container (MiB; the node never overcommits memory)")
	flag.Float64Var(&c.cpu, "cpu", 0.25, "cpu limit of every sandbox and baseline container (cores; the node offers 16x its cores)")
	flag.Int64Var(&c.pids, "pids", 256, "pids limit of every sandbox and baseline container")
	flag.StringVar(&c.out, "out", "", "report file (default bench/results/<YYYY-MM-DD>-images.md)")
	flag.StringVar(&c.command, "command", "", "the command line to record in the report (default: this program's arguments)")
	flag.StringVar(&c.revision, "revision", "", "source revision to record in the report")
	flag.Parse()
	if c.command == "" {
		c.command = strings.Join(os.Args, " ")
	}
	if c.out == "" {
		c.out = filepath.Join("bench", "results", time.Now().Format("2006-01-02")+"-images.md")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, c); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func validate(c config) error {
	switch {
	case c.bigMiB < 1 || c.smallMiB < 0 || c.fileKiB < 1:
		return errors.New("flags -big-mib, -small-mib, -file-kib must be >= 1, >= 0, >= 1")
	case c.count < 1 || c.smallCount < 1 || c.baselineBig < 0 || c.parallel < 1 || c.rounds < 1:
		return errors.New("flags -count, -small-count, -parallel, -rounds must be >= 1 and -baseline-big >= 0")
	case c.memoryMB < 16 || c.cpu <= 0 || c.pids < 1:
		return errors.New("flags -memory-mb, -cpu, -pids must be >= 16, > 0, >= 1")
	case c.dataDir == "":
		return errors.New("flag -data-dir is required (the system's data dir)")
	case os.Geteuid() != 0:
		return errors.New("must run as root (runc, mounts, cgroups)")
	}
	if _, err := os.Stat(filepath.Join(c.busybox, "bin", "sleep")); err != nil {
		return fmt.Errorf("flag -busybox: %s has no bin/sleep (build it with deploy/images/build.sh --no-import): %w", c.busybox, err)
	}
	return nil
}
