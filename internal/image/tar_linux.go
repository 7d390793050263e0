package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	securejoin "github.com/cyphar/filepath-securejoin"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func extractTarFile(ctx context.Context, tarPath, dst string, p *progress) error {
	f, err := os.Open(tarPath)
	if err != nil {
		return errdefs.Invalid("tar", "%s: %v; pass an existing .tar or .tar.gz", tarPath, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("read image tarball: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return errdefs.Invalid("tar", "%s is not a regular file; pass a .tar or .tar.gz of a root filesystem", tarPath)
	}
	if fi.Size() == 0 {
		return errdefs.Invalid("tar", "%s is empty (0 bytes); pass a .tar or .tar.gz of a root filesystem", tarPath)
	}
	br := bufio.NewReaderSize(f, 1<<20)
	magic, _ := br.Peek(6)
	var r io.Reader = br
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		gz, err := gzip.NewReader(br)
		if err != nil {
			return errdefs.Invalid("tar", "%s: bad gzip data: %v", tarPath, err)
		}
		defer gz.Close()
		r = gz
	case bytes.HasPrefix(magic, []byte{0xfd, '7', 'z', 'X', 'Z', 0}):
		return errdefs.Invalid("tar", "%s is xz-compressed; only plain and gzip tarballs are supported (recompress with gzip)", tarPath)
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		return errdefs.Invalid("tar", "%s is zstd-compressed; only plain and gzip tarballs are supported (recompress with gzip)", tarPath)
	}
	if err := extractTar(ctx, r, dst, p, false); err != nil {
		var fe *errdefs.FieldError
		if errors.As(err, &fe) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		return fmt.Errorf("extract %s: %w", tarPath, err)
	}
	return nil
}

// cleanEntry validates a tar entry name and returns it relative to the root
// ("." for the root itself).
func cleanEntry(field, name string) (string, error) {
	if name == "" {
		return "", errdefs.Invalid("tar", "an entry has an empty %s; the tarball is damaged", field)
	}
	if strings.HasPrefix(name, "/") {
		return "", errdefs.Invalid("tar", "entry %s %q is absolute; refusing it (create the tarball with relative paths, e.g. tar -C rootfs -cf img.tar .)", field, name)
	}
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", errdefs.Invalid("tar", "entry %s %q contains '..'; refusing a path that could escape the root", field, name)
		}
	}
	return path.Clean(name), nil
}

// resolve returns the host path of rel inside root. Every parent is
// resolved with securejoin (so nothing can leave root) and must not pass
// through a symlink: writing through a link is how tarballs escape.
func resolve(root, rel string) (string, error) {
	if rel == "." {
		return root, nil
	}
	parent := filepath.Dir(rel)
	lexical := filepath.Join(root, parent)
	got, err := securejoin.SecureJoin(root, parent)
	if err != nil {
		return "", fmt.Errorf("resolve %s: %w", rel, err)
	}
	if got != lexical {
		return "", errdefs.Invalid("tar", "entry %q would be written through a symlink (it resolves to %s); refusing it", rel, strings.TrimPrefix(got, root))
	}
	return filepath.Join(got, filepath.Base(rel)), nil
}

