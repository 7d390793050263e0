package image

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/fsutil"
)

const (
	overlayXattrPrefix = "trusted.overlay."
	opaqueXattr        = "trusted.overlay.opaque"
)

// packWalkHook, when set by a test, runs as applyLayer reaches each entry
// of the source, after reading it and before opening it.
var packWalkHook func(rel string)

// isWhiteout reports whether fi is an OverlayFS whiteout (a 0/0 character
// device).
func isWhiteout(fi fs.FileInfo) bool {
	if fi.Mode()&fs.ModeCharDevice == 0 || fi.Mode()&fs.ModeDevice == 0 {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && st.Rdev == 0
}

// applyLayer applies the layer src (OverlayFS format: whiteouts are 0/0
// character devices, replaced directories carry trusted.overlay.opaque) on
// top of dst, a layer being built in the same format, so that dst alone
// stacks like the layers applied to it stacked one on another:
//
//   - a whiteout replaces whatever dst has at its path and stays a whiteout
//     (layers below dst may still have the path);
//   - an opaque directory empties dst's directory;
//   - a directory that lands where dst has a whiteout or a non-directory is
//     made opaque, because in the stack that whiteout or file hid every
//     lower layer's directory;
//   - anything else replaces dst's entry.
//
// Overlayfs bookkeeping xattrs (origin, impure, nlink...) are dropped; an
// upper with redirected directories or metacopy files, whose content lives
// in a lower layer, is refused. With bottom set dst becomes an image's
// lowest layer, where there is nothing to hide: whiteouts are left out and
// no directory is made opaque (overlayfs would list a whiteout in the
// lowest layer as a device file).
//
// src is read without ever following a symlink (fsutil.WalkNoFollow), so it may be
// a live sandbox's upper. Entries whose slash path relative to src is in
// skip are left out with everything below them.
func applyLayer(ctx context.Context, src, dst string, bottom bool, skip []string) error {
	const what = "layer"
	type dirMeta struct {
		path string
		m    meta
	}
	var dirs []dirMeta
	links := map[inodeKey]string{}
	err := fsutil.WalkNoFollow(ctx, src, func(rel, p string, fi fs.FileInfo) error {
		if slices.Contains(skip, rel) {
			return fs.SkipDir
		}
		if packWalkHook != nil {
			packWalkHook(rel)
		}
		target := filepath.Join(dst, filepath.FromSlash(rel))
		m := metaOf(p, fi)
		if m.xattrs == nil {
			m.xattrs = map[string][]byte{}
		}
		opaque := false
		for k, v := range m.xattrs {
			if !strings.HasPrefix(k, overlayXattrPrefix) {
				continue
			}
			switch k {
			case opaqueXattr:
				opaque = bytes.Equal(v, []byte("y"))
			case overlayXattrPrefix + "redirect", overlayXattrPrefix + "metacopy":
				return errdefs.New(errdefs.ErrFailedPrecondition, "%s has %s on %s: its content lives in a lower layer; packing needs overlayfs without redirect_dir and metacopy", what, k, rel)
			}
			delete(m.xattrs, k)
		}
		if opaque && !bottom {
			m.xattrs[opaqueXattr] = []byte("y")
		}
		var old fs.FileInfo
		if rel != "." {
			old, _ = os.Lstat(target)
		}
		switch mode := fi.Mode(); {
		case mode.IsDir():
			switch {
			case rel == ".":
			case old != nil && old.IsDir():
				if opaque {
					if err := emptyDir(target); err != nil {
						return err
					}
				}
			default:
				if old != nil {
					// A whiteout or a non-directory in the stack hid the
					// lower layers' directory.
					if err := removeTree(target); err != nil {
						return fmt.Errorf("replace %s: %w", rel, err)
					}
					if !bottom {
						m.xattrs[opaqueXattr] = []byte("y")
					}
				}
				if err := os.Mkdir(target, 0o700); err != nil {
					return fmt.Errorf("create %s: %w", rel, err)
				}
			}
			if rel != "." {
				if old != nil && old.IsDir() && !opaque {
					// A merged directory stays opaque if it was.
					if v, err := lgetxattr(target, opaqueXattr); err == nil && bytes.Equal(v, []byte("y")) {
						m.xattrs[opaqueXattr] = v
					}
				}
				_ = unix.Lremovexattr(target, opaqueXattr)
			}
			dirs = append(dirs, dirMeta{target, m})
			return nil
		case isWhiteout(fi):
			if err := removeTree(target); err != nil {
				return fmt.Errorf("replace %s: %w", rel, err)
			}
			if bottom {
				return nil
			}
			if err := unix.Mknod(target, unix.S_IFCHR, 0); err != nil {
				return fmt.Errorf("record deletion of %s as a whiteout (needs root): %w", rel, err)
			}
			return nil
		}
		if old != nil {
			if err := removeTree(target); err != nil {
				return fmt.Errorf("replace %s: %w", rel, err)
			}
		}
		st, _ := fi.Sys().(*syscall.Stat_t)
		switch mode := fi.Mode(); {
		case mode.IsRegular():
			if st != nil && st.Nlink > 1 {
				k := inodeKey{uint64(st.Dev), uint64(st.Ino)}
				if first, ok := links[k]; ok {
					if err := os.Link(first, target); err != nil {
						return fmt.Errorf("copy hard link %s: %w", rel, err)
					}
					return nil
				}
				links[k] = target
			}
			if err := copyFile(p, target); err != nil {
				return fmt.Errorf("copy %s: %w", rel, err)
			}
		case mode&fs.ModeSymlink != 0:
			dest, err := os.Readlink(p)
			if err != nil {
				return fmt.Errorf("copy symlink %s: %w", rel, err)
			}
			if err := os.Symlink(dest, target); err != nil {
				return fmt.Errorf("copy symlink %s: %w", rel, err)
			}
		case mode&fs.ModeNamedPipe != 0:
			if err := unix.Mkfifo(target, 0o600); err != nil {
				return fmt.Errorf("copy fifo %s: %w", rel, err)
			}
		default: // devices and sockets: a sandbox gets its own /dev
			return nil
		}
		if err := applyMeta(target, m); err != nil {
			return fmt.Errorf("copy %s: %w", rel, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for i := len(dirs) - 1; i >= 0; i-- { // children before parents: mtimes stick
		if err := applyMeta(dirs[i].path, dirs[i].m); err != nil {
			return fmt.Errorf("copy directory: %w", err)
		}
	}
	return nil
}

func emptyDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("empty %s: %w", dir, err)
	}
	for _, e := range ents {
		if err := removeTree(filepath.Join(dir, e.Name())); err != nil {
			return fmt.Errorf("empty %s: %w", dir, err)
		}
	}
	return nil
}

func lgetxattr(p, name string) ([]byte, error) {
	buf := make([]byte, 64)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		return nil, err
	}
	return buf[:n], nil
}

// pruneEmptyParents removes, in a layer being built at dst, the
// directories above each skipped path that are left empty (and are not
// opaque): a sandbox's upper has them only as the parents of its own mount
// points (run/ of run/opendsec), which are not the step's work.
func pruneEmptyParents(dst string, skip []string) {
	for _, s := range skip {
		for p := path.Dir(s); p != "." && p != "/"; p = path.Dir(p) {
			dir := filepath.Join(dst, filepath.FromSlash(p))
			if v, err := lgetxattr(dir, opaqueXattr); err == nil && len(v) > 0 {
				break
			}
			if os.Remove(dir) != nil { // not empty, or not there
				break
			}
		}
	}
}
