package container

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.Forker = (*Runtime)(nil)

// Fork copies a sandbox's files, not its memory: a container's processes
// cannot be copied, so every fork starts its init again on the source's
// root filesystem as it was at the fork (MemoryPreserved false).
//
// The source is frozen (cgroup freezer) only while its writable layer is
// copied once, into a seed next to it in its bundle (forkSeedPrefix*):
//
//   - a layer image (disk quota "image"): syncfs on the loop-mounted ext4
//     (every writer is frozen, so the image is then a clean file system),
//     then the image file is cloned (FICLONE: XFS with reflink, btrfs) or,
//     where the file system cannot share extents, copied extent by extent
//     with its holes;
//   - an upper directory (no quota, or a project quota): the tree is
//     copied with owners, modes, times, xattrs (overlay whiteouts and
//     trusted.overlay.* attributes), hard links and holes, each file
//     cloned where it can be, by a few workers.
//
// After the thaw each fork's layer is made from the seed (all but one copy
// it, in parallel; the last takes it by rename), so the source's frozen
// time is one copy of its layer however many forks are made (with reflink,
// a few milliseconds per GiB of extents). forkCopiesFrozen makes all the
// copies while frozen instead (the benchmark compares the two).
var forkCopiesFrozen = false

// forkSeedPrefix names the seeds in the source's bundle; cleanup and
// Recover remove any a failed fork or a crash left.
const forkSeedPrefix = "fork-seed-"

// forkParallel bounds the forks made at once after the thaw.
const forkParallel = 4

// layerSeed is a copy of a sandbox's writable layer to make another from.
type layerSeed struct {
	// path is the layer image file (disk.Kind image) or the upper
	// directory (no quota, or a project quota).
	path string
	// disk is the quota of the layer copied (nil: none); the new layer
	// has the same.
	disk *diskState
	// move: the new layer takes path itself (a rename) rather than a copy.
	move bool
}

// isImage reports whether the seed is a layer image file.
func (s *layerSeed) isImage() bool { return s.disk != nil && s.disk.Kind == DiskQuotaImage }

// Fork makes one prepared (not started) sandbox per spec whose writable
// layer is a copy of sandbox id's at this instant; see forkCopiesFrozen
// for how. Each spec is a Create's: its own ID, StateDir, hostname and
// network; resources.disk_mb must be the source's (the layer is a copy of
// its file system). A paused source stays paused; a running one is thawed
// after the copy, also when the fork fails. Either every fork is made or
// none (everything made is deleted again).
func (r *Runtime) Fork(ctx context.Context, id string, specs []runtime.Spec) (_ []runtime.ForkResult, retErr error) {
	if len(specs) == 0 {
		return nil, errdefs.Invalid("specs", "must hold at least one sandbox to make")
	}
	seen := map[string]bool{}
	for i, s := range specs {
		if err := validateSpec(s, r.cfg.MaxPidsLimit); err != nil {
			return nil, fmt.Errorf("fork %d of %d: %w", i+1, len(specs), err)
		}
		if s.ID == id {
			return nil, errdefs.Invalid("id", "fork %d has the source's ID %q; give each fork a new one", i+1, id)
		}
		if seen[s.ID] {
			return nil, errdefs.Invalid("id", "%q is given to two forks; give each fork its own", s.ID)
		}
		seen[s.ID] = true
	}
	seed, frozen, err := r.takeSeed(ctx, id, specs)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := errors.Join(os.RemoveAll(seed.path), removeExtraSeeds(seed.path)); err != nil {
			log.G(ctx).Warn("remove fork seed", "sandbox.id", id, "error", err)
		}
	}()

	res := make([]runtime.ForkResult, len(specs))
	made := make([]bool, len(specs))
	defer func() {
		if retErr == nil {
			return
		}
		for i, s := range specs {
			if !made[i] {
				continue
			}
			if err := r.Delete(context.WithoutCancel(ctx), s.ID); err != nil {
				log.G(ctx).Error("undo fork", "sandbox.id", s.ID, "source", id, "error", err)
			}
		}
	}()
	one := func(i int, move bool) error {
		s := *seed
		s.move = move
		h, err := r.create(ctx, specs[i], &s)
		if err != nil {
			return fmt.Errorf("fork %d of %d (%s): %w", i+1, len(specs), specs[i].ID, err)
		}
		made[i] = true
		res[i] = runtime.ForkResult{Handle: h, SourceFrozen: frozen}
		return nil
	}
	// All but the last copy the seed, a few at a time; the last takes it.
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
		sem  = make(chan struct{}, forkParallel)
	)
	last := len(specs) - 1
	for i := range last {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			mu.Lock()
			failed := len(errs) > 0
			mu.Unlock()
			if failed || ctx.Err() != nil {
				return
			}
			if err := one(i, false); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("fork: %w", err)
	}
	if err := one(last, true); err != nil {
		return nil, err
	}
	log.G(ctx).Debug("sandbox forked", "sandbox.id", id, "forks", len(specs), "source_frozen", frozen)
	return res, nil
}

