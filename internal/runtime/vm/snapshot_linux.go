package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/fsutil"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
)

var (
	_ runtime.Snapshotter = (*Runtime)(nil)
	_ runtime.Forker      = (*Runtime)(nil)
)

// A snapshot directory holds:
//
//	vm-snapshot.json  the manifest (snapshotManifest)
//	state             QEMU's migration stream: device state, and guest RAM
//	                  only when it was not a shared file (x-ignore-shared)
//	memory            the guest's RAM file as it was (sparse); restores map
//	                  it private, so they share its pages until they write
//	rw.ext4           the writable disk, config.img the configuration disk
const (
	manifestFile  = "vm-snapshot.json"
	manifestV     = 1
	snapStateFile = "state"
	snapMemFile   = "memory"
)

// snapshotManifest describes a snapshot: what QEMU ran with and what the
// files must be.
type snapshotManifest struct {
	Version int `json:"version"`
	// Accel is the accelerator kind of the VM; a snapshot is refused by a
	// node of another kind (a TCG guest's CPU state does not run under KVM
	// and the other way round).
	Accel    string `json:"accel"`
	Machine  string `json:"machine"`
	QEMU     string `json:"qemu"`
	MemoryMB int64  `json:"memory_mb"`
	VCPUs    int    `json:"vcpus"`
	// SourceID, SourceStateDir, SourceMem and Args are the source's QEMU
	// command line and the paths in it a restore replaces by its own.
	SourceID       string              `json:"source_id"`
	SourceStateDir string              `json:"source_state_dir"`
	SourceMem      string              `json:"source_mem"`
	Args           []string            `json:"args"`
	Layers         []manifestLayer     `json:"layers"`
	Network        runtime.NetworkMode `json:"network"`
	// IgnoreShared: the stream was written with x-ignore-shared (the RAM
	// is in the memory file, not the stream); a restore loads it with the
	// same capability, or the stream does not parse.
	IgnoreShared bool `json:"ignore_shared"`
	// MemoryFile is where the RAM file is when not in the directory
	// (a fork's, in the memory dir); empty means snapMemFile.
	MemoryFile string `json:"memory_file,omitempty"`
	// Files are the sizes (and, for the small ones, digests) the files
	// had when written: a truncated or corrupted snapshot is refused
	// before anything is made.
	Files map[string]vmm.FileSum `json:"files"`
	// Frozen is how long the source was paused for the snapshot.
	FrozenNS int64     `json:"frozen_ns"`
	Created  time.Time `json:"created"`
}

type manifestLayer struct {
	Digest string `json:"digest"`
	Path   string `json:"path"`
}

// Snapshot implements runtime.Snapshotter: QMP stop, migrate of the device
// state into dir (guest RAM stays out of the stream: it is a shared file),
// a copy of the RAM file and the disks, cont. The source is paused only
// while these are written (tens of ms for the state, the copy of the RAM
// it touched and of the writable disk's data).
func (r *Runtime) Snapshot(ctx context.Context, id, dir string) (runtime.SnapshotInfo, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.SnapshotInfo{}, err
	}
	m, err := r.snapshotTo(ctx, sb, dir, "", r.privateSnapshots)
	if err != nil {
		return runtime.SnapshotInfo{}, err
	}
	var n int64
	for _, f := range m.Files {
		n += f.Size
	}
	return runtime.SnapshotInfo{Memory: true, Bytes: n, SourceFrozen: time.Duration(m.FrozenNS)}, nil
}

