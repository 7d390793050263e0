package container

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// A sandbox's writable layer (the overlay's upper and work directories)
// has a quota in bytes and inodes, so that one sandbox cannot fill the
// node's disk or use up its inodes. Two mechanisms give it, behind
// layerQuota:
//
//   - project: an XFS (or ext4) project quota on the upper and work
//     directories, where the state directory's filesystem enforces project
//     quotas (mounted with prjquota). No extra mount; the limit is a
//     kernel accounting entry.
//   - image: a sparse ext4 image file per sandbox in its state directory,
//     loop-mounted as the filesystem that holds upper and work. Works on
//     any filesystem; the image's size is the byte limit and its inode
//     table the inode limit.
//
// Files and directories of the image mechanism under the state dir.
const (
	layerDir   = "layer"     // mount point of the image (in tmp); holds upper and work
	layerImage = "layer.img" // the sparse image file
)

// bytesPerInode is how many inodes a quota gives per byte: one per 16 KiB
// (ext4's default ratio), for both mechanisms.
const bytesPerInode = 16 << 10

// diskState is the writable layer's quota in the handle.
type diskState struct {
	// Kind is DiskQuotaProject or DiskQuotaImage.
	Kind   string `json:"kind"`
	Bytes  int64  `json:"bytes"`
	Inodes int64  `json:"inodes"`
	// ProjectID is the project of a project quota.
	ProjectID uint32 `json:"project_id,omitempty"`
}

// layerMount is where the layer image of the sandbox in bundle is
// mounted: layer in the bundle's tmpfs (tmp/layer: no mount point to make
// on disk), or layer in the state dir itself in sandboxes made before.
func layerMount(bundle string) string {
	if _, err := os.Lstat(filepath.Join(bundle, layerDir)); err == nil {
		return filepath.Join(bundle, layerDir)
	}
	return filepath.Join(bundle, tmpDir, layerDir)
}

// upper is the overlay's upper directory of the sandbox in bundle.
func (st *handleState) upper() string {
	if st.Disk != nil && st.Disk.Kind == DiskQuotaImage {
		return filepath.Join(layerMount(st.Bundle), upperDir)
	}
	return filepath.Join(st.Bundle, upperDir)
}

// work is the overlay's work directory (on the upper's filesystem).
func (st *handleState) work() string {
	if st.Disk != nil && st.Disk.Kind == DiskQuotaImage {
		return filepath.Join(layerMount(st.Bundle), workDir)
	}
	return filepath.Join(st.Bundle, workDir)
}

// layerQuota is one mechanism.
type layerQuota interface {
	// prepare makes the upper and work directories of the sandbox in
	// bundle with the limits in d (filling what it chose, e.g. the
	// project ID). On error nothing it made is left but directories.
	prepare(ctx context.Context, id, bundle string, d *diskState) error
	// usage returns the bytes and inodes the layer uses and its limits.
	usage(bundle string, d *diskState) (diskUse, error)
	// release undoes prepare once upper and work are removed (image:
	// unmounts the layer; project: drops the limit and the ID).
	release(ctx context.Context, id, bundle string, d *diskState) error
}

type diskUse struct {
	Bytes, BytesLimit, Inodes, InodesLimit int64
}

// diskLimits returns the quota of a layer of mb MiB.
func diskLimits(mb int64) (bytes, inodes int64) {
	bytes = mb << 20
	return bytes, max(bytes/bytesPerInode, 1024)
}

// quotaFor returns the mechanism for a state dir: the configured one;
// DiskQuotaAuto is the image (see below).
func (r *Runtime) quotaFor(stateDir string) (layerQuota, string, error) {
	switch r.cfg.DiskQuota {
	case DiskQuotaImage:
		return r.images, DiskQuotaImage, nil
	case DiskQuotaProject:
		if err := r.projects.supported(stateDir); err != nil {
			return nil, "", errdefs.New(errdefs.ErrFailedPrecondition,
				"container.disk_quota is project but %s does not enforce project quotas (%v): mount it with prjquota (XFS) or set disk_quota to image or auto", stateDir, err)
		}
		return r.projects, DiskQuotaProject, nil
	}
	// auto is the image: root in a sandbox (CAP_FOWNER, no user namespace)
	// could move files out of a project with FS_IOC_FSSETXATTR through the
	// overlay until seccomp refuses that ioctl; the image cannot be escaped
	// from inside. Project quotas are opt-in until then.
	return r.images, DiskQuotaImage, nil
}

