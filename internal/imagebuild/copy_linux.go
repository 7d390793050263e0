package imagebuild

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	securejoin "github.com/cyphar/filepath-securejoin"
	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
)

// view returns a read-only directory showing layers (bottom first) stacked
// as a sandbox sees them: nothing for no layers, the layer itself for one,
// else a read-only overlayfs mount in the build's scratch dir.
func (bd *builder) view(ctx context.Context, layers []image.Layer) (string, func(), error) {
	dirs, err := bd.b.Dirs(ctx, layers)
	if err != nil {
		return "", nil, err
	}
	switch len(dirs) {
	case 0:
		d, err := os.MkdirTemp(bd.b.Dir(), "empty-")
		if err != nil {
			return "", nil, fmt.Errorf("build view: %w", err)
		}
		return d, func() { os.Remove(d) }, nil
	case 1:
		return dirs[0], func() {}, nil
	}
	mp, err := os.MkdirTemp(bd.b.Dir(), "view-")
	if err != nil {
		return "", nil, fmt.Errorf("build view: %w", err)
	}
	if err := unix.Mount("overlay", mp, "overlay", unix.MS_RDONLY|unix.MS_NODEV|unix.MS_NOSUID, "lowerdir="+strings.Join(dirs, ":")); err != nil {
		os.Remove(mp)
		return "", nil, fmt.Errorf("mount build view: %w", err)
	}
	return mp, func() {
		_ = unix.Unmount(mp, unix.MNT_DETACH)
		os.Remove(mp)
	}, nil
}

// owner is who owns what a step writes; keep means the source's owner.
type owner struct {
	uid, gid int
	keep     bool
}

// dirMeta is a directory's metadata, applied after its children are written.
type dirMeta struct {
	path     string
	mode     os.FileMode
	uid, gid int
	fi       fs.FileInfo
}

// ensureDirs makes the directories of rel (absolute in the image) in the
// layer dir dst: those the image has (in view) with the image's owner and
// mode (overlayfs shows the topmost layer's directory metadata), the others
// 0755 owned by mk. It reports whether any was missing.
func ensureDirs(dst, view, rel string, mk owner, metas *[]dirMeta) (bool, error) {
	missing := false
	cur := ""
	for _, c := range strings.Split(strings.Trim(rel, "/"), "/") {
		if c == "" {
			continue
		}
		cur = path.Join(cur, c)
		target := filepath.Join(dst, cur)
		fi, err := os.Lstat(filepath.Join(view, cur))
		var m dirMeta
		switch {
		case err == nil && fi.Mode()&fs.ModeSymlink != 0:
			return false, errdefs.Invalid("dockerfile", "/%s is a symlink in the image; name the directory it points to instead", cur)
		case err == nil && !fi.IsDir():
			return false, errdefs.Invalid("dockerfile", "/%s is a file in the image, not a directory", cur)
		case err == nil:
			st := fi.Sys().(*syscall.Stat_t)
			m = dirMeta{path: target, mode: fi.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky), uid: int(st.Uid), gid: int(st.Gid), fi: fi}
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR):
			missing = true
			m = dirMeta{path: target, mode: 0o755, uid: mk.uid, gid: mk.gid}
		default:
			return false, fmt.Errorf("look up /%s in the image: %w", cur, err)
		}
		if _, err := os.Lstat(target); err == nil {
			continue
		}
		if err := os.Mkdir(target, 0o700); err != nil {
			return false, fmt.Errorf("make /%s: %w", cur, err)
		}
		*metas = append(*metas, m)
	}
	return missing, nil
}

func applyDirMetas(metas []dirMeta) error {
	for i := len(metas) - 1; i >= 0; i-- {
		m := metas[i]
		if err := os.Lchown(m.path, m.uid, m.gid); err != nil {
			return fmt.Errorf("own %s: %w", m.path, err)
		}
		if err := os.Chmod(m.path, m.mode); err != nil {
			return fmt.Errorf("chmod %s: %w", m.path, err)
		}
		if m.fi != nil {
			_ = os.Chtimes(m.path, m.fi.ModTime(), m.fi.ModTime())
		}
	}
	return nil
}

