package image

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/testutil"
)

// sandboxRoot mounts the overlay root a container backend makes for a
// sandbox holding name, and returns the mount and its upper directory.
func sandboxRoot(t *testing.T, s *Store, name, holder string) (root, upper string) {
	t.Helper()
	ri, err := s.Hold(t.Context(), name, holder)
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	upper, wd, mnt := filepath.Join(work, "u"), filepath.Join(work, "w"), filepath.Join(work, "m")
	for _, d := range []string{upper, wd, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	lower := strings.Join(heldDirs(t, ri, holder), ":")
	if len(heldDirs(t, ri, holder)) == 1 {
		// overlayfs needs two lowers without an upper; with one it is fine.
		lower = heldDirs(t, ri, holder)[0]
	}
	t.Cleanup(func() { s.Release(context.Background(), holder) })
	mountOverlay(t, lower, upper, wd, mnt) // unmounted before the release
	return mnt, upper
}

func importTree(t *testing.T, s *Store, name string, files map[string]string) Image {
	t.Helper()
	src := t.TempDir()
	for p, c := range files {
		if strings.HasSuffix(p, "/") {
			if err := os.MkdirAll(filepath.Join(src, p), 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		writeFile(t, filepath.Join(src, p), c, 0o644)
	}
	img, err := s.ImportDir(t.Context(), name, src, Config{Env: []string{"PATH=/bin"}})
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// duBytes is the bytes of every file under dir (what the store takes).
func duBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if fi, err := d.Info(); err == nil && d.Type().IsRegular() {
			n += fi.Size()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestComposeReferencesLayersOnly(t *testing.T) {
	testutil.RequiresRoot(t)
	for _, format := range []Format{FormatEROFS, FormatDir} {
		t.Run(string(format), func(t *testing.T) {
			ctx := t.Context()
			s := openStore(t, filepath.Join(t.TempDir(), "images"), WithFormat(format))
			importTree(t, s, "base", map[string]string{"etc/base": "base", "bin/": ""})
			ws := importTree(t, s, "workspace", map[string]string{"work/ws": "workspace" + strings.Repeat("x", 100000)})
			importTree(t, s, "toolkit", map[string]string{"opt/tk/tool": "toolkit"})
			layersBefore := duBytes(t, s.path("layers"))
			storeBefore := duBytes(t, s.Dir())

			img, err := s.Compose(ctx, ComposeRequest{
				Base:   "base",
				Layers: []ComposeLayer{{Digest: ws.Layers[0].Digest}, {Image: "toolkit"}},
				Name:   "team/env:v1",
				Config: &Config{Env: []string{"TEAM=1"}, Workdir: "/work"},
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(img.Layers) != 3 || img.Name != "team/env:v1" {
				t.Fatalf("composed = %+v", img)
			}
			if !slices.Equal(img.Config.Env, []string{"PATH=/bin", "TEAM=1"}) || img.Config.Workdir != "/work" {
				t.Fatalf("config = %+v", img.Config)
			}
			if got := duBytes(t, s.path("layers")); got != layersBefore {
				t.Fatalf("layers grew from %d to %d bytes: compose copied layer bytes", layersBefore, got)
			}
			// Only a manifest and a ref are new: well under one layer.
			if grew := duBytes(t, s.Dir()) - storeBefore; grew <= 0 || grew > 4096 {
				t.Fatalf("store grew by %d bytes, want a manifest and a ref (0 < n <= 4096)", grew)
			}
			root, _ := sandboxRoot(t, s, "team/env:v1", "sbx1")
			for p, want := range map[string]string{"etc/base": "base", "opt/tk/tool": "toolkit"} {
				if b, err := os.ReadFile(filepath.Join(root, p)); err != nil || string(b) != want {
					t.Errorf("%s = %q, %v; want %q", p, b, err, want)
				}
			}
			if b, err := os.ReadFile(filepath.Join(root, "work/ws")); err != nil || !strings.HasPrefix(string(b), "workspace") {
				t.Errorf("work/ws: %v", err)
			}
		})
	}
}

func TestPackDiff(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	s := newStore(t)
	importTree(t, s, "base", map[string]string{
		"etc/old": "old", "etc/keep": "keep", "lib/x": "x", "lib/sub/y": "y", "home/": "",
	})
	root, upper := sandboxRoot(t, s, "base", "sbxsrc")
	// pip-install-like changes: new files, a deleted lower file, a
	// replaced directory, and a secret to scrub.
	writeFile(t, filepath.Join(root, "usr/lib/python3/site/pkg.py"), "print(1)", 0o644)
	writeFile(t, filepath.Join(root, "etc/keep"), "changed", 0o600)
	if err := os.Remove(filepath.Join(root, "etc/old")); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(root, "lib")); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(root, "lib/z"), "z", 0o644)
	writeFile(t, filepath.Join(root, "home/.cache/secret"), "token", 0o600)
	if err := os.Symlink("/etc/keep", filepath.Join(root, "home/link")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(upper); err != nil {
		t.Fatal(err)
	}

	img, err := s.PackDiff(ctx, PackDiffRequest{Holder: "sbxsrc", Upper: upper, Name: "packed:v1", ScrubPaths: []string{"/home/.cache"}})
	if err != nil {
		t.Fatal(err)
	}
	base, _ := s.Inspect(ctx, "base")
	if len(img.Layers) != 2 || img.Layers[0] != base.Layers[0] || img.Source != "sandbox:sbxsrc" {
		t.Fatalf("packed = %+v", img)
	}
	want := []string{"etc/", "etc/keep=changed", "home/", "home/link L---------", "lib/", "lib/z=z", "usr/", "usr/lib/", "usr/lib/python3/", "usr/lib/python3/site/", "usr/lib/python3/site/pkg.py=print(1)"}
	for i := range 10 {
		r, _ := sandboxRoot(t, s, "packed:v1", fmt.Sprintf("sbx%d", i))
		if got := treeOf(t, r); !slices.Equal(got, want) {
			t.Fatalf("sandbox %d of the packed image:\n got %q\nwant %q", i, got, want)
		}
	}
	orig, _ := sandboxRoot(t, s, "base", "sbxorig")
	wantOrig := []string{"etc/", "etc/keep=keep", "etc/old=old", "home/", "lib/", "lib/sub/", "lib/sub/y=y", "lib/x=x"}
	if got := treeOf(t, orig); !slices.Equal(got, wantOrig) {
		t.Fatalf("sandbox of the original image:\n got %q\nwant %q", got, wantOrig)
	}

	// A sandbox without changes packs to its image's layers.
	_, up2 := sandboxRoot(t, s, "base", "sbxclean")
	same, err := s.PackDiff(ctx, PackDiffRequest{Holder: "sbxclean", Upper: up2, Name: "same"})
	if err != nil {
		t.Fatal(err)
	}
	if same.ID != base.ID {
		t.Fatalf("unchanged sandbox packed to %s, want the base's %s", same.ID, base.ID)
	}
}

func TestMergeLayersKeepsWhiteouts(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	host, _ := testRegistry(t)
	ref := host + "/team/app:v1"
	pushIndex(t, ref, whiteoutImage(t))
	s := newStore(t)
	img, err := s.Import(ctx, ref, WithInternalRegistry(), WithMergeLayers())
	if err != nil {
		t.Fatal(err)
	}
	if len(img.Layers) != 1 {
		t.Fatalf("merged image has %d layers, want 1", len(img.Layers))
	}
	root, _ := sandboxRoot(t, s, "team/app:v1", "sbx")
	want := []string{"etc/", "etc/b=b2", "hl1=same", "hl2=same", "opq/", "opq/new=new", "top=t"}
	if got := treeOf(t, root); !slices.Equal(got, want) {
		t.Fatalf("merged root:\n got %q\nwant %q", got, want)
	}

	// Merging onto a base keeps whiteouts and opaque dirs against it.
	importTree(t, s, "b", map[string]string{"etc/a": "a", "etc/b": "b", "opq/old": "o", "gone/f": "f"})
	up1 := t.TempDir()
	writeFile(t, filepath.Join(up1, "top1"), "1", 0o644)
	if err := unix.Mknod(filepath.Join(up1, "gone"), unix.S_IFCHR, 0); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(up1, "opq/new"), "n", 0o644)
	if err := unix.Setxattr(filepath.Join(up1, "opq"), opaqueXattr, []byte("y"), 0); err != nil {
		t.Fatal(err)
	}
	sandboxRoot(t, s, "b", "h1")
	if _, err := s.PackDiff(ctx, PackDiffRequest{Holder: "h1", Upper: up1, Name: "b1"}); err != nil {
		t.Fatal(err)
	}
	up2 := t.TempDir()
	writeFile(t, filepath.Join(up2, "gone/back"), "back", 0o644) // a dir over a whiteout
	if err := os.Mkdir(filepath.Join(up2, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(filepath.Join(up2, "etc/a"), unix.S_IFCHR, 0); err != nil {
		t.Fatal(err)
	}
	sandboxRoot(t, s, "b1", "h2")
	if _, err := s.PackDiff(ctx, PackDiffRequest{Holder: "h2", Upper: up2, Name: "b2"}); err != nil {
		t.Fatal(err)
	}
	r1, _ := sandboxRoot(t, s, "b2", "h3")
	unmerged := treeOf(t, r1)
	merged, err := s.Compose(ctx, ComposeRequest{Base: "b2", Name: "b2merged", MergeLayers: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(merged.Layers) != 1 {
		t.Fatalf("merged layers = %d", len(merged.Layers))
	}
	wantB2 := []string{"etc/", "etc/b=b", "gone/", "gone/back=back", "opq/", "opq/new=n", "top1=1"}
	if !slices.Equal(unmerged, wantB2) {
		t.Fatalf("unmerged:\n got %q\nwant %q", unmerged, wantB2)
	}
	r2, _ := sandboxRoot(t, s, "b2merged", "h4")
	if got := treeOf(t, r2); !slices.Equal(got, wantB2) {
		t.Fatalf("merged:\n got %q\nwant %q", got, wantB2)
	}

	// The same three layers above a big layer: the merged layer is not the
	// lowest, so it must keep whiteouts and make gone/ opaque.
	big := t.TempDir()
	if err := os.WriteFile(filepath.Join(big, "big"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(big, "big"), DefaultMergeThreshold+1); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(big, "etc/a"), "biga", 0o644)
	writeFile(t, filepath.Join(big, "gone/g"), "bigg", 0o644)
	writeFile(t, filepath.Join(big, "opq/bigo"), "bigo", 0o644)
	if _, err := s.ImportDir(ctx, "big", big, Config{}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Compose(ctx, ComposeRequest{Base: "big", Layers: []ComposeLayer{{Image: "b2"}}, Name: "onbig"}); err != nil {
		t.Fatal(err)
	}
	m2, err := s.Compose(ctx, ComposeRequest{Base: "onbig", Name: "onbigmerged", MergeLayers: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(m2.Layers) != 2 {
		t.Fatalf("merged above big: %d layers, want 2", len(m2.Layers))
	}
	treeNoBig := func(root string) []string {
		return slices.DeleteFunc(treeOf(t, root), func(s string) bool { return strings.HasPrefix(s, "big=") })
	}
	r3, _ := sandboxRoot(t, s, "onbig", "h5")
	r4, _ := sandboxRoot(t, s, "onbigmerged", "h6")
	if a, b := treeNoBig(r3), treeNoBig(r4); !slices.Equal(a, wantB2) || !slices.Equal(b, wantB2) {
		t.Fatalf("above a big layer:\nunmerged %q\nmerged   %q\nwant     %q", a, b, wantB2)
	}
}

func TestGCKeepsHeldAndReferencedLayers(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	dir := filepath.Join(t.TempDir(), "images")
	a := openStore(t, dir)
	b := openStore(t, dir, WithMountDir(dir+".node2")) // a second node on the same store
	base := importTree(t, a, "base", map[string]string{"f": "base"})
	held := importTree(t, a, "held", map[string]string{"f": "held"})
	orphan := importTree(t, a, "orphan", map[string]string{"f": "orphan"})
	if _, err := a.Compose(ctx, ComposeRequest{Base: "base", Layers: []ComposeLayer{{Digest: held.Layers[0].Digest}}, Name: "composed"}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Hold(ctx, "held", "sbxheld"); err != nil {
		t.Fatal(err)
	}
	defer a.Release(context.WithoutCancel(ctx), "sbxheld")
	for _, n := range []string{"held", "orphan"} {
		if err := a.Remove(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	res, err := b.GC(ctx) // the other node collects
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Removed, []string{orphan.Layers[0].Digest}) {
		t.Fatalf("gc removed %v, want only the orphan %s", res.Removed, orphan.Layers[0].Digest)
	}
	if err := a.Remove(ctx, "composed"); err != nil {
		t.Fatal(err)
	}
	// held's layer is still held by a sandbox (through the image "held").
	res, err = b.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Removed) != 0 {
		t.Fatalf("gc removed %v while only base (named) and held (held) remain", res.Removed)
	}
	if _, err := os.Stat(a.path("layers", strings.TrimPrefix(base.Layers[0].Digest, "sha256:"))); err != nil {
		t.Fatal(err)
	}
	a.Release(ctx, "sbxheld")
	res, err = b.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Removed, []string{held.Layers[0].Digest}) {
		t.Fatalf("after release gc removed %v, want %s", res.Removed, held.Layers[0].Digest)
	}
}

func TestVerifyFindsCorruptLayers(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	for _, format := range []Format{FormatEROFS, FormatDir} {
		t.Run(string(format), func(t *testing.T) {
			s := openStore(t, filepath.Join(t.TempDir(), "images"), WithFormat(format))
			good := importTree(t, s, "good", map[string]string{"f": "good"})
			bad := importTree(t, s, "bad", map[string]string{"f": "bad!"})
			res, err := s.Verify(ctx)
			if err != nil || res.Checked != 2 || len(res.Corrupt) != 0 {
				t.Fatalf("clean store: %+v, %v", res, err)
			}
			h := strings.TrimPrefix(bad.Layers[0].Digest, "sha256:")
			victim := s.path("layers", h, "dir", "f")
			if format == FormatEROFS {
				victim = s.path("layers", h, "layer.erofs")
			}
			f, err := os.OpenFile(victim, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			fi, _ := f.Stat()
			f.WriteAt([]byte("X"), fi.Size()-1)
			f.Close()
			res, err = s.Verify(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Corrupt) != 1 || res.Corrupt[0].Digest != bad.Layers[0].Digest {
				t.Fatalf("verify = %+v; want only %s corrupt (good is %s)", res, bad.Layers[0].Digest, good.Layers[0].Digest)
			}
		})
	}
}

func TestImageOpsBadInputChangeNothing(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	s := newStore(t)
	base := importTree(t, s, "base", map[string]string{"f": "x"})
	before := snapshot(t, s)
	missing := "sha256:" + strings.Repeat("ab", 32)
	cases := []struct {
		name, field string
		cat         error
		run         func() error
	}{
		{"compose unknown base", "base", errdefs.ErrNotFound, func() error {
			_, err := s.Compose(ctx, ComposeRequest{Base: "nope", Name: "x"})
			return err
		}},
		{"compose unknown layer", "layers[0].digest", errdefs.ErrNotFound, func() error {
			_, err := s.Compose(ctx, ComposeRequest{Base: "base", Layers: []ComposeLayer{{Digest: missing}}, Name: "x"})
			return err
		}},
		{"compose bad digest", "layers[1].digest", errdefs.ErrInvalidArgument, func() error {
			_, err := s.Compose(ctx, ComposeRequest{Base: "base", Layers: []ComposeLayer{{Digest: base.Layers[0].Digest}, {Digest: "sha256:xyz"}}, Name: "x"})
			return err
		}},
		{"compose unknown image layer", "layers[0].image", errdefs.ErrNotFound, func() error {
			_, err := s.Compose(ctx, ComposeRequest{Base: "base", Layers: []ComposeLayer{{Image: "nope:v9"}}, Name: "x"})
			return err
		}},
		{"compose invalid name", "name", errdefs.ErrInvalidArgument, func() error {
			_, err := s.Compose(ctx, ComposeRequest{Base: "base", Name: "Bad Name"})
			return err
		}},
		{"compose bad workdir", "workdir", errdefs.ErrInvalidArgument, func() error {
			_, err := s.Compose(ctx, ComposeRequest{Base: "base", Name: "x", Config: &Config{Workdir: "rel"}})
			return err
		}},
		{"tag unknown", "source", errdefs.ErrNotFound, func() error {
			_, err := s.Tag(ctx, "base:nope", "y")
			return err
		}},
		{"tag invalid target", "target", errdefs.ErrInvalidArgument, func() error {
			_, err := s.Tag(ctx, "base", "../y")
			return err
		}},
		{"remove unknown", "image", errdefs.ErrNotFound, func() error { return s.Remove(ctx, "base:v2") }},
		{"inspect unknown tag", "image", errdefs.ErrNotFound, func() error {
			_, err := s.Inspect(ctx, "base:v2")
			return err
		}},
		{"pack unknown sandbox", "sandbox_id", errdefs.ErrNotFound, func() error {
			_, err := s.PackDiff(ctx, PackDiffRequest{Holder: "nosuchsbx", Upper: t.TempDir(), Name: "p"})
			return err
		}},
		{"pack bad scrub", "scrub_paths[0]", errdefs.ErrInvalidArgument, func() error {
			_, err := s.PackDiff(ctx, PackDiffRequest{Holder: "x", Upper: t.TempDir(), Name: "p", ScrubPaths: []string{"rel/../x"}})
			return err
		}},
		{"pack invalid name", "name", errdefs.ErrInvalidArgument, func() error {
			_, err := s.PackDiff(ctx, PackDiffRequest{Holder: "x", Upper: t.TempDir(), Name: ""})
			return err
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.run()
			if err == nil {
				t.Fatal("no error")
			}
			if !errorsIs(err, c.cat) || !strings.Contains(err.Error(), c.field) {
				t.Fatalf("error %q: want category %v naming %q", err, c.cat, c.field)
			}
			if after := snapshot(t, s); !slices.Equal(before, after) {
				t.Fatalf("store changed:\nbefore %q\nafter  %q", before, after)
			}
		})
	}
}
