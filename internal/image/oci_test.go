package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"log"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-containerregistry/pkg/compression"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/testutil"
)

// truncatingBlobs is the registry's own in-memory blob store, except that
// blobs listed in cut are served cut in half.
type truncatingBlobs struct {
	mem registry.BlobHandler
	mu  sync.Mutex
	cut map[v1.Hash]bool // guarded by mu
}

func (b *truncatingBlobs) Get(ctx context.Context, repo string, h v1.Hash) (io.ReadCloser, error) {
	rc, err := b.mem.Get(ctx, repo, h)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	cut := b.cut[h]
	b.mu.Unlock()
	if !cut {
		return rc, nil
	}
	all, _ := io.ReadAll(rc)
	rc.Close()
	return io.NopCloser(bytes.NewReader(all[:len(all)/2])), nil
}

func (b *truncatingBlobs) Stat(ctx context.Context, repo string, h v1.Hash) (int64, error) {
	return b.mem.(registry.BlobStatHandler).Stat(ctx, repo, h)
}

func (b *truncatingBlobs) Put(ctx context.Context, repo string, h v1.Hash, rc io.ReadCloser) error {
	return b.mem.(registry.BlobPutHandler).Put(ctx, repo, h, rc)
}

// testRegistry runs go-containerregistry's registry on loopback.
func testRegistry(t *testing.T) (host string, blobs *truncatingBlobs) {
	t.Helper()
	blobs = &truncatingBlobs{mem: registry.NewInMemoryBlobHandler(), cut: map[v1.Hash]bool{}}
	srv := httptest.NewServer(registry.New(registry.WithBlobHandler(blobs), registry.Logger(discardLogger())))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://"), blobs
}

type ent struct {
	name, body, link string
	typ              byte
}

func layerOf(t *testing.T, comp compression.Compression, ents ...ent) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: 0o644, Linkname: e.link}
		switch e.typ {
		case tar.TypeDir:
			h.Mode = 0o755
		case tar.TypeReg:
			h.Size = int64(len(e.body))
		case tar.TypeChar:
			h.Devmajor, h.Devminor = 1, 3
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if e.typ == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }, tarball.WithCompression(comp))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func dirE(n string) ent        { return ent{name: n, typ: tar.TypeDir} }
func fileE(n, body string) ent { return ent{name: n, body: body, typ: tar.TypeReg} }

// whiteoutImage is three layers: a base, one deleting a file and a
// directory and making a directory opaque, and a zstd one on top.
func whiteoutImage(t *testing.T) v1.Image {
	base := layerOf(t, compression.GZip,
		dirE("etc/"), fileE("etc/a", "a"), fileE("etc/b", "b"),
		dirE("gone/"), dirE("gone/sub/"), fileE("gone/sub/f", "f"),
		dirE("opq/"), fileE("opq/old", "old"),
		fileE("hl1", "same"), ent{name: "hl2", link: "hl1", typ: tar.TypeLink},
		ent{name: "dev-null", typ: tar.TypeChar},
	)
	mid := layerOf(t, compression.GZip,
		dirE("etc/"), fileE("etc/.wh.a", ""),
		fileE(".wh.gone", ""),
		dirE("opq/"), fileE("opq/.wh..wh..opq", ""), fileE("opq/new", "new"),
	)
	top := layerOf(t, compression.ZStd, dirE("etc/"), fileE("etc/b", "b2"), fileE("top", "t"))
	img, err := mutate.AppendLayers(empty.Image, base, mid, top)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.Config = v1.Config{Env: []string{"PATH=/bin", "X=1"}, WorkingDir: "/work", Entrypoint: []string{"/bin/sh"}, Cmd: []string{"-c", "true"}}
	cf.OS, cf.Architecture = "linux", "amd64"
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// pushIndex pushes img as the linux/amd64 entry of a multi-arch index next
// to an arm64 decoy.
func pushIndex(t *testing.T, ref string, img v1.Image) {
	t.Helper()
	decoy, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip, fileE("arm", "arm")))
	if err != nil {
		t.Fatal(err)
	}
	idx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: decoy, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}},
		mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
	)
	idx = mutate.IndexMediaType(idx, types.OCIImageIndex)
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(r, idx, remote.WithContext(t.Context())); err != nil {
		t.Fatal(err)
	}
}