// mkdirLayer is WORKDIR's layer: the directories of wd the image lacks.
func (bd *builder) mkdirLayer(ctx context.Context, st *stageState, wd string) (image.Layer, bool, error) {
	view, done, err := bd.view(ctx, st.layers)
	if err != nil {
		return image.Layer{}, false, err
	}
	defer done()
	return bd.b.AddLayer(ctx, func(ctx context.Context, dst string) error {
		var metas []dirMeta
		missing, err := ensureDirs(dst, view, wd, owner{}, &metas)
		if err != nil {
			return err
		}
		if !missing { // the image has it: no layer
			for i := len(metas) - 1; i >= 0; i-- {
				os.Remove(metas[i].path)
			}
			return nil
		}
		return applyDirMetas(metas)
	})
}

type copySpec struct {
	srcs         []string
	dest, from   string
	chown, chmod string
	add          bool
	fromLayers   []image.Layer
}

// source is one resolved COPY source.
type source struct {
	arg  string // as written
	path string // on the host, inside the source root
	fi   fs.FileInfo
}

func (bd *builder) copyStep(ctx context.Context, st *stageState, cs copySpec, instr string) (bool, error) {
	what := "COPY"
	if cs.add {
		what = "ADD"
	}
	var root, fromID string
	if cs.from != "" {
		if s := bd.findStage(cs.from); s != nil {
			cs.fromLayers = s.layers
		} else {
			img, err := bd.b.BaseImage(ctx, cs.from)
			if err != nil {
				return false, errdefs.Invalid("dockerfile", "--from=%s is neither an earlier stage nor an image in the store", cs.from)
			}
			cs.fromLayers = img.Layers
		}
		fromID = "stage:" + chain(cs.fromLayers)
		v, done, err := bd.view(ctx, cs.fromLayers)
		if err != nil {
			return false, err
		}
		defer done()
		root = v
	} else {
		if bd.req.ContextDir == "" {
			return false, errdefs.Invalid("dockerfile", "%s needs a build context, and this build has none; pass the context directory", what)
		}
		root, fromID = bd.req.ContextDir, "context"
	}
	srcs, err := resolveSources(root, cs.srcs, cs.from == "", cs.add)
	if err != nil {
		return false, err
	}
	own := owner{keep: cs.from != ""}
	var mode *os.FileMode
	if cs.chmod != "" {
		m, err := strconv.ParseUint(cs.chmod, 8, 32)
		if err != nil || m > 0o7777 {
			return false, errdefs.Invalid("dockerfile", "--chmod=%s is not an octal mode like 0755", cs.chmod)
		}
		fm := os.FileMode(m & 0o777)
		mode = &fm
	}
	view, done, err := bd.view(ctx, st.layers)
	if err != nil {
		return false, err
	}
	defer done()
	if cs.chown != "" {
		if own, err = parseChown(view, cs.chown); err != nil {
			return false, err
		}
	}
	dest := absIn(st.cfg.Workdir, cs.dest)
	destIsDir := strings.HasSuffix(cs.dest, "/") || len(srcs) > 1 || slices.ContainsFunc(cs.srcs, isGlob)
	if fi, err := os.Stat(filepath.Join(view, dest)); err == nil && fi.IsDir() {
		destIsDir = true
	}
	hash, err := hashSources(srcs, cs.from != "")
	if err != nil {
		return false, err
	}
	argj, _ := json.Marshal(cs.srcs)
	key := image.CacheKey("copy/v1", chain(st.layers), fromID, string(argj), dest, strconv.FormatBool(destIsDir), cs.chown, cs.chmod, hash)
	if bd.cachedStep(st, key) {
		return true, nil
	}
	mk := owner{uid: own.uid, gid: own.gid}
	if own.keep {
		mk = owner{}
	}
	l, ok, err := bd.b.AddLayer(ctx, func(ctx context.Context, dst string) error {
		var metas []dirMeta
		for _, s := range srcs {
			if err := ctx.Err(); err != nil {
				return err
			}
			if s.fi.IsDir() {
				if _, err := ensureDirs(dst, view, dest, mk, &metas); err != nil {
					return err
				}
				if err := copyInto(ctx, s.path, filepath.Join(dst, dest), own, mode); err != nil {
					return err
				}
				continue
			}
			target := dest
			if destIsDir {
				target = path.Join(dest, filepath.Base(s.path))
			}
			if _, err := ensureDirs(dst, view, path.Dir(target), mk, &metas); err != nil {
				return err
			}
			if err := copyEntry(s.path, filepath.Join(dst, target), s.fi, own, mode); err != nil {
				return err
			}
		}
		return applyDirMetas(metas)
	})
	if err != nil {
		return false, err
	}
	bd.addResult(st, key, l, ok)
	return false, nil
}

