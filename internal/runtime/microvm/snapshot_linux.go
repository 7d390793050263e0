package microvm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/fsutil"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
)

// A snapshot directory holds Firecracker's state file (SnapshotStateFile)
// and memory file (SnapshotMemFile) with their SnapshotMeta
// (SnapshotMetaFile), and the sandbox's disks as they were while the VM
// was paused, described by the manifest (manifestFile). The state and
// memory files are root's and read-only (0444): every restore hard-links
// them into its own jail and Firecracker maps the memory MAP_PRIVATE, so
// clones share its pages until they write them.
const manifestFile = "microvm-snapshot.json"

type manifest struct {
	Version  int                 `json:"version"`
	SourceID string              `json:"source_id"`
	Layers   []string            `json:"layers"` // digests, topmost first
	Network  runtime.NetworkMode `json:"network"`
	RWSize   int64               `json:"rw_size"`
	Config   vmm.FileSum         `json:"config"`
	FrozenNS int64               `json:"frozen_ns"`
	Created  time.Time           `json:"created"`
}

// Snapshot implements runtime.Snapshotter: PATCH /vm Paused, PUT
// /snapshot/create (Full) into the jail, a copy of the disks, PATCH /vm
// Resumed; the files then move to dir. The source is paused only while
// its state, memory and disks are written.
func (r *Runtime) Snapshot(ctx context.Context, id, dir string) (runtime.SnapshotInfo, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.SnapshotInfo{}, err
	}
	if _, err := r.snapshotTo(ctx, sb, dir); err != nil {
		return runtime.SnapshotInfo{}, err
	}
	var n int64
	for _, f := range []string{SnapshotStateFile, SnapshotMemFile, "rw.ext4", "config.img"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err == nil {
			n += st.Size()
		}
	}
	return runtime.SnapshotInfo{Memory: true, Bytes: n}, nil
}

func (r *Runtime) snapshotTo(ctx context.Context, sb *sandbox, dir string) (frozen time.Duration, err error) {
	sb.startMu.Lock()
	defer sb.startMu.Unlock()
	sb.mu.Lock()
	started, st := sb.started, sb.st
	sb.mu.Unlock()
	select {
	case <-sb.exit.Done():
		return 0, errdefs.New(errdefs.ErrFailedPrecondition, "microvm sandbox %q has stopped; snapshot running or paused sandboxes", sb.id)
	default:
	}
	if !started {
		return 0, errdefs.New(errdefs.ErrFailedPrecondition, "microvm sandbox %q never started; snapshot running or paused sandboxes", sb.id)
	}
	written := []string{SnapshotStateFile, SnapshotMemFile, SnapshotMetaFile, "rw.ext4", "config.img", manifestFile}
	defer func() {
		if err != nil {
			for _, f := range written {
				_ = os.Remove(filepath.Join(dir, f))
			}
		}
	}()
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	jailDir := "/snapshot-" + hex.EncodeToString(rnd[:])
	hostDir := filepath.Join(r.cfg.Root(st.JailID), jailDir)
	if err := os.Mkdir(hostDir, 0o700); err != nil {
		return 0, errdefs.New(errdefs.ErrInternal, "microvm snapshot dir: %w", err)
	}
	defer func() { _ = os.RemoveAll(hostDir) }()
	if err := os.Chown(hostDir, st.UID, st.UID); err != nil {
		return 0, errdefs.New(errdefs.ErrInternal, "microvm snapshot dir: %w", err)
	}
	c := r.client(st)
	info, err := c.InstanceInfo(ctx)
	if err != nil {
		return 0, fmt.Errorf("microvm %s snapshot: %w", sb.id, err)
	}
	wasPaused := info.State == "Paused"
	t0 := time.Now()
	err = func() error {
		if !wasPaused {
			defer func() {
				if rerr := c.PatchVM(context.WithoutCancel(ctx), VMResumed); rerr != nil && err == nil {
					err = fmt.Errorf("microvm %s snapshot: resume the source: %w", sb.id, rerr)
				}
				frozen = time.Since(t0)
			}()
		}
		if err := vmmSnapshot(ctx, c, jailDir); err != nil {
			return fmt.Errorf("microvm %s: %w", sb.id, err)
		}
		for _, f := range []string{"rw.ext4", "config.img"} {
			if err := fsutil.CopySparse(filepath.Join(st.StateDir, f), filepath.Join(dir, f)); err != nil {
				return fmt.Errorf("microvm %s snapshot of its disk: %w", sb.id, err)
			}
		}
		return nil
	}()
	if err != nil {
		return 0, err
	}
	meta := SnapshotMeta{Accel: st.Accel, MemoryMB: st.Plan.MemoryMB, VCPUs: st.Plan.VCPUs}
	if err := takeVMFiles(hostDir, dir, st.UID, meta); err != nil {
		return 0, errdefs.New(errdefs.ErrInternal, "microvm %s snapshot: %w", sb.id, err)
	}
	m := manifest{Version: 1, SourceID: sb.id, Network: runtime.NetworkNone, FrozenNS: int64(frozen), Created: time.Now().UTC()}
	if st.Plan.Tap != "" {
		m.Network = runtime.NetworkTap
	}
	// The layers' digests come from the link names' targets: the plan has
	// jail paths, the manifest the source's digests from its Handle.
	m.Layers = st.Layers
	rw, err := os.Stat(filepath.Join(dir, "rw.ext4"))
	if err != nil {
		return 0, errdefs.New(errdefs.ErrInternal, "microvm snapshot disk: %w", err)
	}
	m.RWSize = rw.Size()
	if m.Config, err = vmm.SumFile(filepath.Join(dir, "config.img"), true); err != nil {
		return 0, errdefs.New(errdefs.ErrInternal, "microvm snapshot config disk: %w", err)
	}
	b, _ := json.MarshalIndent(m, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, manifestFile), b, 0o600); err != nil {
		return 0, errdefs.New(errdefs.ErrInternal, "microvm snapshot manifest: %w", err)
	}
	return frozen, nil
}

