package image

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// lock takes the store-wide exclusive flock. flock(2) locks belong to the
// open file description, so this also excludes other goroutines of this
// process. It waits until ctx ends.
func (s *Store) lock(ctx context.Context) (func(), error) {
	unlock, err := lockFile(ctx, s.path("lock"))
	if err != nil {
		return nil, fmt.Errorf("image store: %w", err)
	}
	return unlock, nil
}

// staging is one import in progress: tmp/<id>/ guarded by a flock on
// tmp/<id>.lock, so cleanTmp in another process leaves it alone.
type staging struct {
	dir  string
	lock *os.File
}

func (s *Store) newStaging() (*staging, error) { return newStagingIn(s.path("tmp")) }

// newStagingIn makes a staging dir in tmp, a store's tmp/ directory.
func newStagingIn(tmp string) (*staging, error) {
	id := randomID()
	lp := filepath.Join(tmp, id+".lock")
	// The lock file is born locked: created under another name, flocked,
	// then renamed, so cleanTmp never sees an unlocked live lock file.
	f, err := os.OpenFile(lp+".new", os.O_CREATE|os.O_EXCL|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create import staging: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		os.Remove(lp + ".new")
		return nil, fmt.Errorf("lock import staging: %w", err)
	}
	if err := os.Rename(lp+".new", lp); err != nil {
		f.Close()
		os.Remove(lp + ".new")
		return nil, fmt.Errorf("lock import staging: %w", err)
	}
	st := &staging{dir: filepath.Join(tmp, id), lock: f}
	if err := os.Mkdir(st.dir, 0o755); err != nil {
		st.cleanup()
		return nil, fmt.Errorf("create import staging: %w", err)
	}
	return st, nil
}

func (st *staging) cleanup() {
	_ = removeTree(st.dir) // already renamed into content/ on success
	_ = os.Remove(strings.TrimSuffix(st.lock.Name(), ".new"))
	st.lock.Close()
}

// cleanTmpListed, if set, runs right after cleanTmp lists tmp/ (tests).
var cleanTmpListed func()

// cleanTmp removes staging dirs whose importer is gone (its flock is free)
// and dirs without a lock file (the lock file is created first and removed
// last).
func (s *Store) cleanTmp() error {
	ents, err := os.ReadDir(s.path("tmp"))
	if err != nil {
		return fmt.Errorf("clean image staging: %w", err)
	}
	if cleanTmpListed != nil {
		cleanTmpListed()
	}
	names := map[string]bool{}
	for _, e := range ents {
		names[e.Name()] = true
	}
	for _, e := range ents {
		n := e.Name()
		if filepath.Ext(n) == ".lock" {
			s.cleanStaging(n[:len(n)-len(".lock")])
			continue
		}
		if e.IsDir() && !names[n+".lock"] {
			// The listing is not atomic: the lock file may have appeared
			// after it was read past. Look again right before removing.
			if _, err := os.Lstat(s.path("tmp", n+".lock")); err == nil {
				s.cleanStaging(n)
			} else if errors.Is(err, fs.ErrNotExist) {
				_ = removeTree(s.path("tmp", n))
			}
			continue
		}
		// A .lock.new is an importer between create and rename, or one
		// that crashed there; only the latter is old.
		if strings.HasSuffix(n, ".lock.new") {
			if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > time.Hour {
				_ = os.Remove(s.path("tmp", n))
			}
		}
	}
	return nil
}

// cleanStaging removes staging dir tmp/<id> and its lock file if the lock
// is free (its importer is gone); a held lock leaves both alone.
func (s *Store) cleanStaging(id string) {
	lp := s.path("tmp", id+".lock")
	f, err := os.OpenFile(lp, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	defer f.Close()
	if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
		_ = removeTree(s.path("tmp", id))
		_ = os.Remove(lp)
	}
}

func syncFS(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync image content: %w", err)
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		return fmt.Errorf("sync image content: %w", err)
	}
	return nil
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}

// removeTree is os.RemoveAll that also copes with read-only directories
// when not root.
func removeTree(dir string) error {
	err := os.RemoveAll(dir)
	if err == nil || !errors.Is(err, fs.ErrPermission) {
		return err
	}
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			_ = os.Chmod(p, 0o700)
		}
		return nil
	})
	return os.RemoveAll(dir)
}