// snapshotTo writes sb's snapshot into dir, its RAM file at memDst (""
// means dir/memory). With streamRAM the guest's RAM goes into the stream
// and the memory file is empty (restores then get private copies: the
// benchmark's comparison). On error nothing it wrote is left.
func (r *Runtime) snapshotTo(ctx context.Context, sb *sandbox, dir, memDst string, streamRAM bool) (_ *snapshotManifest, err error) {
	sb.startMu.Lock()
	defer sb.startMu.Unlock()
	sb.mu.Lock()
	started, q, st := sb.started, sb.qmp, sb.st
	sb.mu.Unlock()
	select {
	case <-sb.exit.Done():
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q has stopped; snapshot running or paused sandboxes", sb.id)
	default:
	}
	if sb.reclaimed {
		return r.snapshotReclaimed(ctx, sb, st, dir, memDst)
	}
	if !started || q == nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q never started; snapshot running or paused sandboxes", sb.id)
	}
	if st.MemPath == "" {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q was made by a backend version without a RAM file; it cannot be snapshotted", sb.id)
	}
	memDst, written := snapshotPaths(dir, memDst)
	defer func() {
		if err != nil {
			removeFiles(written)
		}
	}()
	ignoreShared := st.MemShared && !streamRAM
	if _, err := q.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": ignoreShared}}}); err != nil {
		return nil, fmt.Errorf("vm %s snapshot: %w", sb.id, err)
	}
	// QEMU's default cap is 128 MiB/s: it would stretch the pause.
	if _, err := q.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(100) << 30}); err != nil {
		return nil, fmt.Errorf("vm %s snapshot: %w", sb.id, err)
	}
	status, err := q.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("vm %s snapshot: %w", sb.id, err)
	}
	running := status == "running"
	if !running && status != "paused" {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "vm sandbox %q is %q; snapshot running or paused sandboxes", sb.id, status)
	}
	if st.Balloon {
		// Restores map the RAM file private, and QEMU 7.2 discards a page
		// they report free by punching it out of that file: the
		// snapshot's and every other restore's. The saved guest has its
		// balloon driver unbound, so restores never report.
		if err := r.balloonSet(ctx, sb, q, running, false); err != nil {
			return nil, fmt.Errorf("vm %s snapshot: free page reporting must be off in a snapshot: %w", sb.id, err)
		}
		if st.MemShared {
			// Bound again, a paused source too (it runs for the call).
			defer func() {
				if err := r.balloonSet(context.WithoutCancel(ctx), sb, q, running, true); err != nil {
					log.G(ctx).Warn("vm snapshot: free page reporting stays off on the source", log.SandboxID(sb.id), log.Err(err))
				}
			}()
		}
	}
	t0 := time.Now()
	if running {
		if _, err := q.Execute(ctx, "stop", nil); err != nil {
			return nil, fmt.Errorf("vm %s snapshot: %w", sb.id, err)
		}
	}
	var frozen time.Duration
	err = func() error {
		if running {
			// Whatever happens, the source runs on.
			defer func() {
				_, cerr := q.Execute(context.WithoutCancel(ctx), "cont", nil)
				frozen = time.Since(t0)
				if cerr != nil {
					log.G(ctx).Error("vm snapshot: resume of the source failed", log.SandboxID(sb.id), log.Err(cerr))
				}
			}()
		}
		if err := migrateToFile(ctx, q, filepath.Join(dir, snapStateFile)); err != nil {
			return fmt.Errorf("vm %s snapshot: %w", sb.id, err)
		}
		if ignoreShared {
			if err := copySparse(st.MemPath, memDst); err != nil {
				return fmt.Errorf("vm %s snapshot of its memory: %w", sb.id, err)
			}
		} else if err := vmm.MakeSparse(memDst, st.MemoryMB<<20); err != nil {
			// RAM mapped private went into the stream; restores map an
			// empty file of its size.
			return fmt.Errorf("vm %s snapshot of its memory: %w", sb.id, err)
		}
		return copyDisks(sb.id, st.StateDir, dir)
	}()
	if err != nil {
		return nil, err
	}
	m := r.newManifest(sb, st)
	m.FrozenNS, m.IgnoreShared = int64(frozen), ignoreShared
	return r.writeManifest(ctx, sb, dir, memDst, m)
}

// snapshotPaths are the RAM file of a snapshot into dir (memDst, or
// dir/memory when it is "") and every file the snapshot writes: what goes
// again when it fails.
func snapshotPaths(dir, memDst string) (string, []string) {
	if memDst == "" {
		memDst = filepath.Join(dir, snapMemFile)
	}
	return memDst, []string{filepath.Join(dir, snapStateFile), memDst, filepath.Join(dir, "rw.ext4"), filepath.Join(dir, "config.img"), filepath.Join(dir, manifestFile)}
}

func removeFiles(paths []string) {
	for _, p := range paths {
		_ = os.Remove(p)
	}
}

// copyDisks copies the writable and configuration disks of sandbox id
// from its StateDir sd into the snapshot dir.
func copyDisks(id, sd, dir string) error {
	for _, f := range []string{"rw.ext4", "config.img"} {
		if err := copySparse(filepath.Join(sd, f), filepath.Join(dir, f)); err != nil {
			return fmt.Errorf("vm %s snapshot of its disk: %w", id, err)
		}
	}
	return nil
}