// takeVMFiles moves the state and memory files firecracker wrote in
// hostDir (a directory the VM's uid owns, so a compromised VMM could
// have swapped a file for a symlink or a hard link to a host file) into
// dir as root's read-only files, and writes the metadata there. hostDir
// is made root's first, so its entries no longer change; each file must
// be a regular file of uid with one link, opened without following a
// symlink, and is hashed, copied, chowned and chmoded only through that
// handle.
func takeVMFiles(hostDir, dir string, uid int, meta SnapshotMeta) error {
	if err := unix.Lchown(hostDir, 0, 0); err != nil {
		return fmt.Errorf("snapshot dir: %w", err)
	}
	if fi, err := os.Lstat(hostDir); err != nil || !fi.IsDir() {
		return fmt.Errorf("snapshot dir %s is no longer a directory (%v): refused", hostDir, err)
	}
	files := map[string]*os.File{}
	defer func() {
		for _, f := range files {
			_ = f.Close()
		}
	}()
	for _, name := range []string{SnapshotStateFile, SnapshotMemFile} {
		f, err := openVMFile(filepath.Join(hostDir, name), uid)
		if err != nil {
			return err
		}
		files[name] = f
	}
	var err error
	if meta.StateSize, meta.StateSHA256, err = vmm.HashReader(io.NewSectionReader(files[SnapshotStateFile], 0, 1<<62)); err != nil {
		return fmt.Errorf("snapshot state file: %w", err)
	}
	mem, err := files[SnapshotMemFile].Stat()
	if err != nil {
		return fmt.Errorf("snapshot memory file: %w", err)
	}
	meta.MemSize = mem.Size()
	for _, name := range []string{SnapshotStateFile, SnapshotMemFile} {
		if err := moveVMFile(files[name], filepath.Join(hostDir, name), filepath.Join(dir, name)); err != nil {
			return fmt.Errorf("snapshot %s: %w", name, err)
		}
	}
	if err := writeMetaFile(dir, meta); err != nil {
		return err
	}
	return os.Chmod(filepath.Join(dir, SnapshotMetaFile), 0o444)
}

// openVMFile opens path, never through a symlink, as a regular file uid
// owns with a single link.
func openVMFile(path string, uid int) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != uid || st.Nlink != 1 {
		_ = f.Close()
		return nil, fmt.Errorf("%s is not a regular file of the VM's uid %d with one link (mode %o, uid %d, %d links): refused", path, uid, st.Mode, st.Uid, st.Nlink)
	}
	return f, nil
}

// moveVMFile renames src (opened as f) to dst, or copies f across
// filesystems, and makes dst root's and read-only through f (or the
// copy's handle), checking the renamed entry is f's inode.
func moveVMFile(f *os.File, src, dst string) error {
	err := os.Rename(src, dst)
	if err == nil {
		fi, ferr := f.Stat()
		di, derr := os.Lstat(dst)
		if ferr != nil || derr != nil || !os.SameFile(fi, di) {
			_ = os.Remove(dst)
			return fmt.Errorf("%s changed while it was moved: refused", src)
		}
		return errors.Join(f.Chown(0, 0), f.Chmod(0o444))
	}
	if !errors.Is(err, unix.EXDEV) {
		return err
	}
	if err := fsutil.CopySparseFrom(f, dst); err != nil {
		return err
	}
	if err := os.Chmod(dst, 0o444); err != nil {
		return err
	}
	return os.Remove(src)
}

