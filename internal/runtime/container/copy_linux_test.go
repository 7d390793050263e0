package container

import (
	"bytes"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/fsutil"
	"github.com/kernflux/opendsec/internal/testutil"
)

// TestCopyTreeExact: copyTree keeps everything an overlay upper holds:
// whiteouts (0/0 character devices), opaque directories and other xattrs,
// hard links, symlinks, fifos, owners, setuid modes, times and holes.
func TestCopyTreeExact(t *testing.T) {
	testutil.RequiresRoot(t)
	src := filepath.Join(t.TempDir(), "upper")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "opaque", "sub"), 0o755))
	must(unix.Setxattr(filepath.Join(src, "opaque"), "trusted.overlay.opaque", []byte("y"), 0))
	must(unix.Mknod(filepath.Join(src, "whiteout"), unix.S_IFCHR, 0))
	must(os.WriteFile(filepath.Join(src, "opaque", "sub", "a"), []byte("a"), 0o644))
	must(os.Link(filepath.Join(src, "opaque", "sub", "a"), filepath.Join(src, "hard")))
	must(os.Symlink("opaque/sub/a", filepath.Join(src, "sym")))
	must(unix.Lsetxattr(filepath.Join(src, "sym"), "trusted.overlay.origin", []byte{1, 2, 3}, 0))
	must(unix.Mkfifo(filepath.Join(src, "fifo"), 0o640))
	must(os.WriteFile(filepath.Join(src, "suid"), []byte("#!/bin/sh\n"), 0o755))
	must(os.Chown(filepath.Join(src, "suid"), 1000, 1000))
	must(os.Chmod(filepath.Join(src, "suid"), 0o4755))
	must(unix.Setxattr(filepath.Join(src, "suid"), "user.note", []byte("kept"), 0))
	f, err := os.Create(filepath.Join(src, "sparse"))
	must(err)
	_, err = f.WriteAt([]byte("end"), 64<<20)
	must(err)
	must(f.Close())
	must(os.WriteFile(filepath.Join(src, "big"), bytes.Repeat([]byte("x"), 3<<20+17), 0o600))
	for i := range 40 {
		must(os.WriteFile(filepath.Join(src, "opaque", fmt.Sprintf("f%d", i)), []byte(strings.Repeat("y", i)), 0o640))
	}
	must(os.Chmod(filepath.Join(src, "opaque"), 0o1777))

	dst := filepath.Join(t.TempDir(), "copy")
	st, err := copyTree(t.Context(), src, dst)
	if err != nil {
		t.Fatalf("copyTree: %v", err)
	}
	if st.Links != 1 || st.Files != 44 {
		t.Errorf("copy stats %+v; want 44 files and 1 hard link", st)
	}
	a, b := describeTree(t, src), describeTree(t, dst)
	if !slices.Equal(a, b) {
		t.Fatalf("copy differs:\nsource:\n%s\ncopy:\n%s", strings.Join(a, "\n"), strings.Join(b, "\n"))
	}
	var s1, s2 unix.Stat_t
	must(unix.Stat(filepath.Join(dst, "hard"), &s1))
	must(unix.Stat(filepath.Join(dst, "opaque", "sub", "a"), &s2))
	if s1.Ino != s2.Ino {
		t.Errorf("hard link copied as two files")
	}
	must(unix.Stat(filepath.Join(dst, "sparse"), &s1))
	if s1.Blocks*512 > 1<<20 {
		t.Errorf("sparse 64 MiB file copied with %d bytes allocated; want its hole kept", s1.Blocks*512)
	}
	// Into an existing directory (a project quota's upper) too.
	dst2 := filepath.Join(t.TempDir(), "existing")
	must(os.Mkdir(dst2, 0o700))
	if _, err := copyTree(t.Context(), src, dst2); err != nil {
		t.Fatalf("copyTree into an existing directory: %v", err)
	}
	if c := describeTree(t, dst2); !slices.Equal(a, c) {
		t.Fatalf("copy into an existing directory differs:\n%s", strings.Join(c, "\n"))
	}
}

// describeTree lists every entry of dir with its type, mode, owner,
// size, device, mtime, xattrs and contents.
func describeTree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := fsutil.WalkNoFollow(t.Context(), dir, func(rel, p string, fi iofs.FileInfo) error {
		st := fi.Sys().(*syscall.Stat_t)
		xa, err := readXattrs(p)
		if err != nil {
			return err
		}
		line := fmt.Sprintf("%s mode=%o uid=%d gid=%d size=%d rdev=%d mtime=%d.%d nlink=%d xattrs=%v",
			rel, st.Mode, st.Uid, st.Gid, st.Size, st.Rdev, st.Mtim.Sec, st.Mtim.Nsec, st.Nlink, xa)
		switch {
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			line += fmt.Sprintf(" data=%x", fnv64(b))
		case fi.Mode()&os.ModeSymlink != 0:
			to, err := os.Readlink(p)
			if err != nil {
				return err
			}
			line += " -> " + to
		}
		out = append(out, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func fnv64(b []byte) uint64 {
	h := uint64(14695981039346656037)
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h
}