func isGlob(s string) bool { return strings.ContainsAny(s, "*?[") }

// resolveSources finds each source under root (symlinks resolved inside
// root); in a build context a path that leaves it is refused.
func resolveSources(root string, args []string, isContext, add bool) ([]source, error) {
	var out []source
	where := "the build context"
	if !isContext {
		where = "the source stage"
	}
	for _, a := range args {
		clean := path.Clean(a)
		if isContext && (clean == ".." || strings.HasPrefix(clean, "../")) {
			return nil, errdefs.Invalid("dockerfile", "%s is outside the build context; COPY and ADD read only files under the context directory (move the file into it)", a)
		}
		rel := strings.TrimPrefix(clean, "/")
		if rel == "" {
			rel = "."
		}
		var paths []string
		if isGlob(rel) {
			ms, err := filepath.Glob(filepath.Join(root, rel))
			if err != nil {
				return nil, errdefs.Invalid("dockerfile", "%s is not a valid pattern: %v", a, err)
			}
			for _, m := range ms {
				r, _ := filepath.Rel(root, m)
				p, err := securejoin.SecureJoin(root, r)
				if err != nil {
					return nil, fmt.Errorf("resolve %s: %w", a, err)
				}
				paths = append(paths, p)
			}
			if len(paths) == 0 {
				return nil, errdefs.Invalid("dockerfile", "%s matches no file in %s", a, where)
			}
		} else {
			p, err := securejoin.SecureJoin(root, rel)
			if err != nil {
				return nil, fmt.Errorf("resolve %s: %w", a, err)
			}
			paths = []string{p}
		}
		for _, p := range paths {
			fi, err := os.Lstat(p)
			if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
				return nil, errdefs.Invalid("dockerfile", "%s: no such file or directory in %s", a, where)
			} else if err != nil {
				return nil, fmt.Errorf("read %s: %w", a, err)
			}
			if add && fi.Mode().IsRegular() && isArchive(p) {
				return nil, errdefs.Invalid("dockerfile", "ADD %s: unpacking archives is not supported; COPY it and RUN tar -xf in a later step", a)
			}
			out = append(out, source{arg: a, path: p, fi: fi})
		}
	}
	return out, nil
}

func isArchive(p string) bool {
	for _, s := range []string{".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst"} {
		if strings.HasSuffix(p, s) {
			return true
		}
	}
	return false
}

// hashSources digests the sources' names, modes, sizes, contents and link
// targets (owners too when they are kept): the content a COPY reads.
func hashSources(srcs []source, owners bool) (string, error) {
	h := sha256.New()
	for _, s := range srcs {
		fmt.Fprintf(h, "src %q\n", s.arg)
		err := filepath.WalkDir(s.path, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			fi, err := d.Info()
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(s.path, p)
			fmt.Fprintf(h, "%q %o %d", rel, fi.Mode(), fi.Size())
			if owners {
				st := fi.Sys().(*syscall.Stat_t)
				fmt.Fprintf(h, " %d:%d", st.Uid, st.Gid)
			}
			switch {
			case fi.Mode()&fs.ModeSymlink != 0:
				t, err := os.Readlink(p)
				if err != nil {
					return err
				}
				fmt.Fprintf(h, " -> %q", t)
			case fi.Mode().IsRegular():
				f, err := os.Open(p)
				if err != nil {
					return err
				}
				fh := sha256.New()
				_, err = io.Copy(fh, f)
				f.Close()
				if err != nil {
					return err
				}
				fmt.Fprintf(h, " %x", fh.Sum(nil))
			}
			h.Write([]byte{'\n'})
			return nil
		})
		if err != nil {
			return "", fmt.Errorf("hash %s: %w", s.arg, err)
		}
	}
	return fmt.Sprintf("%x", h.Sum(nil)), nil
}

