package gvisor

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	securejoin "github.com/cyphar/filepath-securejoin"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.RootfsDiffer = (*Runtime)(nil)

// DiffRootfs calls fn with the sandbox's changes as an overlay directory.
// They are in runsc's in-memory root overlay: `runsc tar rootfs-upper`
// serializes its upper layer (a tmpfs with overlayfs' conventions:
// whiteouts are 0/0 character devices, opaque directories carry
// trusted.overlay.opaque), which is unpacked into a directory of the state
// dir for fn and removed after. A running sandbox is paused while its
// upper is serialized, so the copy is consistent; a paused one stays paused.
func (r *Runtime) DiffRootfs(ctx context.Context, id string, fn func(ctx context.Context, d runtime.RootfsDiff) error) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	if !sb.started || sb.ended() {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not running; the gvisor backend keeps its changes in the running sandbox's memory", id)
	}
	tarFile, err := os.CreateTemp(sb.st.Bundle, "upper-*.tar")
	if err != nil {
		return fmt.Errorf("make diff file: %w", err)
	}
	defer os.Remove(tarFile.Name())
	defer tarFile.Close()
	st, err := r.Status(ctx, id)
	if err != nil {
		return err
	}
	if st.State == runtime.StateRunning {
		if _, err := r.runscOut(ctx, sb, "pause", id); err != nil {
			return fmt.Errorf("pause for diff: %w", err)
		}
	}
	_, err = r.runscOut(ctx, sb, "tar", "rootfs-upper", "--file", tarFile.Name(), id)
	if st.State == runtime.StateRunning {
		if _, rerr := r.runscOut(context.WithoutCancel(ctx), sb, "resume", id); rerr != nil {
			err = errors.Join(err, fmt.Errorf("resume after diff: %w", rerr))
		}
	}
	if err != nil {
		return fmt.Errorf("serialize sandbox %s's changes: %w", id, err)
	}
	dir, err := os.MkdirTemp(sb.st.Bundle, "upper-")
	if err != nil {
		return fmt.Errorf("make diff dir: %w", err)
	}
	defer os.RemoveAll(dir)
	if err := untar(tarFile, dir); err != nil {
		return fmt.Errorf("unpack sandbox %s's changes: %w", id, err)
	}
	return fn(ctx, runtime.RootfsDiff{Format: runtime.DiffOverlayDir, Dir: dir})
}

const paxXattr = "SCHILY.xattr."

// untar unpacks the archive runsc wrote into dir. Every path is resolved
// inside dir (securejoin), so no entry lands outside it whatever its name
// or the symlinks before it.
func untar(f *os.File, dir string) error {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return err
	}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read diff archive: %w", err)
		}
		name := filepath.Clean("/" + h.Name)
		if name == "/" {
			continue
		}
		parent, err := securejoin.SecureJoin(dir, filepath.Dir(name))
		if err != nil {
			return err
		}
		if err := os.MkdirAll(parent, 0o755); err != nil {
			return err
		}
		p := filepath.Join(parent, filepath.Base(name))
		mode := uint32(h.Mode & 0o7777)
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.Mkdir(p, os.FileMode(mode)); err != nil && !errors.Is(err, os.ErrExist) {
				return err
			}
		case tar.TypeReg:
			w, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, os.FileMode(mode))
			if err != nil {
				return err
			}
			_, err = io.Copy(w, tr)
			if cerr := w.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
		case tar.TypeSymlink:
			if err := os.Symlink(h.Linkname, p); err != nil {
				return err
			}
		case tar.TypeLink:
			target, err := securejoin.SecureJoin(dir, h.Linkname)
			if err != nil {
				return err
			}
			if err := os.Link(target, p); err != nil {
				return err
			}
		case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
			typ := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[h.Typeflag]
			if err := unix.Mknod(p, typ|mode, int(unix.Mkdev(uint32(h.Devmajor), uint32(h.Devminor)))); err != nil {
				return fmt.Errorf("mknod %s: %w", h.Name, err)
			}
		default:
			continue
		}
		for k, v := range h.PAXRecords {
			if x, ok := strings.CutPrefix(k, paxXattr); ok {
				if err := unix.Lsetxattr(p, x, []byte(v), 0); err != nil && !errors.Is(err, unix.ENOTSUP) {
					return fmt.Errorf("set xattr %s of %s: %w", x, h.Name, err)
				}
			}
		}
		if h.Typeflag != tar.TypeSymlink {
			_ = os.Lchown(p, h.Uid, h.Gid)
			_ = os.Chmod(p, os.FileMode(mode)|modeBits(mode))
		}
	}
}

// modeBits turns setuid/setgid/sticky permission bits into os.FileMode's.
func modeBits(m uint32) os.FileMode {
	var fm os.FileMode
	if m&unix.S_ISUID != 0 {
		fm |= os.ModeSetuid
	}
	if m&unix.S_ISGID != 0 {
		fm |= os.ModeSetgid
	}
	if m&unix.S_ISVTX != 0 {
		fm |= os.ModeSticky
	}
	return fm
}
