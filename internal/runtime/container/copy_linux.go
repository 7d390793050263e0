package container

import (
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/fsutil"
)

// Copying a writable layer (Fork, Snapshot, Restore). A file is cloned
// (FICLONE: the copy shares the source's extents until either is written)
// where the filesystem can (XFS with reflink=1, btrfs), else copied extent
// by extent, holes kept, with copy_file_range (no trip through user
// space).

// copyMethod says how copyFileData copied: by reflink or by a data copy.
type copyMethod int

const (
	copiedData copyMethod = iota
	copiedReflink
)

func (m copyMethod) String() string {
	if m == copiedReflink {
		return "reflink"
	}
	return "sparse copy"
}

// noReflink reports whether err from FICLONE means the files cannot share
// extents here (another filesystem, one without reflink), so a data copy
// is the way.
func noReflink(err error) bool {
	return errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EXDEV) ||
		errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EBADF)
}

// copyFileData makes dst (empty, opened for writing) a copy of src's
// contents: a clone where the filesystem shares extents, else a sparse
// copy of src's data extents. dst ends up src's size.
func copyFileData(dst, src *os.File) (copyMethod, error) {
	err := unix.IoctlFileClone(int(dst.Fd()), int(src.Fd()))
	if err == nil {
		return copiedReflink, nil
	}
	if !noReflink(err) {
		return copiedData, fmt.Errorf("clone %s: %w", src.Name(), err)
	}
	return copiedData, copySparseFile(dst, src)
}

// copySparseFile copies src's data extents (SEEK_DATA/SEEK_HOLE) into dst
// at the same offsets and truncates dst to src's size, so holes stay holes.
func copySparseFile(dst, src *os.File) error {
	fi, err := src.Stat()
	if err != nil {
		return err
	}
	size := fi.Size()
	sfd := int(src.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(sfd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		}
		if err != nil {
			return fmt.Errorf("find data in %s: %w", src.Name(), err)
		}
		hole, err := unix.Seek(sfd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("find hole in %s: %w", src.Name(), err)
		}
		if err := copyRange(dst, src, data, hole-data); err != nil {
			return fmt.Errorf("copy %s: %w", src.Name(), err)
		}
		off = hole
	}
	return dst.Truncate(size)
}

// copyRange copies n bytes at off from src to dst (same offset), in the
// kernel where it can.
func copyRange(dst, src *os.File, off, n int64) error {
	roff, woff := off, off
	for n > 0 {
		c, err := unix.CopyFileRange(int(src.Fd()), &roff, int(dst.Fd()), &woff, int(min(n, 1<<30)), 0)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) {
				_, err := io.Copy(io.NewOffsetWriter(dst, woff), io.NewSectionReader(src, roff, n))
				return err
			}
			return err
		}
		if c == 0 {
			return io.ErrUnexpectedEOF // src shrank under us
		}
		n -= int64(c)
	}
	return nil
}

// cloneOrCopy makes dst (which must not exist) a copy of the file src,
// mode 0600.
func cloneOrCopy(dst, src string) (copyMethod, error) {
	sf, err := os.Open(src)
	if err != nil {
		return copiedData, err
	}
	defer sf.Close()
	df, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return copiedData, err
	}
	m, err := copyFileData(df, sf)
	if cerr := df.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(dst)
	}
	return m, err
}

// copyTreeWorkers is how many files a tree copy copies at once.
const copyTreeWorkers = 4

// treeStats counts what a tree copy did.
type treeStats struct {
	Files, Reflinked, Dirs, Links, Other int64
	Bytes                                int64 // apparent size of the regular files
}