// takeSeed copies sandbox id's writable layer into a seed in its bundle,
// frozen while it copies (unless it is paused or was never started), and
// returns the seed and how long the fork kept it frozen. specs are the
// forks to make (their disk_mb must match the source's).
func (r *Runtime) takeSeed(ctx context.Context, id string, specs []runtime.Spec) (*layerSeed, time.Duration, error) {
	sb, err := r.lock(id)
	if err != nil {
		return nil, 0, err
	}
	defer sb.op.Unlock()
	if sb.st.Bundle == "" {
		return nil, 0, errdefs.New(errdefs.ErrNotFound, "sandbox %q has no root filesystem on this node", id)
	}
	srcMB := int64(0)
	if sb.st.Disk != nil {
		srcMB = sb.st.Disk.Bytes >> 20
	}
	for i, s := range specs {
		if s.Resources.DiskMB != srcMB {
			return nil, 0, errdefs.Invalid("resources.disk_mb", "fork %d asks for %d MiB but the source's writable layer has %d MiB (a fork's layer is a copy of it); give %d", i+1, s.Resources.DiskMB, srcMB, srcMB)
		}
	}
	freeze := false
	switch sb.phase.Load() {
	case phasePrepared, phaseFSPaused:
		// Never started, or paused keeping only its files: nothing
		// writes to the layer.
	case phaseLaunched:
		if err := r.running(sb); err != nil {
			return nil, 0, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is stopped: only a running, paused or created sandbox can be forked", id)
		}
		paused, err := r.cg.frozen(sb.st.CgroupPath)
		if err != nil {
			return nil, 0, fmt.Errorf("sandbox %s freezer state: %w", id, err)
		}
		freeze = !paused
	default:
		return nil, 0, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is stopped: only a running, paused or created sandbox can be forked", id)
	}
	seed := &layerSeed{disk: sb.st.Disk}
	seed.path = filepath.Join(sb.st.Bundle, forkSeedPrefix+randHex())
	var frozen time.Duration
	copyLayer := func() error {
		return copyLayerTo(ctx, sb, seed)
	}
	if !freeze {
		if err := copyLayer(); err != nil {
			return nil, 0, errors.Join(fmt.Errorf("copy writable layer of sandbox %s: %w", id, err), os.RemoveAll(seed.path))
		}
		return seed, 0, nil
	}
	marker := filepath.Join(sb.st.Bundle, diffFrozenFile)
	if err := os.WriteFile(marker, nil, 0o600); err != nil {
		return nil, 0, fmt.Errorf("mark sandbox %s frozen for fork: %w", id, err)
	}
	start := time.Now()
	if err := r.cg.setFrozen(ctx, sb.st.CgroupPath, true); err != nil {
		return nil, 0, errors.Join(fmt.Errorf("freeze sandbox %s for fork: %w", id, err), r.unmarkDiffFrozen(sb))
	}
	cerr := copyLayer()
	if cerr == nil && forkCopiesFrozen {
		cerr = r.extraFrozenCopies(ctx, seed, specs)
	}
	terr := r.cg.setFrozen(context.WithoutCancel(ctx), sb.st.CgroupPath, false)
	frozen = time.Since(start)
	if terr != nil {
		// The marker stays: the next Recover thaws it.
		terr = fmt.Errorf("thaw sandbox %s after fork: %w", id, terr)
	} else {
		terr = r.unmarkDiffFrozen(sb)
	}
	if cerr != nil || terr != nil {
		return nil, 0, errors.Join(cerr, terr, os.RemoveAll(seed.path), removeExtraSeeds(seed.path))
	}
	return seed, frozen, nil
}

