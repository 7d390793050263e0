package vm

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
)

// guestClockSkew is the host's time minus the guest's (whole seconds, as
// `date +%s` gives them), read through the agent.
func guestClockSkew(t *testing.T, r *Runtime, id string) time.Duration {
	t.Helper()
	// The guest read its clock between the host's two reads: the skew is
	// how far outside that window it was (positive: the guest lags).
	before := time.Now()
	// busybox's date has no %N: adjtimex gives the time in microseconds.
	out := guestRun(t, r, id, `busybox adjtimex | awk '/time.tv_sec/ {s=$2} /time.tv_usec/ {u=$2} END {printf "%d.%06d", s, u}'`)
	after := time.Now()
	sec, frac, ok := strings.Cut(out, ".")
	s, err1 := strconv.ParseInt(sec, 10, 64)
	us, err2 := strconv.ParseInt(frac, 10, 64)
	if !ok || err1 != nil || err2 != nil || s == 0 || len(frac) != 6 {
		t.Fatalf("guest time from adjtimex: %q", out)
	}
	g := time.Unix(s, us*1000)
	switch {
	case g.Before(before):
		return before.Sub(g)
	case g.After(after):
		return -g.Sub(after)
	}
	return 0
}

// TestGuestResumeStepsClock: a paused guest's clock stands still, so
// without a step it lags by the pause; Resume steps it to the host's.
func TestGuestResumeStepsClock(t *testing.T) {
	r, id := guestVM(t)
	ctx := t.Context()
	const pause = 4 * time.Second
	sb, err := r.get(id)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.setClock(ctx, sb); err != nil {
		t.Fatal(err)
	}
	s0 := guestClockSkew(t, r, id)
	// Without the step (a bare QMP cont): the lag grows by the pause.
	if err := r.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	time.Sleep(pause) // the pause being measured, not a synchronisation
	if err := r.qmpRun(ctx, id, "cont"); err != nil {
		t.Fatal(err)
	}
	if d := guestClockSkew(t, r, id); d-s0 < pause-1500*time.Millisecond {
		t.Fatalf("guest clock lags %s (%s before) after a %s pause with a bare cont; the test cannot see a step", d, s0, pause)
	} else {
		t.Logf("lag after a %s pause, bare cont: %s (%s before)", pause, d, s0)
	}
	// Resume steps it (and takes the earlier lag away too).
	if err := r.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	time.Sleep(pause)
	if err := r.Resume(ctx, id); err != nil {
		t.Fatal(err)
	}
	if d := guestClockSkew(t, r, id); d > 500*time.Millisecond || d < -500*time.Millisecond {
		t.Fatalf("guest clock is %s off the host's after Resume of a %s pause: not stepped", d, pause)
	} else {
		t.Logf("skew after Resume: %s", d)
	}
}