// copyTree copies the directory tree src into dst (made if missing; its
// own metadata set to src's) exactly: modes (setuid, sticky), owners,
// times, extended attributes (trusted.overlay.* of an overlay upper:
// opaque directories, redirects, origins), hard links, symlinks, device
// and fifo nodes (overlay whiteouts are 0/0 character devices) and holes.
// Regular files are cloned where the filesystem can, else copied sparse,
// by copyTreeWorkers workers. It never follows a symlink in src. src must
// not change during the copy (the sandbox is frozen or not running).
func copyTree(ctx context.Context, src, dst string) (treeStats, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var st treeStats
	type link struct{ dev, ino uint64 }
	links := map[link]string{}
	type dirTimes struct {
		path string
		t    [2]unix.Timespec
	}
	var dirs []dirTimes
	type job struct {
		src, dst *os.File
		fi       *syscall.Stat_t
		xattrs   []xattr
	}
	jobs := make(chan job, copyTreeWorkers)
	var wg sync.WaitGroup
	var reflinked atomic.Int64
	for range copyTreeWorkers {
		wg.Go(func() {
			for j := range jobs {
				err := ctx.Err()
				if err == nil {
					var m copyMethod
					m, err = copyFileData(j.dst, j.src)
					if m == copiedReflink {
						reflinked.Add(1)
					}
					if err == nil {
						err = setMetaFd(j.dst, j.fi, j.xattrs)
					}
				}
				j.src.Close()
				if cerr := j.dst.Close(); err == nil {
					err = cerr
				}
				if err != nil {
					cancel(fmt.Errorf("copy %s: %w", j.dst.Name(), err))
				}
			}
		})
	}
	walkErr := fsutil.WalkNoFollow(ctx, src, func(rel, p string, fi iofs.FileInfo) error {
		sys, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("stat %s: no stat_t", rel)
		}
		target := filepath.Join(dst, rel)
		xa, err := readXattrs(p)
		if err != nil {
			return fmt.Errorf("read xattrs of %s: %w", rel, err)
		}
		mode := sys.Mode & unix.S_IFMT
		if mode != unix.S_IFDIR && sys.Nlink > 1 {
			k := link{sys.Dev, sys.Ino}
			if first, ok := links[k]; ok {
				st.Links++
				if err := os.Link(first, target); err != nil {
					return fmt.Errorf("hard link %s: %w", rel, err)
				}
				return nil
			}
			links[k] = target
		}
		switch mode {
		case unix.S_IFDIR:
			st.Dirs++
			if err := unix.Mkdir(target, 0o700); err != nil && !(rel == "." && errors.Is(err, unix.EEXIST)) {
				return fmt.Errorf("make directory %s: %w", rel, err)
			}
			if err := setMetaPath(target, sys, xa, true); err != nil {
				return fmt.Errorf("directory %s: %w", rel, err)
			}
			dirs = append(dirs, dirTimes{target, [2]unix.Timespec{unix.Timespec(sys.Atim), unix.Timespec(sys.Mtim)}})
		case unix.S_IFREG:
			st.Files++
			st.Bytes += sys.Size
			sfd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NOATIME, 0)
			if errors.Is(err, unix.EPERM) {
				sfd, err = unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			}
			if err != nil {
				return fmt.Errorf("open %s: %w", rel, err)
			}
			sf := os.NewFile(uintptr(sfd), rel)
			df, err := os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o600)
			if err != nil {
				sf.Close()
				return fmt.Errorf("create %s: %w", rel, err)
			}
			select {
			case jobs <- job{sf, df, sys, xa}:
			case <-ctx.Done():
				sf.Close()
				df.Close()
				return context.Cause(ctx)
			}
		case unix.S_IFLNK:
			st.Other++
			to, err := os.Readlink(p)
			if err != nil {
				return fmt.Errorf("read symlink %s: %w", rel, err)
			}
			if err := os.Symlink(to, target); err != nil {
				return fmt.Errorf("make symlink %s: %w", rel, err)
			}
			if err := setMetaPath(target, sys, xa, false); err != nil {
				return fmt.Errorf("symlink %s: %w", rel, err)
			}
		case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
			st.Other++
			if err := unix.Mknod(target, mode|0o600, int(sys.Rdev)); err != nil {
				return fmt.Errorf("make node %s: %w", rel, err)
			}
			if err := setMetaPath(target, sys, xa, true); err != nil {
				return fmt.Errorf("node %s: %w", rel, err)
			}
		default:
			return fmt.Errorf("%s: unknown file type %#o", rel, mode)
		}
		return nil
	})
	close(jobs)
	wg.Wait()
	st.Reflinked = reflinked.Load()
	if walkErr != nil {
		return st, walkErr
	}
	if err := context.Cause(ctx); err != nil {
		return st, err
	}
	// Directory times last (making their entries changed them), deepest
	// first.
	for _, d := range slices.Backward(dirs) {
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, d.path, d.t[:], unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return st, fmt.Errorf("set times of %s: %w", d.path, err)
		}
	}
	return st, nil
}