// newManifest is the manifest of sb's snapshot as its state st says; the
// snapshot adds how it was taken, writeManifest the layers and files.
func (r *Runtime) newManifest(sb *sandbox, st handleState) *snapshotManifest {
	m := &snapshotManifest{Version: manifestV, Accel: st.Accel, Machine: r.cfg.Machine, QEMU: r.Info().Version, MemoryMB: st.MemoryMB, VCPUs: st.VCPUs,
		SourceID: sb.id, SourceStateDir: st.StateDir, SourceMem: st.MemPath, Args: st.Args, Network: sb.spec.Network.Mode,
		Files: map[string]vmm.FileSum{}, Created: time.Now().UTC()}
	if m.Network == "" && st.Addr != "" {
		m.Network = runtime.NetworkTap // a sandbox found by Recover has no spec
	}
	return m
}

// writeManifest completes m (layers, file sums) and writes it into dir.
func (r *Runtime) writeManifest(ctx context.Context, sb *sandbox, dir, memDst string, m *snapshotManifest) (*snapshotManifest, error) {
	if memDst != filepath.Join(dir, snapMemFile) {
		m.MemoryFile = memDst
	}
	for _, l := range sb.spec.Rootfs.Layers {
		m.Layers = append(m.Layers, manifestLayer{Digest: l.Digest, Path: l.Path})
	}
	for name, path := range map[string]string{snapStateFile: filepath.Join(dir, snapStateFile), snapMemFile: memDst,
		"rw.ext4": filepath.Join(dir, "rw.ext4"), "config.img": filepath.Join(dir, "config.img")} {
		sum, err := vmm.SumFile(path, name == snapStateFile || name == "config.img")
		if err != nil {
			return nil, fmt.Errorf("vm %s snapshot: %w", sb.id, err)
		}
		m.Files[name] = sum
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("vm %s snapshot manifest: %w: %w", sb.id, errdefs.ErrInternal, err)
	}
	if err := os.WriteFile(filepath.Join(dir, manifestFile), b, 0o600); err != nil {
		return nil, fmt.Errorf("vm %s snapshot manifest: %w: %w", sb.id, errdefs.ErrInternal, err)
	}
	log.G(ctx).Debug("vm snapshot", log.SandboxID(sb.id), "frozen_ms", time.Duration(m.FrozenNS).Milliseconds(), "state_bytes", m.Files[snapStateFile].Size)
	return m, nil
}

// balloonSet binds (on) or unbinds the guest's balloon driver around a
// snapshot; a paused guest runs for it (and is paused again).
func (r *Runtime) balloonSet(ctx context.Context, sb *sandbox, q *qmpClient, running, on bool) error {
	if !running {
		if _, err := q.Execute(ctx, "cont", nil); err != nil {
			return err
		}
		defer func() {
			if _, err := q.Execute(context.WithoutCancel(ctx), "stop", nil); err != nil {
				log.G(ctx).Error("vm snapshot: pause of the source again failed", log.SandboxID(sb.id), log.Err(err))
			}
		}()
	}
	return r.setBalloon(ctx, sb, on)
}

// snapshotReclaimed is the snapshot of a reclaimed VM: its saved state
// (the RAM in the stream) is the snapshot's, with an empty memory file of
// the guest's size, as a snapshot with the RAM streamed; nothing runs.
func (r *Runtime) snapshotReclaimed(ctx context.Context, sb *sandbox, st handleState, dir, memDst string) (_ *snapshotManifest, err error) {
	memDst, written := snapshotPaths(dir, memDst)
	defer func() {
		if err != nil {
			removeFiles(written)
		}
	}()
	if err := copySparse(filepath.Join(st.StateDir, reclaimDir, reclaimStateFile), filepath.Join(dir, snapStateFile)); err != nil {
		return nil, fmt.Errorf("vm %s snapshot of its reclaimed state: %w", sb.id, err)
	}
	if err := vmm.MakeSparse(memDst, st.MemoryMB<<20); err != nil {
		return nil, fmt.Errorf("vm %s snapshot of its memory: %w", sb.id, err)
	}
	if err := copyDisks(sb.id, st.StateDir, dir); err != nil {
		return nil, err
	}
	return r.writeManifest(ctx, sb, dir, memDst, r.newManifest(sb, st))
}

// migrateToFile streams QEMU's state into path and waits for the end.
func migrateToFile(ctx context.Context, q *qmpClient, path string) error {
	if _, err := q.Execute(ctx, "migrate", map[string]any{"uri": "exec:cat > " + shellQuote(path)}); err != nil {
		return err
	}
	for wait := 500 * time.Microsecond; ; wait = min(2*wait, 10*time.Millisecond) {
		raw, err := q.Execute(ctx, "query-migrate", nil)
		if err != nil {
			return err
		}
		var mi struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := json.Unmarshal(raw, &mi); err != nil {
			return fmt.Errorf("query-migrate reply: %w: %w", errdefs.ErrInternal, err)
		}
		switch mi.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("migration to %s: %w: %s %s", path, errdefs.ErrInternal, mi.Status, mi.ErrorDesc)
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			_, _ = q.Execute(context.WithoutCancel(ctx), "migrate_cancel", nil)
			return fmt.Errorf("migration to %s: %w: %w", path, errdefs.ErrDeadlineExceeded, ctx.Err())
		}
	}
}

