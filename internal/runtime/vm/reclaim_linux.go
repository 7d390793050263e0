package vm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
	"github.com/kernflux/opendsec/internal/vmchan"
)

var _ runtime.Reclaimer = (*Runtime)(nil)

// reclaimDir (in the StateDir) holds a reclaimed guest: reclaimStateFile is
// QEMU's migration stream with the guest's RAM in it. It is on the
// StateDir's disk, never in the memory dir (a tmpfs would keep it in RAM).
const (
	reclaimDir       = "reclaim"
	reclaimStateFile = "state"
)

func hasReclaimState(sd string) bool {
	_, err := os.Stat(filepath.Join(sd, reclaimDir, reclaimStateFile))
	return err == nil
}

// Reclaim implements runtime.Reclaimer: the paused guest's whole state
// (its RAM in the stream) goes to reclaimDir on disk, synced and dropped
// from the page cache, QEMU quits and the guest's RAM file in the memory
// dir is removed. Nothing of the guest is left in RAM; the sandbox stays
// paused (Status) and Resume restores it. Before and After are the QEMU
// cgroup's charge (guest RAM, QEMU's heap and code buffer, page cache).
// When the state cannot be written (a full disk) the error says so and the
// VM stays as it was: paused, in memory.
func (r *Runtime) Reclaim(ctx context.Context, id string) (runtime.ReclaimStats, error) {
	var rs runtime.ReclaimStats
	sb, err := r.get(id)
	if err != nil {
		return rs, err
	}
	sb.startMu.Lock()
	defer sb.startMu.Unlock()
	sb.mu.Lock()
	started, reclaimed, q, st, exited := sb.started, sb.reclaimed, sb.qmp, sb.st, sb.exited
	sb.mu.Unlock()
	select {
	case <-sb.exit.Done():
		return rs, errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q has stopped; only a paused sandbox's memory can be reclaimed", id)
	default:
	}
	if argsPmem(st.Args) {
		// The stream would carry the read-only pmem layers' memory (the
		// RAM goes in with x-ignore-shared off), and the restore would
		// write it into their readonly=on mappings: QEMU fails.
		return rs, errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q maps its image layers as pmem devices (layer_device: pmem), whose memory cannot be reclaimed; it stays paused in memory (use layer_device: blk for sandboxes to reclaim)", id)
	}
	if reclaimed {
		// Nothing of it is in RAM any more.
		rs.Before = runtime.CgroupMemory(st.Cgroup)
		rs.After = rs.Before
		return rs, nil
	}
	if !started || q == nil {
		return rs, errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q never started; only a paused sandbox's memory can be reclaimed", id)
	}
	status, err := q.Status(ctx)
	if err != nil {
		return rs, fmt.Errorf("vm %s reclaim: %w", id, err)
	}
	if status != "paused" {
		return rs, errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q is %q; pause it before reclaiming its memory", id, status)
	}
	rs.Before = runtime.CgroupMemory(st.Cgroup)
	dir := filepath.Join(st.StateDir, reclaimDir)
	path := filepath.Join(dir, reclaimStateFile)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return rs, fmt.Errorf("vm %s reclaim dir: %w: %w", id, errdefs.ErrInternal, err)
	}
	_ = os.Remove(path) // a stale one of a reclaim that failed
	// The RAM goes into the stream whether it is a shared file (a booted
	// VM) or a private mapping (a fork): the restore maps a file of its
	// own, shared, like a booted VM's.
	if _, err := q.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": false}}}); err != nil {
		return rs, fmt.Errorf("vm %s reclaim: %w", id, err)
	}
	if _, err := q.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(100) << 30}); err != nil {
		return rs, fmt.Errorf("vm %s reclaim: %w", id, err)
	}
	if err := migrateToFile(ctx, q, path); err != nil {
		_ = os.Remove(path)
		var fs unix.Statfs_t
		if unix.Statfs(dir, &fs) == nil {
			if free := int64(fs.Bavail) * fs.Bsize; free < st.MemoryMB<<20 {
				return rs, fmt.Errorf("vm %s reclaim: %w: the filesystem of %s has %d MiB free and the guest's memory needs up to %d MiB; the VM stays paused in memory (free space there, then reclaim again): %w",
					id, errdefs.ErrResourceExhausted, dir, free>>20, st.MemoryMB, err)
			}
		}
		return rs, fmt.Errorf("vm %s reclaim: writing its memory to %s failed; the VM stays paused in memory: %w", id, dir, err)
	}
	if err := syncAndDrop(path); err != nil {
		_ = os.Remove(path)
		return rs, fmt.Errorf("vm %s reclaim: %w", id, err)
	}
	// From here the saved state is the guest: QEMU's exit is planned.
	args := reclaimArgs(st.Args)
	sb.mu.Lock()
	sb.parking = true
	sb.mu.Unlock()
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	_, _ = q.Execute(qctx, "quit", nil)
	cancel()
	t := time.NewTimer(5 * time.Second)
	select {
	case <-exited:
	case <-t.C:
		_ = vmm.Kill(st.Pid)
		<-exited
	}
	t.Stop()
	_ = q.Close()
	sb.closeAgent()
	sb.mu.Lock()
	sb.parking = false
	stopping := sb.stopping
	if !stopping {
		sb.reclaimed, sb.qmp, sb.st.Pid, sb.st.StartTime = true, nil, 0, 0
		sb.st.Args, sb.st.MemShared, sb.argsChanged = args, true, true
	}
	sb.mu.Unlock()
	if stopping {
		return rs, errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q was stopped during the reclaim", id)
	}
	// The RAM file (or a fork's link to its snapshot's) goes: its pages
	// are in the stream. A node killed from here on finds the sandbox
	// reclaimed through the run file.
	if err := writeRunState(st.StateDir, runState{ID: id, Reclaimed: true, Args: args}); err != nil {
		log.G(ctx).Error("vm reclaim: record it", log.SandboxID(id), log.Err(err))
	}
	if err := os.Remove(st.MemPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		log.G(ctx).Warn("vm reclaim: remove its RAM file", log.SandboxID(id), log.Err(err))
	}
	rs.After = runtime.CgroupMemory(st.Cgroup)
	return rs, nil
}

