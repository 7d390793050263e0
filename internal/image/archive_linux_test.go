package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/compression"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/testutil"
)

// whiteoutTree is what a sandbox of whiteoutImage sees.
var whiteoutTree = []string{"etc/", "etc/b=b2", "hl1=same", "hl2=same", "opq/", "opq/new=new", "top=t"}

// sandboxTree holds name in s and lists the root a sandbox of it gets.
func sandboxTree(t *testing.T, s *Store, name string) []string {
	t.Helper()
	ctx := t.Context()
	ri, err := s.Hold(ctx, name, "sbx")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Release(context.WithoutCancel(ctx), "sbx")
	mnt := overlayRoot(t, heldDirs(t, ri, "sbx"))
	tree := treeOf(t, mnt)
	var a, b unix.Stat_t
	if unix.Stat(filepath.Join(mnt, "hl1"), &a) == nil && unix.Stat(filepath.Join(mnt, "hl2"), &b) == nil && a.Ino != b.Ino {
		t.Error("hard link hl2 -> hl1 lost")
	}
	return tree
}

// overlayRoot mounts a sandbox's root as the container backend makes it:
// overlayfs over layers (topmost first) with a fresh upper. It is unmounted
// when the test ends.
func overlayRoot(t *testing.T, layers []string) string {
	t.Helper()
	work := t.TempDir()
	upper, wd, mnt := filepath.Join(work, "u"), filepath.Join(work, "w"), filepath.Join(work, "m")
	for _, d := range []string{upper, wd, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", strings.Join(layers, ":"), upper, wd)
	if err := unix.Mount("overlay", mnt, "overlay", 0, opts); err != nil {
		t.Fatalf("mount overlay: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	return mnt
}

// writeLayout writes imgs into a fresh OCI layout, each annotated with its
// tag (the map key).
func writeLayout(t *testing.T, imgs map[string]v1.Image) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "layout")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	for tag, img := range imgs {
		if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{refNameAnnotation: tag})); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// writeDockerArchive writes img as `docker save` does with go-containerregistry
// (gzip layers named <digest>.tar.gz).
func writeDockerArchive(t *testing.T, refs map[string]v1.Image) string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "image.tar")
	m := map[name.Reference]v1.Image{}
	for r, img := range refs {
		tag, err := name.NewTag(r)
		if err != nil {
			t.Fatal(err)
		}
		m[tag] = img
	}
	if err := tarball.MultiRefWriteToFile(file, m); err != nil {
		t.Fatal(err)
	}
	return file
}

// writeDockerSave writes img in the layout Docker's own `docker save`
// uses: <n>/layer.tar uncompressed, <config digest>.json, manifest.json.
func writeDockerSave(t *testing.T, repoTag string, img v1.Image) string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "saved.tar")
	f, err := os.Create(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	add := func(name string, b []byte) {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write(b)
	}
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for i, l := range ls {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(rc)
		rc.Close()
		p := fmt.Sprintf("%d/layer.tar", i)
		add(p, b)
		paths = append(paths, p)
	}
	cfg, _ := img.RawConfigFile()
	cn, _ := img.ConfigName()
	add(cn.Hex+".json", cfg)
	man, _ := json.Marshal(tarball.Manifest{{Config: cn.Hex + ".json", RepoTags: []string{repoTag}, Layers: paths}})
	add("manifest.json", man)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return file
}