// extraFrozenCopies (forkCopiesFrozen) copies the seed once more per fork
// but one while the source is still frozen, as seed.path.N; the forks take
// them by rename (see layerFrom).
func (r *Runtime) extraFrozenCopies(ctx context.Context, seed *layerSeed, specs []runtime.Spec) error {
	for i := range len(specs) - 1 {
		s := *seed
		s.path = fmt.Sprintf("%s.%d", seed.path, i)
		if err := copyLayerFrom(ctx, seed, s.path); err != nil {
			return err
		}
	}
	return nil
}

func removeExtraSeeds(path string) error {
	m, _ := filepath.Glob(path + ".*")
	var errs []error
	for _, p := range m {
		errs = append(errs, os.RemoveAll(p))
	}
	return errors.Join(errs...)
}

// copyLayerTo copies sb's writable layer into seed.path. The caller
// holds sb.op and has frozen sb (or nothing runs in it).
func copyLayerTo(ctx context.Context, sb *sandbox, seed *layerSeed) error {
	if seed.isImage() {
		mnt := layerMount(sb.st.Bundle)
		// Every writer is frozen: once the file system's dirty pages and
		// inodes are on the loop device, the image file is a consistent
		// ext4 that mounts as it is.
		if forkFIFreeze {
			thaw, err := fiFreeze(mnt)
			if err != nil {
				return err
			}
			defer thaw()
		} else if err := syncFS(mnt); err != nil {
			return err
		}
		m, err := cloneOrCopy(seed.path, filepath.Join(sb.st.Bundle, layerImage))
		if err != nil {
			return fmt.Errorf("copy layer image: %w", err)
		}
		log.G(ctx).Debug("fork copied the layer image", "sandbox.id", sb.id, "method", m)
		return nil
	}
	st, err := copyTree(ctx, sb.st.upper(), seed.path)
	if err != nil {
		return fmt.Errorf("copy upper layer: %w", err)
	}
	log.G(ctx).Debug("fork copied the upper layer", "sandbox.id", sb.id, "files", st.Files, "reflinked", st.Reflinked, "bytes", st.Bytes)
	return nil
}

// copyLayerFrom copies the seed into dst (a file or directory that must
// not exist).
func copyLayerFrom(ctx context.Context, seed *layerSeed, dst string) error {
	if seed.isImage() {
		if _, err := cloneOrCopy(dst, seed.path); err != nil {
			return fmt.Errorf("copy layer image: %w", err)
		}
		return nil
	}
	if _, err := copyTree(ctx, seed.path, dst); err != nil {
		return fmt.Errorf("copy upper layer: %w", errors.Join(err, os.RemoveAll(dst)))
	}
	return nil
}

// layerFrom puts the seed's layer at dst: by rename when the seed may be
// taken (or a copy made while frozen for this fork waits), else by copy.
func layerFrom(ctx context.Context, seed *layerSeed, dst string) error {
	if !seed.move {
		// A copy made while the source was frozen (forkCopiesFrozen).
		if m, _ := filepath.Glob(seed.path + ".*"); len(m) > 0 {
			for _, p := range m {
				if err := os.Rename(p, dst); err == nil {
					return nil
				}
			}
		}
		return copyLayerFrom(ctx, seed, dst)
	}
	err := os.Rename(seed.path, dst)
	if errors.Is(err, unix.EXDEV) {
		return copyLayerFrom(ctx, seed, dst)
	}
	if err != nil {
		return fmt.Errorf("take layer copy: %w", err)
	}
	return nil
}

// prepareLayerFrom is prepareLayer for a layer copied from seed: the same
// kind and quota as the seed's source.
func (r *Runtime) prepareLayerFrom(ctx context.Context, id, bundle string, seed *layerSeed) (*diskState, error) {
	d, err := r.layerFromSeed(ctx, id, bundle, seed)
	if err != nil {
		return d, err
	}
	// The copy carries the source overlay's persistent UUID (overlayfs
	// uuid=on): without it the fork's overlay makes its own.
	st := handleState{Bundle: bundle, Disk: d}
	if err := unix.Removexattr(st.upper(), overlayUUIDXattr); err != nil && !errors.Is(err, unix.ENODATA) && !errors.Is(err, unix.ENOTSUP) {
		return d, fmt.Errorf("drop the source overlay's uuid: %w", err)
	}
	return d, nil
}

// overlayUUIDXattr is where overlayfs keeps an overlay's UUID, on the
// upper's root.
const overlayUUIDXattr = "trusted.overlay.uuid"

