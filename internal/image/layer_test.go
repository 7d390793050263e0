package image

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/testutil"
)

// mountCount is how many times mnt appears in this process's mount table.
func mountCount(t *testing.T, mnt string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == mnt {
			n++
		}
	}
	return n
}

func TestEROFSMountsSharedAndRefcounted(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	dir := filepath.Join(t.TempDir(), "images")
	s := openStore(t, dir, WithFormat(FormatEROFS))
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "etc", "hello"), "hi", 0o644)
	img, err := s.ImportDir(ctx, "mnt/img", src, Config{})
	if err != nil {
		t.Fatal(err)
	}
	h, _ := digestHex(img.Layers[0].Digest)
	if _, err := os.Stat(s.path("layers", h, "layer.erofs")); err != nil {
		t.Fatalf("layer not stored as erofs: %v", err)
	}
	a, err := s.Hold(ctx, "mnt/img", "sbxa")
	if err != nil {
		t.Fatal(err)
	}
	// A restarted node: a new Store on the same directories finds the mount.
	s2 := openStore(t, dir, WithFormat(FormatEROFS))
	b, err := s2.Hold(ctx, "mnt/img", "sbxb")
	if err != nil {
		t.Fatal(err)
	}
	mnt := heldDirs(t, a, "sbxa")[0]
	if heldDirs(t, b, "sbxb")[0] != mnt || mountCount(t, mnt) != 1 || !isMounted(mnt) {
		t.Fatalf("holders got %s and %s, mounted %d times", mnt, heldDirs(t, b, "sbxb")[0], mountCount(t, mnt))
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "etc", "hello")); err != nil || string(got) != "hi" {
		t.Fatalf("read through mount: %q, %v", got, err)
	}
	if err := os.WriteFile(filepath.Join(mnt, "new"), nil, 0o644); err == nil {
		t.Fatal("layer mount is writable")
	}
	// Each holder's ref is a hard link of the layer's one anchor: no new
	// inode per holder.
	rdir := filepath.Join(s.mountDir, "refs", h)
	anchor, err := os.Stat(filepath.Join(s.mountDir, "anchors", h))
	if err != nil {
		t.Fatal(err)
	}
	for _, holder := range []string{"sbxa", "sbxb"} {
		if fi, err := os.Stat(filepath.Join(rdir, holder)); err != nil || !os.SameFile(fi, anchor) {
			t.Fatalf("ref of %s: %v; want a hard link of the anchor", holder, err)
		}
	}
	// A ref a node made before anchors (a file of its own) counts too.
	if err := os.WriteFile(filepath.Join(rdir, "sbxold"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, "sbxa"); err != nil {
		t.Fatal(err)
	}
	if !isMounted(mnt) {
		t.Fatal("unmounted while sbxb still holds it")
	}
	if err := s2.Release(ctx, "sbxb"); err != nil {
		t.Fatal(err)
	}
	if !isMounted(mnt) {
		t.Fatal("unmounted while the ref made before anchors still holds it")
	}
	if err := s2.Release(ctx, "sbxold"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(rdir); !os.IsNotExist(err) {
		t.Fatalf("refs dir after the last release: %v; want it gone", err)
	}
	if isMounted(mnt) || mountCount(t, mnt) != 0 {
		t.Fatal("still mounted after the last holder released")
	}
	if err := s.Release(ctx, "sbxb"); err != nil {
		t.Fatalf("second release: %v", err)
	}
}

func TestDirFallback(t *testing.T) {
	ctx := t.Context()
	s := openStore(t, filepath.Join(t.TempDir(), "images"), WithFormat(FormatDir))
	if s.Format() != FormatDir {
		t.Fatalf("format = %s", s.Format())
	}
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "f"), "x", 0o644)
	img, err := s.ImportDir(ctx, "plain/img", src, Config{})
	if err != nil {
		t.Fatal(err)
	}
	ri, err := s.Hold(ctx, "plain/img", "sbx")
	if err != nil {
		t.Fatal(err)
	}
	h, _ := digestHex(img.Layers[0].Digest)
	if want := s.path("layers", h, "dir"); len(heldDirs(t, ri, "sbx")) != 1 || heldDirs(t, ri, "sbx")[0] != want {
		t.Fatalf("layers = %v; want [%s]", heldDirs(t, ri, "sbx"), want)
	}
	if _, err := os.Stat(s.path("layers", h, "layer.erofs")); err == nil {
		t.Fatal("fallback store wrote an erofs file")
	}
	if got, err := os.ReadFile(filepath.Join(heldDirs(t, ri, "sbx")[0], "f")); err != nil || string(got) != "x" {
		t.Fatalf("read = %q, %v", got, err)
	}
	if err := s.Release(ctx, "sbx"); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(filepath.Join(t.TempDir(), "x"), WithFormat("zfs")); err == nil || !strings.Contains(err.Error(), "image_format") {
		t.Fatalf("bad format: %v", err)
	}
}