func (r *Runtime) quotaOf(d *diskState) layerQuota {
	if d.Kind == DiskQuotaProject {
		return r.projects
	}
	return r.images
}

// prepareLayer makes the sandbox's upper and work directories, with a quota
// of mb MiB unless mb is 0. It returns the quota for the handle (nil: none).
func (r *Runtime) prepareLayer(ctx context.Context, id, bundle string, mb int64, seed *layerSeed) (*diskState, error) {
	if seed != nil {
		return r.prepareLayerFrom(ctx, id, bundle, seed)
	}
	if mb == 0 {
		return nil, makeLayerDirs(bundle)
	}
	q, kind, err := r.quotaFor(filepath.Dir(bundle))
	if err != nil {
		return nil, err
	}
	d := &diskState{Kind: kind}
	d.Bytes, d.Inodes = diskLimits(mb)
	if err := q.prepare(ctx, id, bundle, d); err != nil {
		return d, fmt.Errorf("writable layer quota (%s): %w", kind, err)
	}
	return d, nil
}

// plannedDisk is the quota prepareLayer will give a new, empty layer when
// it is fully known beforehand (an image of mb MiB); nil otherwise.
func (r *Runtime) plannedDisk(bundle string, mb int64, seed *layerSeed) *diskState {
	if seed != nil || mb == 0 {
		return nil
	}
	if _, kind, err := r.quotaFor(filepath.Dir(bundle)); err != nil || kind != DiskQuotaImage {
		return nil
	}
	d := &diskState{Kind: DiskQuotaImage}
	d.Bytes, d.Inodes = diskLimits(mb)
	return d
}

// makeLayerDirs makes upper (0755: overlayfs takes the root directory's
// mode from it, and users other than root in the sandbox need it) and work.
func makeLayerDirs(dir string) error {
	if err := os.Mkdir(filepath.Join(dir, upperDir), 0o755); err != nil {
		return fmt.Errorf("create upper dir: %w", err)
	}
	if err := os.Mkdir(filepath.Join(dir, workDir), 0o700); err != nil {
		return fmt.Errorf("create work dir: %w", err)
	}
	return nil
}

// releaseLayer undoes the quota of a sandbox whose upper and work are
// removed. Without a record (a create interrupted by a crash) it unmounts
// an image left mounted and frees a project ID claimed for id.
func (r *Runtime) releaseLayer(ctx context.Context, id, bundle string, d *diskState) error {
	if d != nil {
		return r.quotaOf(d).release(ctx, id, bundle, d)
	}
	return errors.Join(r.images.release(ctx, id, bundle, nil), r.projects.release(ctx, id, bundle, nil))
}

// unmountLayer unmounts the image layer (if any) of bundle; its upper and
// work are gone with it. Cleanup calls it before removing files.
func unmountLayer(ctx context.Context, bundle string) error {
	return unmount(ctx, layerMount(bundle))
}

// ---- image: a sparse ext4 file, loop-mounted ----

type imageQuota struct {
	mkfs string // mkfs.ext4
	// dir holds one formatted template image per size: a create copies
	// its few hundred KiB of metadata instead of running mkfs (~35 ms).
	dir string
	// directIO sets the loop devices to direct I/O (no second copy of
	// the layer's pages in the host's page cache).
	directIO bool

	mu        sync.Mutex
	templates map[int64]string // quota bytes -> template file; guarded by mu
}

// maxTemplates bounds the template cache (sizes differ per disk_mb).
const maxTemplates = 16