// reclaimArgs is a reclaimed VM's command line for its restore: its RAM a
// shared file of its own (a fork's was its snapshot's, mapped private).
func reclaimArgs(args []string) []string {
	out := slices.Clone(args)
	for i, a := range out {
		if strings.HasPrefix(a, "memory-backend-file,") {
			out[i] = strings.ReplaceAll(a, "share=off", "share=on")
		}
	}
	return out
}

// syncAndDrop writes path's pages to disk and drops them from the page
// cache, so what a reclaim wrote does not stay in RAM.
func syncAndDrop(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("saved state: %w: %w", errdefs.ErrInternal, err)
	}
	defer func() { _ = f.Close() }()
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		return fmt.Errorf("sync saved state %s: %w: %w", path, errdefs.ErrInternal, err)
	}
	_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
	return nil
}

// restoreReclaimed is Resume of a reclaimed sandbox: QEMU starts again
// with the saved state (-incoming), in the same netns, cgroup, disks and
// sockets, the guest runs on, its agent answers on a new session and it
// gets its identity again (the clock stepped to the host's, the RNG
// reseeded). Then the saved state goes. On error the sandbox stays
// reclaimed (paused) and the next Resume tries again.
func (r *Runtime) restoreReclaimed(ctx context.Context, sb *sandbox) error {
	sb.startMu.Lock()
	defer sb.startMu.Unlock()
	sb.mu.Lock()
	reclaimed, stopping := sb.reclaimed, sb.stopping
	sb.mu.Unlock()
	if !reclaimed {
		return nil // restored meanwhile
	}
	if stopping {
		return errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q is stopping", sb.id)
	}
	path := filepath.Join(sb.st.StateDir, reclaimDir, reclaimStateFile)
	if _, err := os.Stat(path); err != nil {
		return fmt.Errorf("vm %s restore of its reclaimed memory: %w: %w", sb.id, errdefs.ErrInternal, err)
	}
	t0 := time.Now()
	// The old RAM file is gone; QEMU makes a new one (a leftover of a
	// restore that failed must not be mapped).
	_ = os.Remove(sb.st.MemPath)
	// Until the guest runs again, an exit of the new QEMU is not the
	// sandbox's end: the saved state is the guest.
	sb.mu.Lock()
	sb.parking = true
	sb.mu.Unlock()
	pid, q, err := r.launch(ctx, sb, append(slices.Clip(sb.st.Args), "-incoming", "defer"))
	if err != nil {
		// launch killed its QEMU; the sandbox stays reclaimed.
		sb.mu.Lock()
		sb.parking = false
		sb.qmp, sb.st.Pid, sb.st.StartTime = nil, 0, 0
		sb.mu.Unlock()
		_ = writeRunState(sb.st.StateDir, runState{ID: sb.id, Reclaimed: true, Args: sb.st.Args})
		return fmt.Errorf("vm %s restore of its reclaimed memory (it stays paused on disk): %w", sb.id, err)
	}
	fail := func(err error) error {
		sb.mu.Lock()
		exited := sb.exited
		sb.mu.Unlock()
		_ = vmm.Kill(pid)
		<-exited
		_ = q.Close()
		sb.closeAgent()
		sb.mu.Lock()
		sb.parking = false
		sb.qmp, sb.st.Pid, sb.st.StartTime = nil, 0, 0
		sb.mu.Unlock()
		_ = os.Remove(sb.st.MemPath)
		_ = writeRunState(sb.st.StateDir, runState{ID: sb.id, Reclaimed: true, Args: sb.st.Args})
		return fmt.Errorf("vm %s restore of its reclaimed memory (it stays paused on disk): %w", sb.id, err)
	}
	sb.closeAgent()
	if err := r.incoming(ctx, sb, q, path, true); err != nil {
		return fail(err)
	}
	if !r.cfg.noAgentWait {
		// The guest's memory holds the session of the host end that went
		// with the old QEMU: each try is bounded, and one that fails
		// drops the channel so the next starts a new session.
		if err := r.waitAgentFor(ctx, sb, r.cfg.bootTimeout(), agentAttempt); err != nil {
			return fail(err)
		}
		if err := r.setIdentity(ctx, sb); err != nil {
			return fail(err)
		}
	}
	sb.mu.Lock()
	sb.reclaimed, sb.parking = false, false
	stopping = sb.stopping
	sb.mu.Unlock()
	if stopping {
		// A Stop came meanwhile and took the planned exit for the end:
		// make it one.
		_ = vmm.Kill(pid)
	}
	if err := writeRunState(sb.st.StateDir, runState{ID: sb.id, Pid: pid, StartTime: sb.st.StartTime, Args: sb.st.Args}); err != nil {
		log.G(ctx).Error("vm restore: record it", log.SandboxID(sb.id), log.Err(err))
	}
	if err := os.RemoveAll(filepath.Join(sb.st.StateDir, reclaimDir)); err != nil {
		log.G(ctx).Warn("vm restore: remove the reclaimed state", log.SandboxID(sb.id), log.Err(err))
	}
	log.G(ctx).Debug("vm restored from reclaim", log.SandboxID(sb.id), "ms", time.Since(t0).Milliseconds())
	return nil
}