// Restore implements runtime.Snapshotter: the snapshot is checked
// (metadata, sizes, the state file's digest, the accelerator kind, the
// disks, the image's layers and the network mode) before anything is
// made; Start loads it into a fresh jailed firecracker with a File memory
// backend and the clone's tap, and gives the guest its own identity.
func (r *Runtime) Restore(ctx context.Context, spec runtime.Spec, dir string) (runtime.Handle, error) {
	rf, err := r.loadSnapshot(dir)
	if err != nil {
		return runtime.Handle{}, err
	}
	return r.create(ctx, spec, rf)
}

func (r *Runtime) loadSnapshot(dir string) (*restoreFrom, error) {
	meta, err := CheckSnapshot(dir, string(r.accel.Kind))
	if err != nil {
		return nil, err
	}
	rf := &restoreFrom{dir: dir, meta: meta}
	b, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if err != nil {
		return nil, errdefs.Invalid("snapshot", "%s holds no microvm manifest (%s): %v; take the snapshot again", dir, manifestFile, err)
	}
	if err := json.Unmarshal(b, &rf.man); err != nil || rf.man.Version != 1 {
		return nil, errdefs.Invalid("snapshot", "%s: the manifest %s is corrupted or of another version (%v); take the snapshot again", dir, manifestFile, err)
	}
	if st, err := os.Stat(filepath.Join(dir, "rw.ext4")); err != nil || st.Size() != rf.man.RWSize {
		return nil, errdefs.Invalid("snapshot", "%s: the writable disk is missing or not %d bytes (%v): truncated; take the snapshot again", dir, rf.man.RWSize, err)
	}
	if sum, err := vmm.SumFile(filepath.Join(dir, "config.img"), true); err != nil || sum != rf.man.Config {
		return nil, errdefs.Invalid("snapshot", "%s: the configuration disk is missing or corrupted (%v); take the snapshot again", dir, err)
	}
	return rf, nil
}

// check refuses a snapshot spec cannot be restored from.
func (rf *restoreFrom) check(_ *Runtime, spec runtime.Spec) error {
	if spec.Network.Mode != rf.man.Network {
		return errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s has network mode %q and the new sandbox %q; restore it with the same kind of network", rf.dir, rf.man.Network, spec.Network.Mode)
	}
	if len(spec.Rootfs.Layers) != len(rf.man.Layers) {
		return errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s has %d image layers and the new sandbox %d; restore it on the snapshot's image", rf.dir, len(rf.man.Layers), len(spec.Rootfs.Layers))
	}
	for i, l := range spec.Rootfs.Layers {
		if l.Digest != rf.man.Layers[i] {
			return errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s layer %d is %s and the new sandbox's %s; restore it on the snapshot's image", rf.dir, i, rf.man.Layers[i], l.Digest)
		}
	}
	return nil
}

// copyDisks copies the snapshot's disks into the new sandbox's StateDir.
func (rf *restoreFrom) copyDisks(sd string) error {
	for _, f := range []string{"rw.ext4", "config.img"} {
		if err := fsutil.CopySparse(filepath.Join(rf.dir, f), filepath.Join(sd, f)); err != nil {
			return errdefs.New(errdefs.ErrInternal, "microvm restore disk %s: %w", f, err)
		}
	}
	return nil
}

// link puts the state and memory files into the jail at /snapshot: hard
// links (one inode for every clone: shared page cache) or read-only binds.
func (rf *restoreFrom) link(root string, uid int) error {
	d := filepath.Join(root, "snapshot")
	if err := os.Mkdir(d, 0o700); err != nil {
		return errdefs.New(errdefs.ErrInternal, "microvm restore: %w", err)
	}
	if err := os.Chown(d, uid, uid); err != nil {
		return errdefs.New(errdefs.ErrInternal, "microvm restore: %w", err)
	}
	for _, f := range []string{SnapshotStateFile, SnapshotMemFile} {
		if err := placeFile(filepath.Join(rf.dir, f), filepath.Join(d, f), -1, uid); err != nil {
			return errdefs.New(errdefs.ErrInternal, "microvm restore %s: %w", f, err)
		}
	}
	return nil
}

// Fork implements runtime.Forker: one snapshot of the source into its
// StateDir, then one restore per spec; every fork's memory is the same
// file's pages (MAP_PRIVATE), shared until written. Either all are made
// or none.
func (r *Runtime) Fork(ctx context.Context, id string, specs []runtime.Spec) (_ []runtime.ForkResult, err error) {
	sb, err := r.get(id)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(sb.st.StateDir, "fork-")
	if err != nil {
		return nil, errdefs.New(errdefs.ErrInternal, "microvm fork dir: %w", err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	frozen, err := r.snapshotTo(ctx, sb, dir)
	if err != nil {
		return nil, err
	}
	rf, err := r.loadSnapshot(dir)
	if err != nil {
		return nil, err
	}
	create := func(ctx context.Context, s runtime.Spec) (runtime.Handle, error) { return r.create(ctx, s, rf) }
	return vmm.ForkEach(ctx, specs, frozen, create, r.Delete)
}