// template returns a formatted image of d's size, making it once.
func (q *imageQuota) template(ctx context.Context, d *diskState) (string, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if p, ok := q.templates[d.Bytes]; ok {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	if q.templates == nil {
		q.templates = map[int64]string{}
	}
	if len(q.templates) >= maxTemplates {
		for k, p := range q.templates {
			os.Remove(p)
			delete(q.templates, k)
			break
		}
	}
	if err := os.MkdirAll(q.dir, 0o700); err != nil {
		return "", fmt.Errorf("create layer template dir: %w", err)
	}
	p := filepath.Join(q.dir, strconv.FormatInt(d.Bytes>>20, 10)+"m.img")
	tmp := p + ".tmp"
	os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return "", fmt.Errorf("create layer template: %w", err)
	}
	err = f.Truncate(d.Bytes)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("size layer template: %w", err)
	}
	// The overlay's upper and work directories are in the template (mkfs
	// -d copies them in): a create makes no directory in the layer.
	root, err := os.MkdirTemp(q.dir, "root.")
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("create layer template root: %w", err)
	}
	defer os.RemoveAll(root)
	if err := os.Chmod(root, 0o755); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("chmod layer template root: %w", err)
	}
	if err := makeLayerDirs(root); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("layer template: %w", err)
	}
	// No journal (the layer never outlives the host's uptime), no reserved
	// blocks, lazy inode tables: mkfs writes a few hundred KiB. No backup
	// superblocks (sparse_super2, num_backup_sb=0: nothing ever repairs a
	// layer) and every group's bitmaps and inode table in one flex group
	// (flexBGSize): the template's blocks are 4 extents instead of one or
	// two per backup and per 16 groups (13 for 5 GiB), and each extent of
	// a sandbox's copy costs the host's file system a block allocation
	// when the loop device flushes the copy before its direct I/O starts.
	cmd := exec.CommandContext(ctx, q.mkfs, "-q", "-F", "-m", "0", "-O", "^has_journal,^resize_inode,sparse_super2",
		"-G", strconv.Itoa(flexBGSize(d.Bytes)), "-E", "lazy_itable_init=1,nodiscard,num_backup_sb=0",
		"-b", "4096", "-N", strconv.FormatInt(d.Inodes, 10), "-d", root, tmp)
	if out, err := cmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("mkfs.ext4 layer template: %w: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("publish layer template: %w", err)
	}
	q.templates[d.Bytes] = p
	return p, nil
}

// flexBGSize is the flex_bg size of a layer of the given bytes: the
// power of two (16, mkfs's default, to 1024) that covers all of its
// 128 MiB block groups, so their metadata lies together.
func flexBGSize(bytes int64) int {
	groups := (bytes + 128<<20 - 1) / (128 << 20)
	g := 16
	for int64(g) < groups && g < 1024 {
		g *= 2
	}
	return g
}

// copySparse makes dst a copy of the file src: a clone where the file
// system shares extents (XFS, btrfs), else its data extents (not its
// holes) copied in the kernel (copy_linux.go). dst ends up src's size.
func copySparse(dst *os.File, src string) error {
	sf, err := os.Open(src)
	if err != nil {
		return err
	}
	defer sf.Close()
	_, err = copyFileData(dst, sf)
	return err
}

func (q *imageQuota) prepare(ctx context.Context, _, bundle string, d *diskState) error {
	if q.mkfs == "" {
		return errdefs.New(errdefs.ErrFailedPrecondition, "mkfs.ext4 not found: install e2fsprogs (apt-get install e2fsprogs) for the disk quota of sandboxes")
	}
	img := filepath.Join(bundle, layerImage)
	mnt := layerMount(bundle)
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("create layer image: %w", err)
	}
	defer f.Close()
	tmpl, err := q.template(ctx, d)
	if err != nil {
		return err
	}
	if err := copySparse(f, tmpl); err != nil {
		return fmt.Errorf("copy layer template: %w", err)
	}
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return fmt.Errorf("create layer dir: %w", err)
	}
	if err := q.mountLayer(f, mnt); err != nil {
		return err
	}
	// upper and work are the template's (every template this process
	// makes has them).
	return nil
}

func (q *imageQuota) usage(bundle string, d *diskState) (diskUse, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(layerMount(bundle), &fs); err != nil {
		return diskUse{}, fmt.Errorf("statfs layer: %w", err)
	}
	if fs.Type != unix.EXT4_SUPER_MAGIC {
		return diskUse{}, errdefs.New(errdefs.ErrFailedPrecondition, "layer image of %s is not mounted", bundle)
	}
	return diskUse{
		Bytes:      int64(fs.Blocks-fs.Bfree) * fs.Bsize,
		BytesLimit: int64(fs.Blocks) * fs.Bsize,
		// The root, lost+found and the reserved inodes count as used.
		Inodes:      int64(fs.Files - fs.Ffree),
		InodesLimit: int64(fs.Files),
	}, nil
}