func treeSize(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}

// meta is what applyMeta restores on a copied entry.
type meta struct {
	mode     os.FileMode // permissions plus setuid/setgid/sticky
	uid, gid int
	mtime    time.Time
	xattrs   map[string][]byte
	symlink  bool
}

// applyMeta sets owner first (chown clears setuid bits), then mode, xattrs
// and times. Failures to set xattrs the filesystem does not support, or
// owners when not root, are ignored: an import as non-root keeps the files
// owned by the importer.
func applyMeta(path string, m meta) error {
	if err := os.Lchown(path, m.uid, m.gid); err != nil && (isRoot || !errors.Is(err, fs.ErrPermission)) {
		return fmt.Errorf("set owner: %w", err)
	}
	if !m.symlink {
		if err := os.Chmod(path, m.mode); err != nil {
			return fmt.Errorf("set mode: %w", err)
		}
	}
	for k, v := range m.xattrs {
		_ = unix.Lsetxattr(path, k, v, 0) // where cheap: unsupported ones are dropped
	}
	ts := []unix.Timespec{unix.NsecToTimespec(m.mtime.UnixNano()), unix.NsecToTimespec(m.mtime.UnixNano())}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, path, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times: %w", err)
	}
	return nil
}

func permBits(m os.FileMode) os.FileMode {
	return m & (os.ModePerm | os.ModeSetuid | os.ModeSetgid | os.ModeSticky)
}

func listXattrs(path string) map[string][]byte {
	sz, err := unix.Llistxattr(path, nil)
	if err != nil || sz <= 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(path, buf)
	if err != nil {
		return nil
	}
	out := map[string][]byte{}
	start := 0
	for i := 0; i < sz; i++ {
		if buf[i] != 0 {
			continue
		}
		name := string(buf[start:i])
		start = i + 1
		if name == "" {
			continue
		}
		vs, err := unix.Lgetxattr(path, name, nil)
		if err != nil {
			continue
		}
		v := make([]byte, vs)
		if vs > 0 {
			if vs, err = unix.Lgetxattr(path, name, v); err != nil {
				continue
			}
		}
		out[name] = v[:vs]
	}
	return out
}

func metaOf(path string, fi fs.FileInfo) meta {
	m := meta{mode: permBits(fi.Mode()), mtime: fi.ModTime(), xattrs: listXattrs(path), symlink: fi.Mode()&fs.ModeSymlink != 0}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		m.uid, m.gid = int(st.Uid), int(st.Gid)
	}
	return m
}

type inodeKey struct{ dev, ino uint64 }

