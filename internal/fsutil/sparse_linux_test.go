package fsutil

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestCopySparse: the copy has the source's bytes and size, its holes
// stay holes (it allocates about the data only), an existing destination
// is refused and left as it was, and a failed copy leaves no file.
func TestCopySparse(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	data := bytes.Repeat([]byte("x"), 1<<20)
	for _, off := range []int64{4 << 20, 40 << 20} {
		if _, err := f.WriteAt(data, off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	_ = f.Close()

	dst := filepath.Join(dir, "dst")
	if err := CopySparse(src, dst); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(src)
	b, _ := os.ReadFile(dst)
	if !bytes.Equal(a, b) || len(b) != size {
		t.Fatalf("copy differs from the source (%d bytes, want %d)", len(b), size)
	}
	fi, _ := os.Stat(dst)
	if used := fi.Sys().(*syscall.Stat_t).Blocks * 512; used > 8<<20 {
		t.Errorf("the copy allocates %d bytes for 2 MiB of data in %d: holes were filled", used, size)
	}

	if err := os.WriteFile(dst, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := CopySparse(src, dst); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("copy onto an existing file: %v; want exists", err)
	}
	if b, _ := os.ReadFile(dst); string(b) != "keep" {
		t.Fatalf("an existing destination was changed: %q", b)
	}
	missing := filepath.Join(dir, "none")
	if err := CopySparse(missing, filepath.Join(dir, "dst2")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("copy of a missing source: %v; want not exist", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "dst2")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a failed copy left its destination: %v", err)
	}
}