// mountLayer mounts the layer image f at mnt on a loop device, with
// noinit_itable (the kernel would zero the inode tables in the
// background, megabytes per GiB of quota of real disk use; the image's
// holes already read as zeros) and discard (a file removed in the layer
// punches its blocks out of the image, the loop device passing discards
// on as holes, so the host's space follows what the layer holds, not the
// most it ever held). The block allocator of the
// layer's ext4 then prefetches no block bitmaps (mb_prefetch_limit 0): its
// first allocation, the overlay's work dir at the mount of the sandbox's
// root, read and set up every block group's bitmap and buddy pages (40
// groups for 5 GiB: ~0.2 ms of CPU and ~0.5 MiB of page cache per
// sandbox); without it a group is set up when an allocation looks at it,
// and one whose blocks were never used (BLOCK_UNINIT) is skipped. And
// no_prefetch_block_bitmaps: else every mount hands the kernel's
// ext4lazyinit thread a request to read all the groups' bitmaps in the
// background (with noinit_itable that is all it has to do), I/O through
// the loop device for groups the layer may never use; that thread is
// started again whenever its list has run empty.
func (q *imageQuota) mountLayer(f *os.File, mnt string) error {
	const flags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOATIME
	opts := "noinit_itable,discard"
	if !noPrefetchRefused.Load() {
		opts += ",no_prefetch_block_bitmaps"
	}
	dev, err := loopMount(f, mnt, "ext4", flags, opts, q.directIO)
	if errors.Is(err, unix.EINVAL) && strings.HasSuffix(opts, ",no_prefetch_block_bitmaps") {
		// A kernel before 5.9 does not know the option: mount as before.
		noPrefetchRefused.Store(true)
		dev, err = loopMount(f, mnt, "ext4", flags, "noinit_itable,discard", q.directIO)
	}
	if err != nil {
		return err
	}
	// Best effort: a kernel without the knob prefetches as before.
	if f, err := os.OpenFile("/sys/fs/ext4/"+dev+"/mb_prefetch_limit", os.O_WRONLY, 0); err == nil {
		_, _ = f.WriteString("0")
		f.Close()
	}
	return nil
}

// noPrefetchRefused records that the kernel refused ext4's
// no_prefetch_block_bitmaps (before 5.9): later mounts go without it.
var noPrefetchRefused atomic.Bool

// release unmounts the layer (its loop device goes with the last
// reference: LO_FLAGS_AUTOCLEAR); cleanup removes the image file.
func (q *imageQuota) release(ctx context.Context, _, bundle string, _ *diskState) error {
	return unmountLayer(ctx, bundle)
}

// loopMount attaches f to a free loop device and mounts it at target. The
// device is set to clear itself when its last user goes, so unmounting the
// filesystem (or a failed mount) frees it: nothing to leak.
// It returns the device's name (loopN).
func loopMount(f *os.File, target, fstype string, flags uintptr, data string, directIO bool) (string, error) {
	cfg := unix.LoopConfig{Fd: uint32(f.Fd())}
	cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
	if directIO {
		// The kernel falls back to buffered I/O where the backing
		// file cannot do direct I/O.
		cfg.Info.Flags |= unix.LO_FLAGS_DIRECT_IO
		cfg.Size = 4096
	}
	copy(cfg.Info.File_name[:], filepath.Base(f.Name()))
	lfd, n, err := attachLoop(&cfg)
	if err != nil {
		return "", err
	}
	dev := "loop" + strconv.Itoa(n)
	err = unix.Mount("/dev/"+dev, target, fstype, flags, data)
	unix.Close(lfd) // the mount holds the device now (or, failed, frees it)
	if err != nil {
		return "", fmt.Errorf("mount layer image: %w", err)
	}
	return dev, nil
}

// loopNext is the loop device attachLoop tries first: the one after the
// last it attached. LOOP_CTL_GET_FREE walks the kernel's loop devices
// from 0 to the first unbound one, under the lock every loop device's
// add and remove take too, so with a thousand layers attached each
// create walked a thousand; a batch's creates mostly find the device
// after the last one free.
var loopNext atomic.Int64

// attachLoop attaches cfg to a free loop device and returns an open fd of
// it and its number.
func attachLoop(cfg *unix.LoopConfig) (fd, n int, err error) {
	try := func(n int) (int, error) {
		lfd, err := unix.Open("/dev/loop"+strconv.Itoa(n), unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, err
		}
		if err := unix.IoctlLoopConfigure(lfd, cfg); err != nil {
			unix.Close(lfd)
			return -1, err
		}
		loopNext.Store(int64(n) + 1)
		return lfd, nil
	}
	// A guess only: bound (EBUSY), or missing (ENOENT), the kernel's
	// choice below.
	if guess := loopNext.Add(1) - 1; guess > 0 {
		if lfd, err := try(int(guess)); err == nil {
			return lfd, int(guess), nil
		}
	}
	ctl, err := unix.Open("/dev/loop-control", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, 0, fmt.Errorf("open /dev/loop-control: %w", err)
	}
	defer unix.Close(ctl)
	for range 64 {
		n, err := unix.IoctlRetInt(ctl, unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return -1, 0, fmt.Errorf("find a free loop device: %w", err)
		}
		lfd, err := try(n)
		if errors.Is(err, unix.EBUSY) {
			continue // another create took it between the two calls
		}
		if err != nil {
			return -1, 0, fmt.Errorf("attach layer image to /dev/loop%d: %w", n, err)
		}
		return lfd, n, nil
	}
	return -1, 0, errdefs.New(errdefs.ErrUnavailable, "no free loop device after 64 tries")
}