// Restore implements runtime.Snapshotter: it checks the snapshot in dir
// (manifest, accelerator kind, machine, sizes and digests) before it makes
// anything, then prepares the sandbox; Start runs QEMU with -incoming, loads
// the state, runs the guest on and gives it its own identity.
func (r *Runtime) Restore(ctx context.Context, spec runtime.Spec, dir string) (runtime.Handle, error) {
	rf, err := loadSnapshot(dir)
	if err != nil {
		return runtime.Handle{}, err
	}
	return r.create(ctx, spec, rf)
}

// restoreFrom is a checked snapshot to restore.
type restoreFrom struct {
	dir string
	m   snapshotManifest
}

func (rf *restoreFrom) memFile() string {
	if rf.m.MemoryFile != "" {
		return rf.m.MemoryFile
	}
	return filepath.Join(rf.dir, snapMemFile)
}

// loadSnapshot reads and checks dir's manifest and files.
func loadSnapshot(dir string) (*restoreFrom, error) {
	b, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if err != nil {
		return nil, errdefs.Invalid("snapshot", "%s holds no vm snapshot (%s): %v", dir, manifestFile, err)
	}
	rf := &restoreFrom{dir: dir}
	if err := json.Unmarshal(b, &rf.m); err != nil {
		return nil, errdefs.Invalid("snapshot", "%s: the manifest %s is corrupted: %v; take the snapshot again", dir, manifestFile, err)
	}
	if rf.m.Version != manifestV {
		return nil, errdefs.Invalid("snapshot", "%s: manifest version %d, this backend reads %d; take the snapshot again", dir, rf.m.Version, manifestV)
	}
	for _, name := range []string{snapStateFile, snapMemFile, "rw.ext4", "config.img"} {
		want, ok := rf.m.Files[name]
		if !ok {
			return nil, errdefs.Invalid("snapshot", "%s: the manifest lists no %s; take the snapshot again", dir, name)
		}
		path := filepath.Join(dir, name)
		if name == snapMemFile {
			path = rf.memFile()
		}
		got, err := vmm.SumFile(path, want.SHA256 != "")
		switch {
		case err != nil:
			return nil, errdefs.Invalid("snapshot", "%s: file %s: %v; the snapshot is incomplete, take it again", dir, name, err)
		case got.Size != want.Size:
			return nil, errdefs.Invalid("snapshot", "%s: file %s is %d bytes, the snapshot wrote %d: it is truncated or was changed; take the snapshot again", dir, name, got.Size, want.Size)
		case got.SHA256 != want.SHA256:
			return nil, errdefs.Invalid("snapshot", "%s: file %s is corrupted (sha256 %s, the snapshot wrote %s); take the snapshot again", dir, name, got.SHA256, want.SHA256)
		}
	}
	if rf.m.Files[snapMemFile].Size != rf.m.MemoryMB<<20 {
		return nil, errdefs.Invalid("snapshot", "%s: the memory file is %d bytes for a %d MiB guest; take the snapshot again", dir, rf.m.Files[snapMemFile].Size, rf.m.MemoryMB)
	}
	return rf, nil
}

// check refuses a snapshot this backend cannot restore for spec.
func (rf *restoreFrom) check(r *Runtime, spec runtime.Spec, vcpus int, memMB int64) error {
	m := &rf.m
	if m.Accel != r.accel {
		return errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s was taken under -accel %s and this node runs VMs under %s (%s): a guest's CPU state does not move between accelerator kinds; restore it on a %s node",
			rf.dir, m.Accel, r.accel, r.why, m.Accel)
	}
	if m.Machine != r.cfg.Machine {
		return errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s is of a %s machine and this node makes %s ones (node.backends.vm.machine)", rf.dir, m.Machine, r.cfg.Machine)
	}
	if spec.Network.Mode != m.Network {
		return errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s has network mode %q and the new sandbox %q; restore it with the same kind of network", rf.dir, m.Network, spec.Network.Mode)
	}
	if len(spec.Rootfs.Layers) != len(m.Layers) {
		return errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s has %d image layers and the new sandbox %d; restore it on the snapshot's image", rf.dir, len(m.Layers), len(spec.Rootfs.Layers))
	}
	for i, l := range spec.Rootfs.Layers {
		if l.Digest != m.Layers[i].Digest {
			return errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s layer %d is %s and the new sandbox's %s; restore it on the snapshot's image", rf.dir, i, m.Layers[i].Digest, l.Digest)
		}
	}
	if n := vcpus; n < m.VCPUs && spec.Resources.CPU > 0 {
		return errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s has %d vCPUs and the new sandbox asks for %d; a restore keeps the snapshot's", rf.dir, m.VCPUs, n)
	}
	_ = memMB // a restore keeps the snapshot's RAM size
	return nil
}

