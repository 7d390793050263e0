package container

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// BenchmarkFork measures, side by side in one run (the modes take turns
// in every iteration), Fork of a running sandbox that wrote ~50 MiB, for
// 1 and 8 forks: the Fork call's latency (forks prepared, not started)
// and how long the source was frozen; beside them the bare copy of the
// same layer: `cp --sparse=always` of the layer image (ext4), `cp
// --reflink=always` (XFS), `cp -a` of the upper directory. Layer kinds:
// image (disk_mb 256) and dir (no quota), on the temp dir's file system
// and, when OPENDSEC_BENCH_XFS_DIR names a directory on an XFS with
// reflink=1, there too. "8-allfrozen" is 8 forks with every copy made
// while the source is frozen (forkCopiesFrozen), to compare with the
// default (one copy frozen, the rest from it after the thaw);
// "1-fifreeze" freezes the layer image's file system (FIFREEZE) around the
// copy instead of syncfs (forkFIFreeze).
// bench/fork.sh runs it.
func BenchmarkFork(b *testing.B) {
	testutil.RequiresRoot(b)
	rt, err := New(Config{StateRoot: filepath.Join(b.TempDir(), "runc"), CgroupParent: "/opendsec-test", AgentPath: testutil.AgentBinary(b)})
	if err != nil {
		b.Fatal(err)
	}
	tmpl := runtime.Spec{
		Rootfs:    runtime.Rootfs{Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: testutil.BusyboxRootfs(b)}}},
		Resources: runtime.Resources{CPU: 1, MemoryMB: 256},
	}
	ctx := context.Background()
	type mode struct {
		name   string
		diskMB int64
		parent string
		src    runtime.Spec
	}
	modes := []*mode{{diskMB: 256, parent: b.TempDir()}, {parent: b.TempDir()}}
	modes[0].name, modes[1].name = fsName(modes[0].parent)+"-image", fsName(modes[1].parent)+"-dir"
	if d := os.Getenv("OPENDSEC_BENCH_XFS_DIR"); d != "" {
		modes = append(modes, &mode{name: "xfs-image", diskMB: 256, parent: d}, &mode{name: "xfs-dir", parent: d})
	}
	for _, m := range modes {
		s := tmpl
		s.Resources.DiskMB = m.diskMB
		m.src, _ = startIn(b, rt, s, m.parent)
		// ~50 MiB: one 40 MiB file and 100 files of 100 KiB.
		res, err := runtimetest.Run(ctx, rt, m.src.ID, "root", "/bin/sh", "-c",
			`set -e; mkdir -p /data; dd if=/dev/urandom of=/data/big bs=1M count=40 2>/dev/null
for i in $(seq 100); do dd if=/dev/urandom of=/data/f$i bs=100k count=1 2>/dev/null; done; sync`)
		if err != nil || res.ExitCode != 0 {
			b.Fatalf("%s: write 50 MiB: %v %+v", m.name, err, res)
		}
	}
	lat := map[string][]time.Duration{}
	frozen := map[string][]time.Duration{}
	peer := map[string][]time.Duration{}
	peerName := map[string]string{}
	counts := []struct {
		name                string
		n                   int
		allFrozen, fiFreeze bool
	}{{"1", 1, false, false}, {"8", 8, false, false}, {"8-allfrozen", 8, true, false}, {"1-fifreeze", 1, false, true}}
	for b.Loop() {
		for _, m := range modes {
			for _, c := range counts {
				if c.fiFreeze && m.diskMB == 0 {
					continue // FIFREEZE is for the layer image
				}
				specs := make([]runtime.Spec, c.n)
				for i := range specs {
					s := m.src
					s.ID = runtimetest.NewID("fkb")
					s.StateDir = filepath.Join(m.parent, s.ID)
					specs[i] = s
				}
				forkCopiesFrozen, forkFIFreeze = c.allFrozen, c.fiFreeze
				t0 := time.Now()
				res, err := rt.Fork(ctx, m.src.ID, specs)
				d := time.Since(t0)
				forkCopiesFrozen, forkFIFreeze = false, false
				if err != nil {
					b.Fatalf("%s fork %d: %v", m.name, c.n, err)
				}
				k := m.name + "/" + c.name
				lat[k] = append(lat[k], d)
				frozen[k] = append(frozen[k], res[0].SourceFrozen)
				b.StopTimer()
				for _, s := range specs {
					if err := rt.Delete(ctx, s.ID); err != nil {
						b.Fatal(err)
					}
					os.RemoveAll(s.StateDir)
				}
				b.StartTimer()
			}
			// The bare copy of the same layer.
			dst := filepath.Join(m.parent, "peer-copy")
			var cmd *exec.Cmd
			switch {
			case m.diskMB > 0 && m.name == "xfs-image":
				cmd = exec.Command("cp", "--reflink=always", filepath.Join(m.src.StateDir, layerImage), dst)
			case m.diskMB > 0:
				cmd = exec.Command("cp", "--sparse=always", filepath.Join(m.src.StateDir, layerImage), dst)
			default:
				cmd = exec.Command("cp", "-a", "--reflink=auto", filepath.Join(m.src.StateDir, upperDir), dst)
			}
			peerName[m.name] = fmt.Sprint(cmd.Args[:2])
			t0 := time.Now()
			if out, err := cmd.CombinedOutput(); err != nil {
				b.Fatalf("%v: %v: %s", cmd.Args, err, out)
			}
			peer[m.name] = append(peer[m.name], time.Since(t0))
			os.RemoveAll(dst)
		}
	}
	med := func(ds []time.Duration) float64 {
		if len(ds) == 0 {
			return 0
		}
		s := slices.Clone(ds)
		slices.Sort(s)
		return float64(s[len(s)/2].Microseconds()) / 1000
	}
	for _, m := range modes {
		for _, c := range counts {
			k := m.name + "/" + c.name
			if len(lat[k]) == 0 {
				continue
			}
			fmt.Fprintf(os.Stderr, "%-16s forks=%-12s n=%d  fork p50 %7.1f ms  source frozen p50 %7.1f ms\n", m.name, c.name, len(lat[k]), med(lat[k]), med(frozen[k]))
			b.ReportMetric(med(lat[k]), "fork-ms-"+m.name+"-"+c.name)
			b.ReportMetric(med(frozen[k]), "frozen-ms-"+m.name+"-"+c.name)
		}
		fmt.Fprintf(os.Stderr, "%-16s peer %-26s p50 %7.1f ms\n", m.name, peerName[m.name], med(peer[m.name]))
		b.ReportMetric(med(peer[m.name]), "peer-ms-"+m.name)
	}
}

// fsName names the file system of dir.
func fsName(dir string) string {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return "fs"
	}
	switch fs.Type {
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	}
	return fmt.Sprintf("fs%#x", fs.Type)
}