func TestImportOCILayout(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	img := whiteoutImage(t)
	other, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip, fileE("other", "o")))
	if err != nil {
		t.Fatal(err)
	}
	dir := writeLayout(t, map[string]v1.Image{"v1": img, "v2": other})
	digest, _ := img.Digest()

	for _, format := range []Format{FormatEROFS, FormatDir} {
		t.Run(string(format), func(t *testing.T) {
			s := openStore(t, filepath.Join(t.TempDir(), "images"), WithFormat(format))
			var last Progress
			got, err := s.Import(ctx, SchemeOCILayout+dir+":v1", WithProgress(func(p Progress) { last = p }))
			if err != nil {
				t.Fatal(err)
			}
			if got.Name != "layout:v1" || len(got.Layers) != 3 || got.Source != SchemeOCILayout+dir+"@"+digest.String() {
				t.Fatalf("image = %+v", got)
			}
			if !last.Done || last.Bytes == 0 || last.Bytes != last.TotalBytes {
				t.Fatalf("last progress = %+v", last)
			}
			if !slices.Equal(got.Config.Env, []string{"PATH=/bin", "X=1"}) || got.Config.Workdir != "/work" {
				t.Fatalf("config = %+v", got.Config)
			}
			if tree := sandboxTree(t, s, got.Name); !slices.Equal(tree, whiteoutTree) {
				t.Fatalf("sandbox root:\n got %q\nwant %q", tree, whiteoutTree)
			}
			// By digest, under another name: the same image, nothing read again.
			last = Progress{}
			byDigest, err := s.Import(ctx, SchemeOCILayout+dir+"@"+digest.String(), WithName("team/app:v1"))
			if err != nil {
				t.Fatal(err)
			}
			if byDigest.ID != got.ID || byDigest.Name != "team/app:v1" || len(contentDirs(t, s)) != 3 {
				t.Fatalf("by digest: %+v; layers %v", byDigest, contentDirs(t, s))
			}
			if tmp := tmpEntries(t, s); len(tmp) != 0 {
				t.Fatalf("tmp left behind: %v", tmp)
			}
		})
	}
}

func TestImportOCILayoutMultiArchIndex(t *testing.T) {
	testutil.RequiresRoot(t)
	img := whiteoutImage(t)
	decoy, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip, fileE("arm", "arm")))
	if err != nil {
		t.Fatal(err)
	}
	idx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: decoy, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}},
		mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
	)
	idx = mutate.IndexMediaType(idx, types.OCIImageIndex)
	dir := filepath.Join(t.TempDir(), "multi")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{refNameAnnotation: "example.com/team/multi:3"})); err != nil {
		t.Fatal(err)
	}
	s := openStore(t, filepath.Join(t.TempDir(), "images"))
	got, err := s.Import(t.Context(), SchemeOCILayout+dir)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := img.Digest()
	if got.Name != "team/multi:3" || !strings.HasSuffix(got.Source, want.String()) {
		t.Fatalf("image = %+v; want team/multi:3 from the amd64 manifest %s", got, want)
	}
	if tree := sandboxTree(t, s, got.Name); !slices.Equal(tree, whiteoutTree) {
		t.Fatalf("sandbox root:\n got %q\nwant %q", tree, whiteoutTree)
	}
}

func TestImportDockerArchive(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	img := whiteoutImage(t)
	other, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip, fileE("other", "o")))
	if err != nil {
		t.Fatal(err)
	}
	multi := writeDockerArchive(t, map[string]v1.Image{"example.com/team/app:v1": img, "example.com/team/other:v2": other})
	saved := writeDockerSave(t, "team/saved:1", img)
	cn, _ := img.ConfigName()

	for _, tc := range []struct {
		ref, name string
	}{
		{SchemeDockerArchive + multi + ":example.com/team/app:v1", "team/app:v1"},
		{SchemeDockerArchive + saved, "team/saved:1"},                   // uncompressed layers, as Docker writes them
		{SchemeDockerArchive + saved + ":team/saved:1", "team/saved:1"}, // the tag given explicitly
	} {
		t.Run(tc.ref, func(t *testing.T) {
			s := openStore(t, filepath.Join(t.TempDir(), "images"))
			got, err := s.Import(ctx, tc.ref)
			if err != nil {
				t.Fatal(err)
			}
			if got.Name != tc.name || len(got.Layers) != 3 || !strings.HasSuffix(got.Source, "@"+cn.String()) {
				t.Fatalf("image = %+v; want %s from config %s", got, tc.name, cn)
			}
			if !slices.Equal(got.Config.Cmd, []string{"-c", "true"}) {
				t.Fatalf("config = %+v", got.Config)
			}
			if tree := sandboxTree(t, s, got.Name); !slices.Equal(tree, whiteoutTree) {
				t.Fatalf("sandbox root:\n got %q\nwant %q", tree, whiteoutTree)
			}
		})
	}

	// A layout and a docker archive of one image give the same image ID.
	s := openStore(t, filepath.Join(t.TempDir(), "images"))
	a, err := s.Import(ctx, SchemeDockerArchive+saved)
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.Import(ctx, SchemeOCILayout+writeLayout(t, map[string]v1.Image{"v1": img})+":v1")
	if err != nil {
		t.Fatal(err)
	}
	if a.ID != b.ID || len(contentDirs(t, s)) != 3 {
		t.Fatalf("docker-archive id %s, oci-layout id %s, layers %v", a.ID, b.ID, contentDirs(t, s))
	}
}