// prepare makes the restore's files in spec.StateDir and its RAM file at
// mem, and returns its QEMU command line.
func (rf *restoreFrom) prepare(ctx context.Context, spec runtime.Spec, mem, mac string) ([]string, error) {
	src := rf.memFile()
	// With the RAM in the file: the same inode for every restore; QEMU
	// maps it private, so they all share its page cache until they write.
	// With the RAM in the stream, a private mapping of the (empty) file
	// would cost every page twice (a tmpfs page for the hole and the
	// copy QEMU writes): the restore gets a RAM file of its own, shared,
	// which QEMU makes, as a booted VM's.
	if rf.m.IgnoreShared {
		if err := os.Link(src, mem); err != nil {
			abs, _ := filepath.Abs(src)
			if err := os.Symlink(abs, mem); err != nil {
				return nil, fmt.Errorf("vm restore memory file: %w: %w", errdefs.ErrInternal, err)
			}
		}
	}
	for _, f := range []string{snapStateFile, "rw.ext4", "config.img"} {
		if err := copySparse(filepath.Join(rf.dir, f), filepath.Join(spec.StateDir, f)); err != nil {
			return nil, fmt.Errorf("vm restore: %w", err)
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("vm restore: %w: %w", errdefs.ErrCanceled, err)
	}
	m := &rf.m
	args := make([]string, len(m.Args))
	for i, a := range m.Args {
		switch {
		case a == "opendsec-"+m.SourceID:
			a = "opendsec-" + spec.ID
		case strings.HasPrefix(a, "memory-backend-file,id=ram0,"):
			// Guest RAM only: a pmem layer's backing stays shared.
			a = strings.ReplaceAll(a, "mem-path="+m.SourceMem, "mem-path="+mem)
			if m.IgnoreShared {
				a = strings.ReplaceAll(a, "share=on", "share=off")
			} else {
				a = strings.ReplaceAll(a, "share=off", "share=on")
			}
		case mac != "" && strings.Contains(a, ",netdev=net0,mac="):
			// The NIC's MAC is the clone's own (the migration stream
			// brings the source's; the guest init sets this one).
			a = a[:strings.Index(a, ",mac=")] + ",mac=" + mac
		default:
			for j, l := range m.Layers {
				a = strings.ReplaceAll(a, "file="+l.Path+",", "file="+spec.Rootfs.Layers[j].Path+",")
			}
			a = strings.ReplaceAll(a, m.SourceStateDir+"/", spec.StateDir+"/")
		}
		args[i] = a
	}
	return args, nil
}

// Fork implements runtime.Forker: one snapshot of the source (its RAM file
// copied into the memory dir), then one restore per spec, each mapping
// that copy private: the forks share its pages until they write.
func (r *Runtime) Fork(ctx context.Context, id string, specs []runtime.Spec) (_ []runtime.ForkResult, err error) {
	sb, err := r.get(id)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(sb.st.StateDir, "fork-")
	if err != nil {
		return nil, fmt.Errorf("vm fork dir: %w: %w", errdefs.ErrInternal, err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	gold := r.memPath("fork-" + hex.EncodeToString(rnd[:]))
	defer func() { _ = os.Remove(gold) }()
	m, err := r.snapshotTo(ctx, sb, dir, gold, r.privateSnapshots)
	if err != nil {
		return nil, err
	}
	rf, err := loadSnapshot(dir)
	if err != nil {
		return nil, err
	}
	create := func(ctx context.Context, s runtime.Spec) (runtime.Handle, error) { return r.create(ctx, s, rf) }
	return vmm.ForkEach(ctx, specs, time.Duration(m.FrozenNS), create, r.Delete)
}

// copySparse is fsutil.CopySparse with the file's name in its error.
func copySparse(src, dst string) error {
	if err := fsutil.CopySparse(src, dst); err != nil {
		return fmt.Errorf("copy %s: %w: %w", filepath.Base(src), errdefs.ErrInternal, err)
	}
	return nil
}