// setClock steps the guest's clock to the host's (it stood still while
// the VM was paused) through the guest init's identity route.
func (r *Runtime) setClock(ctx context.Context, sb *sandbox) error {
	return r.postGuest(ctx, sb, "identity", vmchan.IdentityPath, vmchan.Identity{TimeNS: time.Now().UnixNano()})
}

// cloneMAC is the MAC of a sandbox restored from a snapshot (a fork): its
// own, derived from its ID (locally administered, unicast), never the
// attachment's fixed one nor its gateway's.
func cloneMAC(id string, avoid ...net.HardwareAddr) net.HardwareAddr {
	for salt := byte(0); ; salt++ {
		h := sha256.Sum256(append([]byte(id), salt))
		mac := net.HardwareAddr(h[:6])
		mac[0] = mac[0]&^0x01 | 0x02
		if !slices.ContainsFunc(avoid, func(a net.HardwareAddr) bool { return bytes.Equal(a, mac) }) {
			return mac
		}
	}
}

// setGuestNeighbour points the namespace's neighbour entry for the guest's
// address on dev at mac (permanent, as the node's netpolicy makes it): a
// fork's NIC has its own MAC, and replies must reach it.
func setGuestNeighbour(nsPath, dev string, addr net.IP, mac net.HardwareAddr) error {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return fmt.Errorf("netns %s: %w: %w", nsPath, errdefs.ErrInternal, err)
	}
	defer func() { _ = ns.Close() }()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("netns %s: %w: %w", nsPath, errdefs.ErrInternal, err)
	}
	defer h.Close()
	l, err := h.LinkByName(dev)
	if err != nil {
		return fmt.Errorf("netns %s device %s: %w: %w", nsPath, dev, errdefs.ErrInternal, err)
	}
	fam := unix.AF_INET
	if addr.To4() == nil {
		fam = unix.AF_INET6
	}
	if err := h.NeighSet(&netlink.Neigh{LinkIndex: l.Attrs().Index, Family: fam, State: netlink.NUD_PERMANENT, IP: addr, HardwareAddr: mac}); err != nil {
		return fmt.Errorf("netns %s guest neighbour %s: %w: %w", nsPath, addr, errdefs.ErrInternal, err)
	}
	return nil
}

// argsPmem says whether QEMU arguments give the VM virtio-pmem devices.
func argsPmem(args []string) bool {
	for i, a := range args {
		if a == "-device" && i+1 < len(args) && strings.HasPrefix(args[i+1], "virtio-pmem") {
			return true
		}
	}
	return false
}