// ---- project: XFS/ext4 project quota on upper and work ----

type projectQuota struct {
	// claims is the directory of claimed project IDs: a file per ID,
	// holding the sandbox's ID.
	claims string
	// enforced caches, per filesystem (st_dev), whether it enforces
	// project quotas.
	enforced sync.Map // uint64 -> error
}

// The kernel's interfaces (linux/fs.h, linux/quota.h, linux/dqblk_xfs.h).
const (
	fsIocFsgetxattr    = 0x801c581f // _IOR('X', 31, struct fsxattr)
	fsIocFssetxattr    = 0x401c5820 // _IOW('X', 32, struct fsxattr)
	fsXflagProjinherit = 0x200
	prjQuota           = 2
	qGetQuota          = 0x800007
	qSetQuota          = 0x800008
	qXGetQStatV        = 'X'<<8 + 8
	fsQuotaPdqEnfd     = 1 << 5
	qifBLimits         = 1
	qifILimits         = 4
	qifLimits          = qifBLimits | qifILimits
	// projectIDBase keeps our IDs away from small ones an administrator
	// may have given (/etc/projid).
	projectIDBase  = 1 << 20
	projectIDRange = 1<<31 - projectIDBase
)

type fsxattr struct {
	Xflags, Extsize, Nextents, Projid, Cowextsize uint32
	_                                             [8]byte
}

type ifDqblk struct {
	Bhardlimit, Bsoftlimit, Curspace, Ihardlimit, Isoftlimit, Curinodes, Btime, Itime uint64
	Valid                                                                             uint32
	_                                                                                 uint32
}

func qcmd(cmd, typ uint32) uint32 { return cmd<<8 | typ&0xff }

func quotactlFd(fd int, cmd, id uint32, addr unsafe.Pointer) error {
	_, _, e := unix.Syscall6(unix.SYS_QUOTACTL_FD, uintptr(fd), uintptr(cmd), uintptr(id), uintptr(addr), 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// onFS runs fn with an fd of dir.
func onFS(dir string, fn func(fd int) error) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return fn(fd)
}

// supported reports (nil) whether dir's filesystem enforces project quotas.
func (q *projectQuota) supported(dir string) error {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return err
	}
	if v, ok := q.enforced.Load(st.Dev); ok {
		if v == nil {
			return nil
		}
		return v.(error)
	}
	err := onFS(dir, func(fd int) error {
		var stat [256]byte
		stat[0] = 1 // FS_QSTATV_VERSION1
		if err := quotactlFd(fd, qcmd(qXGetQStatV, prjQuota), 0, unsafe.Pointer(&stat[0])); err != nil {
			return fmt.Errorf("project quota state: %w", err)
		}
		if flags := uint16(stat[2]) | uint16(stat[3])<<8; flags&fsQuotaPdqEnfd == 0 {
			return errors.New("project quotas are not enforced")
		}
		return nil
	})
	q.enforced.Store(st.Dev, err)
	return err
}

func (q *projectQuota) prepare(ctx context.Context, id, bundle string, d *diskState) error {
	if err := makeLayerDirs(bundle); err != nil {
		return err
	}
	upper := filepath.Join(bundle, upperDir)
	pid, err := q.claim(id, upper)
	if err != nil {
		return err
	}
	d.ProjectID = pid
	lim := ifDqblk{Bhardlimit: uint64(d.Bytes) >> 10, Bsoftlimit: uint64(d.Bytes) >> 10,
		Ihardlimit: uint64(d.Inodes), Isoftlimit: uint64(d.Inodes), Valid: qifLimits}
	if err := onFS(upper, func(fd int) error {
		return quotactlFd(fd, qcmd(qSetQuota, prjQuota), pid, unsafe.Pointer(&lim))
	}); err != nil {
		return fmt.Errorf("set project quota %d: %w", pid, err)
	}
	// work too: overlayfs makes files there and renames them into upper,
	// which a filesystem refuses across projects.
	for _, dir := range []string{upper, filepath.Join(bundle, workDir)} {
		if err := setProject(dir, pid); err != nil {
			return err
		}
	}
	log.G(ctx).Debug("writable layer project quota", "sandbox.id", id, "project", pid, "bytes", d.Bytes, "inodes", d.Inodes)
	return nil
}

