package gvisor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.Reclaimer = (*Runtime)(nil)

// reclaimDir (in the bundle) holds a reclaimed sandbox's checkpoint.
const reclaimDir = "reclaim"

func hasReclaimed(bundle string) bool {
	_, err := os.Stat(filepath.Join(bundle, reclaimDir, "checkpoint.img"))
	return err == nil
}

// Reclaim implements runtime.Reclaimer: `runsc checkpoint` of the paused
// sandbox into reclaimDir (on the bundle's disk), which ends its sandbox
// process, then `runsc delete` of what is left. Nothing of the sandbox is
// in RAM afterwards; it stays paused (Status) and Resume restores it
// (`runsc restore`). Before and After are its cgroup's charge. A
// checkpoint that fails (a full disk) leaves it paused as it was.
func (r *Runtime) Reclaim(ctx context.Context, id string) (runtime.ReclaimStats, error) {
	var rs runtime.ReclaimStats
	sb, err := r.get(id)
	if err != nil {
		return rs, err
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	if sb.reclaimed.Load() {
		return rs, nil // nothing of it is in RAM
	}
	if !sb.started || sb.ended() {
		return rs, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not running; only a paused sandbox's memory can be reclaimed", id)
	}
	st, err := r.Status(ctx, id)
	if err != nil {
		return rs, err
	}
	if st.State != runtime.StatePaused {
		return rs, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is %s; pause it before reclaiming its memory", id, st.State)
	}
	cg := filepath.Join(r.cfg.CgroupParent, id)
	rs.Before = runtime.CgroupMemory(cg)
	dir := filepath.Join(sb.st.Bundle, reclaimDir)
	_ = os.RemoveAll(dir) // a stale one of a reclaim that failed
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return rs, fmt.Errorf("reclaim dir: %w", err)
	}
	// A checkpoint that fails half-way (runsc exits 128 on a full disk)
	// is not known to leave the sandbox able to run on, so the space is
	// checked first against what the sandbox is charged (its checkpoint
	// was smaller in every measurement: bench/results/2026-12-06-vm-reclaim.md).
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err == nil {
		if free := int64(fs.Bavail) * fs.Bsize; free < rs.Before {
			_ = os.Remove(dir)
			return rs, fmt.Errorf("reclaim sandbox %s: %w: the filesystem of %s has %d MiB free and the sandbox is charged %d MiB, which its checkpoint needs up to; it stays paused in memory (free space there, then reclaim again)",
				id, errdefs.ErrResourceExhausted, dir, free>>20, rs.Before>>20)
		}
	}
	// Its exit is planned from here: the watcher must not end the sandbox.
	// The mark names the current watcher: it stays set (a watcher that
	// returns after the wait below still leaves the sandbox be), and a
	// later watcher (of the restore) is not covered.
	w := sb.watched
	sb.parking.Store(&w)
	if _, err := r.runscOut(ctx, sb, "checkpoint", "--image-path", dir, id); err != nil {
		sb.parking.Store(nil) // the sandbox runs on: its exit is an exit
		_ = os.RemoveAll(dir)
		if sb.ended() || r.gone(ctx, sb) {
			// The checkpoint failed after the sandbox process went: it
			// cannot come back.
			sb.finish(runtime.ExitStatus{ExitCode: -1, Reason: "checkpoint for a reclaim failed: " + err.Error(), At: time.Now()})
			return rs, fmt.Errorf("reclaim sandbox %s: %w", id, err)
		}
		return rs, fmt.Errorf("reclaim sandbox %s: its checkpoint failed; it stays paused in memory: %w", id, err)
	}
	// What is left of the sandbox (runsc keeps a paused one's process
	// after the checkpoint) goes; its watcher returns.
	if _, err := r.runscOut(ctx, sb, "delete", "--force", id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		log.G(ctx).Warn("gvisor reclaim: delete the checkpointed sandbox", log.SandboxID(id), log.Err(err))
	}
	select {
	case <-w:
	case <-time.After(reclaimWatcherWait):
		log.G(ctx).Warn("gvisor reclaim: the sandbox's watcher did not return", log.SandboxID(id))
	}
	syncDir(dir)
	sb.reclaimed.Store(true)
	rs.After = runtime.CgroupMemory(cg)
	return rs, nil
}