// treeOf lists a mounted root: path, type and content or target.
func treeOf(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		switch {
		case d.IsDir():
			out = append(out, rel+"/")
		case d.Type().IsRegular():
			b, _ := os.ReadFile(p)
			out = append(out, rel+"="+string(b))
		default:
			out = append(out, rel+" "+d.Type().String())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestImportRegistryWhiteoutsStackInOverlay(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	host, _ := testRegistry(t)
	ref := host + "/team/app:v1"
	pushIndex(t, ref, whiteoutImage(t))

	for _, format := range []Format{FormatEROFS, FormatDir} {
		t.Run(string(format), func(t *testing.T) {
			s := openStore(t, filepath.Join(t.TempDir(), "images"), WithFormat(format))
			var last Progress
			img, err := s.Import(ctx, ref, WithInternalRegistry(), WithProgress(func(p Progress) { last = p }))
			if err != nil {
				t.Fatal(err)
			}
			if img.Name != "team/app:v1" || len(img.Layers) != 3 || !last.Done || last.Bytes == 0 || last.Bytes != last.TotalBytes {
				t.Fatalf("image = %+v, last progress %+v", img, last)
			}
			if !slices.Equal(img.Config.Env, []string{"PATH=/bin", "X=1"}) || img.Config.Workdir != "/work" || !slices.Equal(img.Config.Cmd, []string{"-c", "true"}) {
				t.Fatalf("config = %+v", img.Config)
			}
			ri, err := s.Hold(ctx, "team/app:v1", "sbx")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Release(context.WithoutCancel(ctx), "sbx") }) // after the unmount below
			if len(heldDirs(t, ri, "sbx")) != 3 {
				t.Fatalf("layers = %v", heldDirs(t, ri, "sbx"))
			}
			// The sandbox's root as the container backend makes it.
			work := t.TempDir()
			upper, wd, mnt := filepath.Join(work, "u"), filepath.Join(work, "w"), filepath.Join(work, "m")
			for _, d := range []string{upper, wd, mnt} {
				os.Mkdir(d, 0o755)
			}
			mountOverlay(t, strings.Join(heldDirs(t, ri, "sbx"), ":"), upper, wd, mnt)
			want := []string{"etc/", "etc/b=b2", "hl1=same", "hl2=same", "opq/", "opq/new=new", "top=t"}
			if got := treeOf(t, mnt); !slices.Equal(got, want) {
				t.Fatalf("sandbox root:\n got %q\nwant %q", got, want)
			}
			var a, b unix.Stat_t
			unix.Stat(filepath.Join(mnt, "hl1"), &a)
			unix.Stat(filepath.Join(mnt, "hl2"), &b)
			if a.Ino != b.Ino {
				t.Error("hard link lost")
			}

			// Again: nothing fetched, the same layers.
			last = Progress{}
			img2, err := s.Import(ctx, ref, WithInternalRegistry(), WithName("other/name"), WithProgress(func(p Progress) { last = p }))
			if err != nil {
				t.Fatal(err)
			}
			if img2.ID != img.ID || last.Bytes != 0 || len(contentDirs(t, s)) != 3 {
				t.Fatalf("re-import: id %s vs %s, fetched %d bytes, layers %v", img2.ID, img.ID, last.Bytes, contentDirs(t, s))
			}
		})
	}
}

func TestImportRegistryBadInput(t *testing.T) {
	ctx := t.Context()
	host, blobs := testRegistry(t)
	s := openStore(t, filepath.Join(t.TempDir(), "images"), WithFormat(FormatDir))
	good, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip, fileE("f", strings.Repeat("x", 100000))))
	if err != nil {
		t.Fatal(err)
	}
	pushIndex(t, host+"/ok/img:v1", good)
	cut, err := mutate.AppendLayers(empty.Image, layerOf(t, compression.GZip, fileE("g", strings.Repeat("y", 100000))))
	if err != nil {
		t.Fatal(err)
	}
	cutLayers, _ := cut.Layers()
	cd, _ := cutLayers[0].Digest()
	blobs.mu.Lock()
	blobs.cut[cd] = true
	blobs.mu.Unlock()
	pushIndex(t, host+"/cut/img:v1", cut)
	pushIndex(t, host+"/empty/img:v1", empty.Image)

	// A loopback port nobody listens on.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()

	before := snapshot(t, s)
	for _, tc := range []struct {
		ref  string
		is   error
		want string
	}{
		{closed + "/x/y:1", errdefs.ErrUnavailable, "unreachable"},
		{host + "/ok/img:nope", errdefs.ErrNotFound, "not found"},
		{host + "/nope/img:v1", errdefs.ErrNotFound, "not found"},
		{host + "/ok/img@sha256:" + strings.Repeat("0", 64), errdefs.ErrNotFound, "not found"},
		{host + "/ok/img@sha256:123", errdefs.ErrInvalidArgument, "ref"},
		{"UPPER/case::", errdefs.ErrInvalidArgument, "ref"},
		{host + "/cut/img:v1", errdefs.ErrUnavailable, "cut short"},
		{host + "/empty/img:v1", errdefs.ErrInvalidArgument, "no layers"},
	} {
		_, err := s.Import(ctx, tc.ref, WithInternalRegistry())
		if err == nil || !errorsIs(err, tc.is) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v; want %v containing %q", tc.ref, err, tc.is, tc.want)
		}
		if after := snapshot(t, s); !slices.Equal(before, after) {
			t.Fatalf("%s changed the store:\n%v\n%v", tc.ref, before, after)
		}
	}
	if _, err := s.Import(ctx, host+"/ok/img:v1", WithInternalRegistry()); err != nil {
		t.Fatalf("good import after bad ones: %v", err)
	}
}

func errorsIs(err, target error) bool { return errors.Is(err, target) }

func discardLogger() *log.Logger { return log.New(io.Discard, "", 0) }