// TestGuestReclaimKeepsCounter is issue 13's acceptance for task pause
// with reclaim on the vm backend: a fork of the counting holder is paused
// and reclaimed: its state goes to disk, QEMU exits, its RAM file goes and
// the memory its cgroup was charged is freed; a write to a full disk fails
// first and leaves it paused in memory. A new backend instance (a node
// restart) recovers it as paused, and its Resume restores it: the counter
// counts on with the same value, the clock is the host's, the MAC its own.
func TestGuestReclaimKeepsCounter(t *testing.T) {
	r, src := sharedHolder(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	specs := forkSpecs(t, "rcl", 1)
	res, err := r.Fork(ctx, src, specs)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	id := specs[0].ID
	r2 := guestRuntime(t) // the node after a restart
	t.Cleanup(func() {
		_ = r2.Delete(context.Background(), id)
		_ = r.Delete(context.Background(), id)
	})
	if err := r.Start(ctx, id); err != nil {
		t.Fatal(err)
	}
	mac := guestRun(t, r, id, "cat /sys/class/net/eth0/address")
	v0, n0 := waitCounter(t, r, id, 1)

	if _, err := r.Reclaim(ctx, id); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("reclaim of a running VM: %v, want failed precondition", err)
	}
	if err := r.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	sb, _ := r.get(id)
	pid, memPath, sd := sb.st.Pid, sb.st.MemPath, sb.st.StateDir

	// A full disk: the reclaim fails, saying so, and the VM stays paused
	// in memory.
	dir := filepath.Join(sd, reclaimDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	_, err = r.Reclaim(ctx, id)
	if uerr := unix.Unmount(dir, 0); uerr != nil {
		t.Fatal(uerr)
	}
	if !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("reclaim onto a full disk: %v, want resource exhausted", err)
	}
	t.Logf("full disk: %v", err)
	if st, err := r.Status(ctx, id); err != nil || st.State != runtime.StatePaused || st.Pid != pid {
		t.Fatalf("after the failed reclaim: %+v %v; want paused, qemu %d", st, err, pid)
	}

	t0 := time.Now()
	rs, err := r.Reclaim(ctx, id)
	reclaimTime := time.Since(t0)
	if err != nil {
		t.Fatalf("reclaim: %v", err)
	}
	t.Logf("reclaim: before %d MiB, after %d MiB, freed %d MiB in %s", rs.Before>>20, rs.After>>20, rs.Freed()>>20, reclaimTime)
	if rs.Freed() < 32<<20 {
		t.Errorf("reclaim freed %d bytes (before %d, after %d); want the guest's memory, > 32 MiB", rs.Freed(), rs.Before, rs.After)
	}
	if unix.Kill(pid, 0) == nil {
		t.Errorf("qemu %d still runs after the reclaim", pid)
	}
	if _, err := os.Stat(memPath); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("RAM file %s after the reclaim: %v", memPath, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, reclaimStateFile)); err != nil || fi.Size() == 0 {
		t.Fatalf("saved state: %v", err)
	}
	if st, err := r.Status(ctx, id); err != nil || st.State != runtime.StatePaused {
		t.Fatalf("status of a reclaimed VM: %+v %v", st, err)
	}
	if err := r.Pause(ctx, id); err != nil {
		t.Fatalf("pause of a reclaimed VM: %v", err)
	}
	// A fork of the reclaimed VM comes from its saved state: it holds the
	// value and counts on; the reclaimed VM stays as it is.
	fspecs := forkSpecs(t, "rclf", 1)
	if _, err := r.Fork(ctx, id, fspecs); err != nil {
		t.Fatalf("fork of a reclaimed VM: %v", err)
	}
	t.Cleanup(func() { _ = r.Delete(context.Background(), fspecs[0].ID) })
	// Its guest's balloon driver is bound as the reclaimed one's was: a
	// snapshot of the fork must know to unbind it.
	if fsb, _ := r.get(fspecs[0].ID); fsb.st.Balloon != sb.st.Balloon {
		t.Fatalf("fork of a reclaimed VM: balloon %v, the VM's %v", fsb.st.Balloon, sb.st.Balloon)
	}
	if err := r.Start(ctx, fspecs[0].ID); err != nil {
		ql, _ := os.ReadFile(filepath.Join(fspecs[0].StateDir, "qemu.log"))
		cl, _ := os.ReadFile(filepath.Join(fspecs[0].StateDir, "console.log"))
		t.Fatalf("start the fork of a reclaimed VM: %v; qemu.log: %s; console: %s", err, ql, vmm.LastLines(cl, 30))
	}
	if v, n := waitCounter(t, r, fspecs[0].ID, n0+3); v != v0 {
		t.Fatalf("fork of the reclaimed VM holds %q %d; the VM %q %d", v, n, v0, n0)
	}
	if err := r.Delete(ctx, fspecs[0].ID); err != nil {
		t.Fatal(err)
	}
	if st, err := r.Status(ctx, id); err != nil || st.State != runtime.StatePaused || st.Pid != 0 {
		t.Fatalf("reclaimed VM after a fork of it: %+v %v", st, err)
	}

	// The node dies in a restore from reclaim: its QEMU waits for the
	// incoming state (the run file says reclaimed, with its pid).
	rsb, _ := r.get(id)
	rsb.mu.Lock()
	rsb.parking = true
	rsb.mu.Unlock()
	ipid, iq, err := r.launch(ctx, rsb, append(slices.Clip(rsb.st.Args), "-incoming", "defer"))
	if err != nil {
		t.Fatalf("launch of a restore: %v", err)
	}
	_ = iq.Close()

	// A node restart: a new instance recovers it from the Handle the node
	// kept (the fork's), as paused and reclaimed: the interrupted
	// restore's QEMU is killed.
	if err := r2.Recover(ctx, res[0].Handle); err != nil {
		t.Fatal(err)
	}
	if st, err := r2.Status(ctx, id); err != nil || st.State != runtime.StatePaused || st.Pid != 0 {
		t.Fatalf("recovered reclaimed VM: %+v %v; want paused, no qemu", st, err)
	}
	if r2.isOurQEMU(ipid, 0, id, sd) {
		t.Fatalf("the interrupted restore's qemu %d still runs", ipid)
	}
	t0 = time.Now()
	if err := r2.Resume(ctx, id); err != nil {
		t.Fatalf("resume of a reclaimed VM: %v", err)
	}
	t.Logf("restore from reclaim to identity set: %s", time.Since(t0))
	if st, err := r2.Status(ctx, id); err != nil || st.State != runtime.StateRunning || st.Pid <= 0 {
		t.Fatalf("after resume: %+v %v", st, err)
	}
	if v, n := waitCounter(t, r2, id, n0+3); v != v0 {
		t.Fatalf("restored VM holds %q %d; before the reclaim %q %d", v, n, v0, n0)
	}
	if d := guestClockSkew(t, r2, id); d > 2*time.Second || d < -2*time.Second {
		t.Errorf("restored guest's clock is %s off the host's", d)
	}
	if got := guestRun(t, r2, id, "cat /sys/class/net/eth0/address"); got != mac {
		t.Errorf("restored guest's MAC %s, before the reclaim %s", got, mac)
	}
	// A snapshot of a VM this instance found by Recover (no spec) records
	// its tap network, so it restores into a tap sandbox.
	sdir := t.TempDir()
	if _, err := r2.Snapshot(ctx, id, sdir); err != nil {
		t.Fatalf("snapshot of a recovered VM: %v", err)
	}
	if rf, err := loadSnapshot(sdir); err != nil {
		t.Errorf("snapshot of a recovered VM: %v", err)
	} else if rf.m.Network != runtime.NetworkTap {
		t.Errorf("snapshot of a recovered VM: manifest network %q, want %q", rf.m.Network, runtime.NetworkTap)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("saved state dir after the restore: %v", err)
	}
	// Stop and Delete of a reclaimed VM leave nothing.
	if err := r2.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := r2.Reclaim(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := r2.Stop(ctx, id, runtime.StopOptions{}); err != nil {
		t.Fatal(err)
	}
	if es, err := r2.Wait(ctx, id); err != nil || es.Reason == "" {
		t.Fatalf("wait after stop of a reclaimed VM: %+v %v", es, err)
	}
	if err := r2.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("saved state dir after delete: %v", err)
	}
	if out, _ := exec.Command("pgrep", "-f", "opendsec-"+id+" ").Output(); len(out) > 0 {
		t.Errorf("qemu of %s left: %s", id, out)
	}
}
