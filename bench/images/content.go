package main

import (
	"archive/tar"
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/klauspost/compress/gzip"
)

// benchImage is one image of the benchmark: its layer tarballs (what the
// baseline extracts per sandbox) and the OCI layout made of the same blobs
// (what we import).
type benchImage struct {
	label   string   // "1024 MiB layer"
	name    string   // store name, e.g. bench/img-1024:v1
	layers  []string // .tar.gz files, bottom first
	layout  string   // OCI layout dir
	content int64    // bytes of file content in all layers
	gz      int64    // bytes of the .tar.gz files
}

const b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

// writeDataLayer writes a gzip tar of files of fileSize bytes under
// data/dNN/, size bytes in all, filled with seeded pseudo-random base64
// text, compressed with gzip's Huffman-only mode: the tarball is ~76% of
// the content and neither side gets a free decompression (real layers of
// code and packages compress to 30-50%, so they inflate more per byte).
func writeDataLayer(path string, size, fileSize int64, seed uint64) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("create layer: %w", err)
	}
	defer f.Close()
	bw := bufio.NewWriterSize(f, 1<<20)
	zw, err := gzip.NewWriterLevel(bw, gzip.HuffmanOnly)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(zw)
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	buf := make([]byte, fileSize)
	mtime := time.Unix(1764460800, 0)
	dirs := map[string]bool{}
	for i := int64(0); i*fileSize < size; i++ {
		n := min(fileSize, size-i*fileSize)
		dir := fmt.Sprintf("data/d%02d/", i%64)
		if !dirs[dir] {
			for _, d := range []string{"data/", dir} {
				if !dirs[d] {
					dirs[d] = true
					if err := tw.WriteHeader(&tar.Header{Name: d, Typeflag: tar.TypeDir, Mode: 0o755, ModTime: mtime}); err != nil {
						return err
					}
				}
			}
		}
		for j := int64(0); j < n; j += 10 {
			v := r.Uint64()
			for k := j; k < min(j+10, n); k++ {
				buf[k] = b64[v&63]
				v >>= 6
			}
		}
		if err := tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("%sf%05d", dir, i), Typeflag: tar.TypeReg, Mode: 0o644, Size: n, ModTime: mtime}); err != nil {
			return err
		}
		if _, err := tw.Write(buf[:n]); err != nil {
			return fmt.Errorf("write layer: %w", err)
		}
	}
	for _, c := range []interface{ Close() error }{tw, zw} {
		if err := c.Close(); err != nil {
			return fmt.Errorf("write layer: %w", err)
		}
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("write layer: %w", err)
	}
	return f.Close()
}

// writeDirLayer writes a gzip tar of the directory dir with GNU tar.
func writeDirLayer(ctx context.Context, path, dir string) error {
	out, err := exec.CommandContext(ctx, "tar", "--numeric-owner", "-C", dir, "-czf", path, ".").CombinedOutput()
	if err != nil {
		return fmt.Errorf("tar %s: %w: %s", dir, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// writeLayout writes an OCI layout holding one linux/amd64 image of the
// given layer tarballs, tagged tag.
func writeLayout(dir, tag string, layers []string) error {
	img := empty.Image
	for _, p := range layers {
		l, err := tarball.LayerFromFile(p)
		if err != nil {
			return fmt.Errorf("layer %s: %w", p, err)
		}
		if img, err = mutate.AppendLayers(img, l); err != nil {
			return err
		}
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cf.Config.User = "root"
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("write layout: %w", err)
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": tag})); err != nil {
		return fmt.Errorf("write layout: %w", err)
	}
	return nil
}

// makeImage writes a benchImage of busybox plus a data layer of mib MiB.
func (b *bench) makeImage(ctx context.Context, mib int, seed uint64) (*benchImage, error) {
	im := &benchImage{
		label: fmt.Sprintf("%d MiB layer", mib),
		name:  fmt.Sprintf("bench/img-%d:v1", mib),
	}
	base := b.dir + "/busybox.tar.gz"
	if _, err := os.Stat(base); err != nil {
		if err := writeDirLayer(ctx, base, b.cfg.busybox); err != nil {
			return nil, err
		}
	}
	data := fmt.Sprintf("%s/data-%d.tar.gz", b.dir, mib)
	start := time.Now()
	if err := writeDataLayer(data, int64(mib)<<20, int64(b.cfg.fileKiB)<<10, seed); err != nil {
		return nil, err
	}
	im.layers = []string{base, data}
	im.layout = fmt.Sprintf("%s/layout-%d", b.dir, mib)
	if err := writeLayout(im.layout, "v1", im.layers); err != nil {
		return nil, err
	}
	for _, l := range im.layers {
		fi, err := os.Stat(l)
		if err != nil {
			return nil, err
		}
		im.gz += fi.Size()
	}
	im.content = int64(mib)<<20 + treeBytes(b.cfg.busybox)
	b.logf("   made %s: %s of .tar.gz in %s", im.label, human(im.gz), time.Since(start).Round(time.Millisecond))
	return im, nil
}