type xattr struct {
	name  string
	value []byte
}

// readXattrs reads every extended attribute of p (not following it).
func readXattrs(p string) ([]xattr, error) {
	buf := make([]byte, 1024)
	var n int
	for {
		var err error
		n, err = unix.Llistxattr(p, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		break
	}
	var out []xattr
	for _, name := range splitNul(buf[:n]) {
		val := make([]byte, 256)
		for {
			m, err := unix.Lgetxattr(p, name, val)
			if errors.Is(err, unix.ERANGE) {
				sz, err := unix.Lgetxattr(p, name, nil)
				if err != nil {
					return nil, fmt.Errorf("get %s: %w", name, err)
				}
				val = make([]byte, sz+1)
				continue
			}
			if errors.Is(err, unix.ENODATA) {
				break
			}
			if err != nil {
				return nil, fmt.Errorf("get %s: %w", name, err)
			}
			out = append(out, xattr{name, val[:m]})
			break
		}
	}
	return out, nil
}

func splitNul(b []byte) []string {
	var out []string
	for len(b) > 0 {
		i := slices.Index(b, 0)
		if i < 0 {
			i = len(b)
		}
		if i > 0 {
			out = append(out, string(b[:i]))
		}
		b = b[min(i+1, len(b)):]
	}
	return out
}

// xattrOptional: attributes a destination may refuse without the copy
// being wrong (a label the host's LSM gives itself).
func xattrOptional(name string, err error) bool {
	return name == "security.selinux" && (errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EPERM))
}

// setMetaFd gives the regular file f st's owner, mode, xattrs and times.
// Order matters: chown clears setuid bits and file capabilities, so mode
// and xattrs come after it.
func setMetaFd(f *os.File, st *syscall.Stat_t, xa []xattr) error {
	fd := int(f.Fd())
	if err := unix.Fchown(fd, int(st.Uid), int(st.Gid)); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	if err := unix.Fchmod(fd, st.Mode&0o7777); err != nil {
		return fmt.Errorf("chmod: %w", err)
	}
	for _, x := range xa {
		if err := unix.Fsetxattr(fd, x.name, x.value, 0); err != nil && !xattrOptional(x.name, err) {
			return fmt.Errorf("set xattr %s: %w", x.name, err)
		}
	}
	ts := []unix.Timespec{unix.Timespec(st.Atim), unix.Timespec(st.Mtim)}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, fmt.Sprintf("/proc/self/fd/%d", fd), ts, 0); err != nil {
		return fmt.Errorf("set times: %w", err)
	}
	return nil
}

// setMetaPath gives p (not followed) st's owner, xattrs, mode (unless a
// symlink: withMode false) and times (except a directory's, set after its
// entries).
func setMetaPath(p string, st *syscall.Stat_t, xa []xattr, withMode bool) error {
	if err := unix.Lchown(p, int(st.Uid), int(st.Gid)); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	if withMode {
		if err := unix.Chmod(p, st.Mode&0o7777); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
	}
	for _, x := range xa {
		if err := unix.Lsetxattr(p, x.name, x.value, 0); err != nil && !xattrOptional(x.name, err) {
			return fmt.Errorf("set xattr %s: %w", x.name, err)
		}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		ts := []unix.Timespec{unix.Timespec(st.Atim), unix.Timespec(st.Mtim)}
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("set times: %w", err)
		}
	}
	return nil
}