// storeBytes lists every path in the store with its type and, for files,
// the sha256 of the content: equal lists mean a byte-for-byte equal store.
func storeBytes(t *testing.T, s *Store) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(s.Dir(), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(s.Dir(), p)
		e := rel + " " + d.Type().String()
		if d.Type().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			e += fmt.Sprintf(" %x", sha256.Sum256(b))
		}
		out = append(out, e)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// damageBlob rewrites the layout blob h with f applied to its bytes.
func damageBlob(t *testing.T, dir string, h v1.Hash, f func([]byte) []byte) {
	t.Helper()
	p := filepath.Join(dir, "blobs", h.Algorithm, h.Hex)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, f(b), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestImportArchiveBadInput(t *testing.T) {
	ctx := t.Context()
	tmp := t.TempDir()
	s := openStore(t, filepath.Join(tmp, "images"), WithFormat(FormatDir))
	good, err := mutate.AppendLayers(empty.Image,
		layerOf(t, compression.GZip, fileE("a", strings.Repeat("a", 50000))),
		layerOf(t, compression.GZip, fileE("b", strings.Repeat("b", 50000))))
	if err != nil {
		t.Fatal(err)
	}
	goodLayout := writeLayout(t, map[string]v1.Image{"v1": good})
	goodArchive := writeDockerArchive(t, map[string]v1.Image{"team/app:v1": good})
	ls, _ := good.Layers()
	top, _ := ls[1].Digest()

	// A blob with one byte changed, and one cut short.
	flipped := writeLayout(t, map[string]v1.Image{"v1": good})
	damageBlob(t, flipped, top, func(b []byte) []byte { b[len(b)/2] ^= 0xff; return b })
	cut := writeLayout(t, map[string]v1.Image{"v1": good})
	damageBlob(t, cut, top, func(b []byte) []byte { return b[:len(b)/2] })
	// A layer whose content differs from the config's diff_id: the blob
	// and manifest are rewritten consistently, only the diff_id says no.
	swapped, err := mutate.ConfigFile(good, func() *v1.ConfigFile {
		cf, _ := good.ConfigFile()
		cf = cf.DeepCopy()
		cf.RootFS.DiffIDs[1] = v1.Hash{Algorithm: "sha256", Hex: strings.Repeat("1", 64)}
		return cf
	}())
	if err != nil {
		t.Fatal(err)
	}
	badDiffArchive := writeDockerSave(t, "team/bad:1", swapped)
	badDiffLayout := writeLayout(t, map[string]v1.Image{"v1": swapped})
	// Escapes: "../" and writing through an absolute symlink.
	dotdot, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip, fileE("../evil", "x")))
	if err != nil {
		t.Fatal(err)
	}
	symEsc, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip,
		ent{name: "lnk", link: "/etc", typ: tar.TypeSymlink}, fileE("lnk/passwd", "x")))
	if err != nil {
		t.Fatal(err)
	}
	dotdotArchive := writeDockerSave(t, "team/esc:1", dotdot)
	symLayout := writeLayout(t, map[string]v1.Image{"v1": symEsc})
	// Truncated docker archive: cut mid-way (not on a 512-byte boundary).
	truncated := filepath.Join(tmp, "truncated.tar")
	b, _ := os.ReadFile(goodArchive)
	os.WriteFile(truncated, b[:len(b)/2+100], 0o644)
	emptyFile := filepath.Join(tmp, "empty.tar")
	os.WriteFile(emptyFile, nil, 0o644)
	emptyLayout := writeLayout(t, nil)
	noLayers := writeLayout(t, map[string]v1.Image{"v1": empty.Image})
	notTar := filepath.Join(tmp, "not.tar")
	os.WriteFile(notTar, bytes.Repeat([]byte("not a tar"), 100), 0o644)
	rootfsTar := makeTar(t, false, []tarEntry{{hdr: tar.Header{Name: "etc/", Typeflag: tar.TypeDir}}})

	before := storeBytes(t, s)
	for _, tc := range []struct {
		ref  string
		want string
	}{
		{SchemeOCILayout + filepath.Join(tmp, "nope"), "no such file"},
		{SchemeDockerArchive + filepath.Join(tmp, "nope.tar"), "no such file"},
		{SchemeDockerArchive + filepath.Join(tmp, "nope.tar") + ":team/app:v1", "nope.tar: stat"},
		{SchemeOCILayout, "has no path"},
		{SchemeDockerArchive, "has no path"},
		{SchemeOCILayout + goodArchive, "for a `docker save` tarball use docker-archive:"},
		{SchemeDockerArchive + goodLayout, "for an OCI image layout use oci-layout:"},
		{SchemeOCILayout + tmp, "has no index.json"},
		{SchemeOCILayout + flipped + ":v1", "has digest"},
		{SchemeOCILayout + cut + ":v1", "layer 2 of 2"},
		{SchemeOCILayout + badDiffLayout + ":v1", "the image config says"},
		{SchemeDockerArchive + badDiffArchive, "the image config says"},
		{SchemeDockerArchive + truncated, "truncated"},
		{SchemeDockerArchive + dotdotArchive, "contains '..'"},
		{SchemeOCILayout + symLayout + ":v1", "through a symlink"},
		{SchemeOCILayout + goodLayout + ":v9", `no image tagged "v9" (it holds tag v1`},
		{SchemeOCILayout + goodLayout + "@sha256:" + strings.Repeat("0", 64), "has no manifest sha256:000"},
		{SchemeOCILayout + goodLayout + "@sha256:12", "is not a digest"},
		{SchemeDockerArchive + goodArchive + ":team/app:v9", "no image tagged team/app:v9 (it holds team/app:v1)"},
		{SchemeDockerArchive + goodArchive + ":", "reference after ':' is empty"},
		{SchemeDockerArchive + emptyFile, "is empty (0 bytes)"},
		{SchemeOCILayout + emptyLayout, "holds no images"},
		{SchemeOCILayout + noLayers + ":v1", "has no layers"},
		{SchemeDockerArchive + notTar, "damaged"},
		{SchemeDockerArchive + rootfsTar, "use `opendsec image import-tar`"},
	} {
		_, err := s.Import(ctx, tc.ref)
		t.Logf("%s: %v", tc.ref, err)
		if err == nil || !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v; want an invalid argument containing %q", tc.ref, err, tc.want)
		}
		if after := storeBytes(t, s); !slices.Equal(before, after) {
			t.Fatalf("%s changed the store:\n%v\n%v", tc.ref, before, after)
		}
	}
	if _, err := os.Stat("/etc/passwd"); err != nil {
		t.Fatal(err)
	}
	// The store still imports good archives afterwards.
	if _, err := s.Import(ctx, SchemeOCILayout+goodLayout+":v1"); err != nil {
		t.Fatalf("good layout after bad input: %v", err)
	}
	if _, err := s.Import(ctx, SchemeDockerArchive+goodArchive); err != nil {
		t.Fatalf("good archive after bad input: %v", err)
	}
	if c := contentDirs(t, s); len(c) != 2 {
		t.Fatalf("layers = %v; want the 2 layers once", c)
	}
}

func TestSplitArchiveSpec(t *testing.T) {
	exists := func(p string) bool { return p == "/a:b/img.tar" || p == "/x/layout" }
	for _, tc := range []struct {
		spec, path, rest string
		ok               bool
	}{
		{"/a:b/img.tar", "/a:b/img.tar", "", true},
		{"/a:b/img.tar:team/app:v1", "/a:b/img.tar", ":team/app:v1", true},
		{"/x/layout@sha256:ab", "/x/layout", "@sha256:ab", true},
		{"/x/layout:v1", "/x/layout", ":v1", true},
		{"/nope:v1", "/nope", ":v1", false},
		{"/nope", "/nope", "", false},
	} {
		p, r, ok := splitArchiveSpec(tc.spec, ":@", exists)
		if p != tc.path || r != tc.rest || ok != tc.ok {
			t.Errorf("%q: got %q %q %v; want %q %q %v", tc.spec, p, r, ok, tc.path, tc.rest, tc.ok)
		}
	}
}