func (r *Runtime) layerFromSeed(ctx context.Context, id, bundle string, seed *layerSeed) (*diskState, error) {
	if seed.disk == nil {
		if err := layerFrom(ctx, seed, filepath.Join(bundle, upperDir)); err != nil {
			return nil, err
		}
		if err := os.Mkdir(filepath.Join(bundle, workDir), 0o700); err != nil {
			return nil, fmt.Errorf("create work dir: %w", err)
		}
		return nil, nil
	}
	d := *seed.disk
	d.ProjectID = 0
	switch d.Kind {
	case DiskQuotaImage:
		if err := r.images.prepareFrom(ctx, bundle, seed); err != nil {
			return &d, fmt.Errorf("writable layer quota (%s): %w", d.Kind, err)
		}
		return &d, nil
	case DiskQuotaProject:
		if err := r.projects.supported(filepath.Dir(bundle)); err != nil {
			return nil, errdefs.New(errdefs.ErrFailedPrecondition, "the source's writable layer has a project quota but %s does not enforce project quotas (%v)", filepath.Dir(bundle), err)
		}
		if err := r.projects.prepare(ctx, id, bundle, &d); err != nil {
			return &d, fmt.Errorf("writable layer quota (%s): %w", d.Kind, err)
		}
		// Files made in upper inherit its project: a copy, never a rename.
		if _, err := copyTree(ctx, seed.path, filepath.Join(bundle, upperDir)); err != nil {
			return &d, fmt.Errorf("copy upper layer: %w", err)
		}
		return &d, nil
	}
	return nil, errdefs.New(errdefs.ErrInternal, "writable layer of unknown kind %q", d.Kind)
}

// prepareFrom is prepare for a layer image copied from seed: the copy is
// put in place and loop-mounted; it already holds upper and work.
func (q *imageQuota) prepareFrom(ctx context.Context, bundle string, seed *layerSeed) error {
	img := filepath.Join(bundle, layerImage)
	mnt := layerMount(bundle)
	if err := layerFrom(ctx, seed, img); err != nil {
		return err
	}
	f, err := os.OpenFile(img, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open layer image: %w", err)
	}
	defer f.Close()
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return fmt.Errorf("create layer dir: %w", err)
	}
	if err := q.mountLayer(f, mnt); err != nil {
		return err
	}
	for _, d := range []string{upperDir, workDir} {
		if fi, err := os.Lstat(filepath.Join(mnt, d)); err != nil || !fi.IsDir() {
			return errors.Join(errdefs.New(errdefs.ErrFailedPrecondition, "copied layer image has no %s directory", d), unmount(ctx, mnt))
		}
	}
	return nil
}

// syncFS writes the file system holding dir to its device (syncfs(2)).
func syncFS(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open layer: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		return fmt.Errorf("sync layer: %w", err)
	}
	return nil
}

// forkFIFreeze makes a fork freeze the layer's file system (FIFREEZE)
// around the image copy instead of syncfs, for the benchmark: both leave a
// clean image when every writer is frozen; syncfs leaves nothing to undo
// if the node dies mid-copy (a file system left frozen would hang the
// sandbox's writers after its thaw).
var forkFIFreeze = false

// linux/fs.h: _IOWR('X', 119, int) and _IOWR('X', 120, int).
const (
	fiFreezeIoctl = 0xc0045877
	fiThawIoctl   = 0xc0045878
)

// fiFreeze freezes the file system holding dir (FIFREEZE: synced and
// consistent on its device) and returns the thaw.
func fiFreeze(dir string) (func(), error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open layer: %w", err)
	}
	if err := unix.IoctlSetInt(fd, fiFreezeIoctl, 0); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("freeze layer file system: %w", err)
	}
	return func() {
		_ = unix.IoctlSetInt(fd, fiThawIoctl, 0)
		unix.Close(fd)
	}, nil
}

// removeStaleSeeds removes seeds a fork interrupted by a node crash left
// in sb's bundle.
func removeStaleSeeds(ctx context.Context, sb *sandbox) {
	m, _ := filepath.Glob(filepath.Join(sb.st.Bundle, forkSeedPrefix+"*"))
	for _, p := range m {
		if err := os.RemoveAll(p); err != nil {
			log.G(ctx).Warn("remove fork seed left by an interrupted fork", "sandbox.id", sb.id, "path", p, "error", err)
		}
	}
}

func randHex() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}