// reclaimWatcherWait bounds Reclaim's wait for the checkpointed
// sandbox's watcher to return.
var reclaimWatcherWait = 10 * time.Second

// gone says whether runsc no longer runs sandbox sb's process.
func (r *Runtime) gone(ctx context.Context, sb *sandbox) bool {
	out, err := r.runscOut(ctx, sb, "state", sb.id)
	if err != nil {
		return errors.Is(err, errdefs.ErrNotFound)
	}
	return strings.Contains(string(out), `"stopped"`)
}

// restoreReclaimed is Resume of a reclaimed sandbox: the guest namespace
// gets back the addresses runsc took off it, `runsc restore` runs the
// checkpoint again, and the checkpoint goes. On error it stays reclaimed.
func (r *Runtime) restoreReclaimed(ctx context.Context, sb *sandbox) error {
	sb.op.Lock()
	defer sb.op.Unlock()
	if !sb.reclaimed.Load() {
		return nil
	}
	if sb.ended() {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q has stopped", sb.id)
	}
	if sb.st.Network != nil {
		if err := rewireGuestNet(ctx, *sb.st.Network, filepath.Join(sb.st.Bundle, guestNetNS)); err != nil {
			return fmt.Errorf("restore sandbox %s: its network: %w", sb.id, err)
		}
	}
	dir := filepath.Join(sb.st.Bundle, reclaimDir)
	if _, err := r.runscOut(ctx, sb, "restore", "--detach", "--image-path", dir, "--bundle", sb.st.Bundle, sb.id); err != nil {
		_, _ = r.runscOut(context.WithoutCancel(ctx), sb, "delete", "--force", sb.id)
		return fmt.Errorf("restore sandbox %s from its reclaimed checkpoint (it stays paused on disk): %w", sb.id, err)
	}
	sb.reclaimed.Store(false)
	r.startWatch(sb)
	if err := os.RemoveAll(dir); err != nil {
		log.G(ctx).Warn("gvisor restore: remove the reclaimed checkpoint", log.SandboxID(sb.id), log.Err(err))
	}
	return nil
}

// rewireGuestNet gives the guest namespace's eth0 back what runsc took
// off it when the sandbox ran (its address, and with it the default
// route), so a restore finds the configuration the checkpoint knew.
func rewireGuestNet(ctx context.Context, n runtime.NetworkAttachment, path string) error {
	guest, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open guest netns: %w", err)
	}
	defer guest.Close()
	gh, err := netlink.NewHandleAt(guest)
	if err != nil {
		return fmt.Errorf("open guest netlink: %w", err)
	}
	defer gh.Close()
	eth, err := gh.LinkByName(guestIf)
	if err != nil {
		return fmt.Errorf("find guest eth0: %w", err)
	}
	if err := gh.AddrReplace(eth, &netlink.Addr{IPNet: &net.IPNet{IP: n.GuestAddr.Addr().AsSlice(), Mask: net.CIDRMask(n.GuestAddr.Bits(), 32)}}); err != nil {
		return fmt.Errorf("address guest eth0: %w", err)
	}
	if err := gh.LinkSetUp(eth); err != nil {
		return fmt.Errorf("set guest eth0 up: %w", err)
	}
	if err := gh.RouteReplace(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: n.Gateway.AsSlice()}); err != nil {
		return fmt.Errorf("guest default route: %w", err)
	}
	return netpolicy.WaitOperUp(ctx, gh, guestIf)
}

// syncDir writes the checkpoint's files to disk and drops them from the
// page cache, so what a reclaim wrote does not stay in RAM.
func syncDir(dir string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		f, err := os.Open(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		_ = unix.Fdatasync(int(f.Fd()))
		_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
		_ = f.Close()
	}
}