// extractTar unpacks r into root. With oci set, it reads an OCI layer: an
// empty one is fine, and whiteouts become OverlayFS whiteouts (".wh.NAME"
// a 0/0 character device NAME, ".wh..wh..opq" the trusted.overlay.opaque
// xattr on its directory), so the layer stacks as it is.
func extractTar(ctx context.Context, r io.Reader, root string, p *progress, oci bool) error {
	tr := tar.NewReader(r)
	type dirMeta struct {
		path string
		m    meta
	}
	var dirs []dirMeta
	entries := 0
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return errdefs.Invalid("tar", "not a valid tarball after %d entries: %v", entries, err)
		}
		entries++
		rel, err := cleanEntry("name", hdr.Name)
		if err != nil {
			return err
		}
		if base := path.Base(rel); oci && strings.HasPrefix(base, whiteoutPrefix) {
			if err := whiteout(root, rel); err != nil {
				return err
			}
			p.add(1, 0)
			continue
		}
		target, err := resolve(root, rel)
		if err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return fmt.Errorf("create parent of %s: %w", rel, err)
		}
		m := meta{
			mode:   permBits(hdr.FileInfo().Mode()),
			uid:    hdr.Uid,
			gid:    hdr.Gid,
			mtime:  hdr.ModTime,
			xattrs: paxXattrs(hdr),
		}
		// A later entry replaces an earlier one, except dir over dir.
		if old, err := os.Lstat(target); err == nil && rel != "." {
			if !(old.IsDir() && hdr.Typeflag == tar.TypeDir) {
				if err := removeTree(target); err != nil {
					return fmt.Errorf("replace %s: %w", rel, err)
				}
			}
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if rel != "." {
				if err := os.Mkdir(target, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
					return fmt.Errorf("create %s: %w", rel, err)
				}
			}
			dirs = append(dirs, dirMeta{target, m})
			p.add(1, 0)
			continue
		case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // archives from old tools still mark files with TypeRegA
			out, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
			if err != nil {
				return fmt.Errorf("create %s: %w", rel, err)
			}
			n, err := io.Copy(out, tr)
			if cerr := out.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("write %s: %w", rel, err)
			}
			p.add(1, n)
		case tar.TypeSymlink:
			// Any target is fine: later entries never write through it
			// (resolve refuses), and inside the sandbox it resolves in the
			// sandbox's root.
			if err := os.Symlink(hdr.Linkname, target); err != nil {
				return fmt.Errorf("create symlink %s: %w", rel, err)
			}
			m.symlink = true
			p.add(1, 0)
		case tar.TypeLink:
			lrel, err := cleanEntry("link target", hdr.Linkname)
			if err != nil {
				return err
			}
			src, err := resolve(root, lrel)
			if err != nil {
				return err
			}
			fi, err := os.Lstat(src)
			if err != nil || fi.IsDir() {
				return errdefs.Invalid("tar", "hard link %q points to %q, which is not an earlier file in the tarball", rel, hdr.Linkname)
			}
			if err := os.Link(src, target); err != nil {
				return fmt.Errorf("create hard link %s: %w", rel, err)
			}
			p.add(1, 0)
			continue // shares the earlier entry's metadata
		case tar.TypeFifo:
			if err := unix.Mkfifo(target, 0o600); err != nil {
				return fmt.Errorf("create fifo %s: %w", rel, err)
			}
			p.add(1, 0)
		default: // devices (a sandbox gets its own /dev), global headers
			continue
		}
		if err := applyMeta(target, m); err != nil {
			return fmt.Errorf("extract %s: %w", rel, err)
		}
	}
	if entries == 0 && !oci {
		return errdefs.Invalid("tar", "the tarball has no entries; pass a .tar or .tar.gz of a root filesystem")
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := applyMeta(dirs[i].path, dirs[i].m); err != nil {
			return fmt.Errorf("extract directory: %w", err)
		}
	}
	return nil
}

func paxXattrs(hdr *tar.Header) map[string][]byte {
	var out map[string][]byte
	for k, v := range hdr.PAXRecords {
		if name, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
			if out == nil {
				out = map[string][]byte{}
			}
			out[name] = []byte(v)
		}
	}
	return out
}

const (
	whiteoutPrefix = ".wh."
	opaqueMarker   = ".wh..wh..opq"
)

// whiteout records the OCI whiteout entry rel in OverlayFS's format.
func whiteout(root, rel string) error {
	dir, base := path.Dir(rel), path.Base(rel)
	dtarget, err := resolve(root, path.Join(dir, "x"))
	if err != nil {
		return err
	}
	dtarget = filepath.Dir(dtarget)
	if err := os.MkdirAll(dtarget, 0o755); err != nil {
		return fmt.Errorf("create parent of %s: %w", rel, err)
	}
	if base == opaqueMarker {
		if err := unix.Lsetxattr(dtarget, "trusted.overlay.opaque", []byte("y"), 0); err != nil {
			return fmt.Errorf("mark %s opaque (needs root): %w", dir, err)
		}
		return nil
	}
	name := strings.TrimPrefix(base, whiteoutPrefix)
	if name == "" || name == "." || name == ".." || strings.HasPrefix(name, whiteoutPrefix) {
		return errdefs.Invalid("tar", "whiteout entry %q names no file; the layer is damaged", rel)
	}
	target := filepath.Join(dtarget, name)
	if err := removeTree(target); err != nil {
		return fmt.Errorf("replace %s: %w", rel, err)
	}
	if err := unix.Mknod(target, unix.S_IFCHR, 0); err != nil {
		return fmt.Errorf("record deletion of %s as a whiteout (needs root): %w", path.Join(dir, name), err)
	}
	return nil
}