// setProject puts dir (empty) in project pid; what is made in it inherits it.
func setProject(dir string, pid uint32) error {
	return onFS(dir, func(fd int) error {
		var x fsxattr
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fsIocFsgetxattr, uintptr(unsafe.Pointer(&x))); e != 0 {
			return fmt.Errorf("get project of %s: %w", dir, e)
		}
		x.Projid = pid
		x.Xflags |= fsXflagProjinherit
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fsIocFssetxattr, uintptr(unsafe.Pointer(&x))); e != 0 {
			return fmt.Errorf("set project of %s: %w", dir, e)
		}
		return nil
	})
}

// claim picks a project ID for sandbox id: one no other sandbox claimed and
// nothing on the filesystem of dir is charged to.
func (q *projectQuota) claim(id, dir string) (uint32, error) {
	if err := os.MkdirAll(q.claims, 0o700); err != nil {
		return 0, fmt.Errorf("create project claims dir: %w", err)
	}
	h := fnv.New32a()
	h.Write([]byte(id))
	start := h.Sum32() % projectIDRange
	for i := range uint32(4096) {
		pid := projectIDBase + (start+i)%projectIDRange
		p := filepath.Join(q.claims, strconv.FormatUint(uint64(pid), 10))
		f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("claim project ID: %w", err)
		}
		_, werr := f.WriteString(id)
		if err := errors.Join(werr, f.Close()); err != nil {
			os.Remove(p)
			return 0, fmt.Errorf("claim project ID: %w", err)
		}
		var cur ifDqblk
		err = onFS(dir, func(fd int) error { return quotactlFd(fd, qcmd(qGetQuota, prjQuota), pid, unsafe.Pointer(&cur)) })
		if err == nil && cur.Curspace == 0 && cur.Curinodes == 0 || errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESRCH) {
			return pid, nil
		}
		os.Remove(p) // in use by files we do not know: not ours
	}
	return 0, errdefs.New(errdefs.ErrResourceExhausted, "no free project ID for the disk quota after 4096 tries")
}

func (q *projectQuota) usage(bundle string, d *diskState) (diskUse, error) {
	var cur ifDqblk
	if err := onFS(bundle, func(fd int) error {
		return quotactlFd(fd, qcmd(qGetQuota, prjQuota), d.ProjectID, unsafe.Pointer(&cur))
	}); err != nil {
		return diskUse{}, fmt.Errorf("read project quota %d: %w", d.ProjectID, err)
	}
	return diskUse{Bytes: int64(cur.Curspace), BytesLimit: int64(cur.Bhardlimit) << 10,
		Inodes: int64(cur.Curinodes), InodesLimit: int64(cur.Ihardlimit)}, nil
}

// release drops the limit and the claim once upper and work are removed.
// Without d it looks for a claim of sandbox id.
func (q *projectQuota) release(_ context.Context, id, bundle string, d *diskState) error {
	var pids []uint32
	if d != nil {
		pids = []uint32{d.ProjectID}
	} else {
		ents, err := os.ReadDir(q.claims)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("list project claims: %w", err)
		}
		for _, e := range ents {
			if b, err := os.ReadFile(filepath.Join(q.claims, e.Name())); err == nil && string(b) == id {
				if n, err := strconv.ParseUint(e.Name(), 10, 32); err == nil {
					pids = append(pids, uint32(n))
				}
			}
		}
	}
	for _, pid := range pids {
		zero := ifDqblk{Valid: qifLimits}
		dir := filepath.Dir(bundle)
		if err := onFS(dir, func(fd int) error {
			return quotactlFd(fd, qcmd(qSetQuota, prjQuota), pid, unsafe.Pointer(&zero))
		}); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("clear project quota %d: %w", pid, err)
		}
		if err := os.Remove(filepath.Join(q.claims, strconv.FormatUint(uint64(pid), 10))); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("release project ID %d: %w", pid, err)
		}
	}
	return nil
}