// copyTree copies the tree at src into the existing directory dst.
func copyTree(ctx context.Context, src, dst string, p *progress) error {
	// First pass: totals for the progress bar (metadata only, cheap).
	if p.fn != nil {
		_ = filepath.WalkDir(src, func(_ string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			p.totalFiles++
			if d.Type().IsRegular() {
				if fi, err := d.Info(); err == nil {
					p.totalBytes += fi.Size()
				}
			}
			return nil
		})
	}
	type dirMeta struct {
		path string
		m    meta
	}
	var dirs []dirMeta
	links := map[inodeKey]string{}
	skipped := 0
	n := 0
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("read rootfs: %w", err)
		}
		if n++; n%128 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		fi, err := d.Info()
		if err != nil {
			return fmt.Errorf("read rootfs: %w", err)
		}
		m := metaOf(path, fi)
		st, _ := fi.Sys().(*syscall.Stat_t)
		switch mode := fi.Mode(); {
		case mode.IsDir():
			if rel != "." {
				if err := os.Mkdir(target, 0o700); err != nil {
					return fmt.Errorf("copy rootfs: %w", err)
				}
			}
			dirs = append(dirs, dirMeta{target, m})
			p.add(1, 0)
			return nil
		case mode.IsRegular():
			if st != nil && uint64(st.Nlink) > 1 {
				k := inodeKey{uint64(st.Dev), uint64(st.Ino)}
				if first, ok := links[k]; ok {
					if err := os.Link(first, target); err != nil {
						return fmt.Errorf("copy rootfs hard link %s: %w", rel, err)
					}
					p.add(1, 0)
					return nil
				}
				links[k] = target
			}
			if err := copyFile(path, target); err != nil {
				return fmt.Errorf("copy rootfs file %s: %w", rel, err)
			}
			p.add(1, fi.Size())
		case mode&fs.ModeSymlink != 0:
			dest, err := os.Readlink(path)
			if err != nil {
				return fmt.Errorf("copy rootfs symlink %s: %w", rel, err)
			}
			if err := os.Symlink(dest, target); err != nil {
				return fmt.Errorf("copy rootfs symlink %s: %w", rel, err)
			}
			p.add(1, 0)
		case mode&fs.ModeNamedPipe != 0:
			if err := unix.Mkfifo(target, 0o600); err != nil {
				return fmt.Errorf("copy rootfs fifo %s: %w", rel, err)
			}
			p.add(1, 0)
		default: // devices and sockets: a sandbox gets its own /dev
			skipped++
			return nil
		}
		if err := applyMeta(target, m); err != nil {
			return fmt.Errorf("copy rootfs %s: %w", rel, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for i := len(dirs) - 1; i >= 0; i-- { // children before parents: mtimes stick
		if err := applyMeta(dirs[i].path, dirs[i].m); err != nil {
			return fmt.Errorf("copy rootfs directory: %w", err)
		}
	}
	if skipped > 0 {
		log.G(ctx).Debug("image import skipped device files and sockets", "count", skipped)
	}
	return nil
}

// copyFile copies the regular file src (never a symlink, a fifo or a
// device put in its place: src may be in a live sandbox's upper) to the new
// file dst.
func copyFile(src, dst string) error {
	in, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer in.Close()
	if fi, err := in.Stat(); err != nil {
		return err
	} else if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is no longer a regular file: %w", src, errdefs.ErrFailedPrecondition)
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil { // copy_file_range where possible
		out.Close()
		return err
	}
	return out.Close()
}

// digestTree hashes a tree's names, types, modes, owners, mtimes, symlink
// targets, xattrs and file contents in lexical order. It returns
// "sha256:<hex>" and the bytes of file content (hard links counted once).
func digestTree(ctx context.Context, root string) (string, int64, error) {
	h := sha256.New()
	var size int64
	seen := map[inodeKey]bool{}
	n := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("digest image: %w", err)
		}
		if n++; n%128 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		rel, _ := filepath.Rel(root, path)
		fi, err := d.Info()
		if err != nil {
			return fmt.Errorf("digest image: %w", err)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("digest image: no stat for %s: %w", rel, errdefs.ErrInternal)
		}
		writeStr(h, rel)
		writeInt(h, uint64(st.Mode), uint64(st.Uid), uint64(st.Gid), uint64(fi.ModTime().UnixNano()))
		xs := listXattrs(path)
		keys := make([]string, 0, len(xs))
		for k := range xs {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		writeInt(h, uint64(len(keys)))
		for _, k := range keys {
			writeStr(h, k)
			writeStr(h, string(xs[k]))
		}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			dest, err := os.Readlink(path)
			if err != nil {
				return fmt.Errorf("digest image: %w", err)
			}
			writeStr(h, dest)
		case fi.Mode().IsRegular():
			writeInt(h, uint64(fi.Size()))
			f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("digest image: %w", err)
			}
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return fmt.Errorf("digest image: %w", err)
			}
			k := inodeKey{uint64(st.Dev), uint64(st.Ino)}
			if !seen[k] {
				seen[k] = true
				size += fi.Size()
			}
		}
		return nil
	})
	if err != nil {
		return "", 0, err
	}
	return fmt.Sprintf("sha256:%x", h.Sum(nil)), size, nil
}

func writeStr(h hash.Hash, s string) {
	writeInt(h, uint64(len(s)))
	_, _ = io.WriteString(h, s) // a hash.Hash never returns an error
}

func writeInt(h hash.Hash, vs ...uint64) {
	var b [8]byte
	for _, v := range vs {
		binary.LittleEndian.PutUint64(b[:], v)
		h.Write(b[:])
	}
}
