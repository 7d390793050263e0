// Package fsutil holds filesystem helpers shared by the image store and the
// runtime backends.
package fsutil

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"sort"
	"strconv"

	"golang.org/x/sys/unix"
)

// WalkNoFollow walks the tree at root in lexical order, like
// filepath.WalkDir, but never follows a symlink below root, even when the
// tree changes during the walk (a sandbox's live upper layer): every
// directory is opened relative to its parent's descriptor with
// O_NOFOLLOW|O_DIRECTORY, so a directory swapped for a symlink fails the
// walk instead of leading out of root.
//
// fn gets the entry's slash-separated path relative to root ("." for root),
// a path p naming the entry through its parent's open descriptor
// (/proc/self/fd/N/NAME, valid only during fn: use it with Lstat, Readlink,
// Llistxattr and O_NOFOLLOW opens) and the entry's Lstat. fn returning
// fs.SkipDir leaves the entry's contents out (for a directory) and goes on.
func WalkNoFollow(ctx context.Context, root string, fn func(rel, p string, fi fs.FileInfo) error) error {
	return walkNoFollow(ctx, root, false, fn)
}

// WalkNoFollowSkipChanged is WalkNoFollow for a tree that changes under
// the walk and where a partial answer is fine (measuring a live upper
// layer): a directory that is no longer a directory (or is gone) when the
// walk opens it is skipped instead of failing the walk. It still never
// follows a symlink.
func WalkNoFollowSkipChanged(ctx context.Context, root string, fn func(rel, p string, fi fs.FileInfo) error) error {
	return walkNoFollow(ctx, root, true, fn)
}

func walkNoFollow(ctx context.Context, root string, skipChanged bool, fn func(rel, p string, fi fs.FileInfo) error) error {
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", root, &os.PathError{Op: "open", Path: root, Err: err})
	}
	dir := os.NewFile(uintptr(fd), root)
	defer dir.Close()
	p := fdPath(fd, ".")
	fi, err := os.Lstat(p)
	if err != nil {
		return err
	}
	if err := fn(".", p, fi); err != nil {
		if errors.Is(err, fs.SkipDir) {
			return nil
		}
		return err
	}
	n := 0
	return walkDirFd(ctx, dir, fd, ".", skipChanged, fn, &n)
}

func fdPath(fd int, name string) string {
	return "/proc/self/fd/" + strconv.Itoa(fd) + "/" + name
}

func walkDirFd(ctx context.Context, dir *os.File, fd int, rel string, skipChanged bool, fn func(rel, p string, fi fs.FileInfo) error, n *int) error {
	names, err := dir.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("read directory %s: %w", rel, err)
	}
	sort.Strings(names)
	for _, name := range names {
		if *n++; *n%128 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		crel := path.Join(rel, name)
		p := fdPath(fd, name)
		fi, err := os.Lstat(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed since the directory was read
		} else if err != nil {
			return fmt.Errorf("read %s: %w", crel, err)
		}
		if err := fn(crel, p, fi); errors.Is(err, fs.SkipDir) {
			continue
		} else if err != nil {
			return err
		}
		if !fi.IsDir() {
			continue
		}
		cfd, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil && skipChanged && (errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ENOENT)) {
			continue
		}
		if err != nil {
			return fmt.Errorf("open directory %s (changed during the walk?): %w", crel, err)
		}
		child := os.NewFile(uintptr(cfd), crel)
		err = walkDirFd(ctx, child, cfd, crel, skipChanged, fn, n)
		child.Close()
		if err != nil {
			return err
		}
	}
	return nil
}