// copyInto copies the contents of directory src into dir (made already).
func copyInto(ctx context.Context, src, dir string, own owner, mode *os.FileMode) error {
	var metas []dirMeta
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if rel == "." {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		target := filepath.Join(dir, rel)
		if fi.IsDir() {
			if old, err := os.Lstat(target); err == nil && old.IsDir() {
				return nil
			}
			if err := os.Mkdir(target, 0o700); err != nil {
				return fmt.Errorf("copy %s: %w", rel, err)
			}
			uid, gid := ownerOf(fi, own)
			metas = append(metas, dirMeta{path: target, mode: pickMode(fi, mode), uid: uid, gid: gid, fi: fi})
			return nil
		}
		return copyEntry(p, target, fi, own, mode)
	})
	if err != nil {
		return err
	}
	return applyDirMetas(metas)
}

func ownerOf(fi fs.FileInfo, own owner) (int, int) {
	if own.keep {
		st := fi.Sys().(*syscall.Stat_t)
		return int(st.Uid), int(st.Gid)
	}
	return own.uid, own.gid
}

func pickMode(fi fs.FileInfo, mode *os.FileMode) os.FileMode {
	if mode != nil {
		return *mode
	}
	return fi.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
}

// copyEntry copies one file, symlink or (empty) directory to target;
// device files, fifos and sockets are skipped.
func copyEntry(src, target string, fi fs.FileInfo, own owner, mode *os.FileMode) error {
	uid, gid := ownerOf(fi, own)
	_ = os.RemoveAll(target) // a later source replaces an earlier one
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		t, err := os.Readlink(src)
		if err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		if err := os.Symlink(t, target); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		return os.Lchown(target, uid, gid)
	case fi.IsDir():
		if err := os.Mkdir(target, 0o700); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		if err := copyInto(context.Background(), src, target, own, mode); err != nil {
			return err
		}
	case fi.Mode().IsRegular():
		in, err := os.Open(src)
		if err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		defer in.Close()
		out, err := os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		_, err = io.Copy(out, in)
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
	default:
		return nil
	}
	if err := os.Lchown(target, uid, gid); err != nil {
		return fmt.Errorf("own %s: %w", target, err)
	}
	if err := os.Chmod(target, pickMode(fi, mode)); err != nil {
		return fmt.Errorf("chmod %s: %w", target, err)
	}
	return os.Chtimes(target, fi.ModTime(), fi.ModTime())
}

// parseChown reads --chown=USER[:GROUP], by number or by name from the
// image's /etc/passwd and /etc/group.
func parseChown(view, spec string) (owner, error) {
	u, g, hasG := strings.Cut(spec, ":")
	uid, ugid, err := lookupID(view, "etc/passwd", u, true)
	if err != nil {
		return owner{}, err
	}
	gid := ugid
	if hasG {
		if gid, _, err = lookupID(view, "etc/group", g, false); err != nil {
			return owner{}, err
		}
	}
	return owner{uid: uid, gid: gid}, nil
}

// lookupID resolves a user (with its primary group) or group name.
func lookupID(view, file, name string, user bool) (int, int, error) {
	if n, err := strconv.Atoi(name); err == nil && n >= 0 {
		return n, n, nil
	}
	if name == "root" {
		return 0, 0, nil
	}
	p, err := securejoin.SecureJoin(view, file)
	var f *os.File
	if err == nil {
		f, err = os.Open(p)
	}
	if err == nil {
		defer f.Close()
		sc := bufio.NewScanner(io.LimitReader(f, 1<<20))
		for sc.Scan() {
			fs := strings.Split(sc.Text(), ":")
			if len(fs) < 3 || fs[0] != name {
				continue
			}
			id, err := strconv.Atoi(fs[2])
			if err != nil {
				break
			}
			gid := id
			if user && len(fs) > 3 {
				if g, err := strconv.Atoi(fs[3]); err == nil {
					gid = g
				}
			}
			return id, gid, nil
		}
	}
	return 0, 0, errdefs.Invalid("dockerfile", "--chown: %q is not in the image's /%s; use a number or a name the image has", name, file)
}
