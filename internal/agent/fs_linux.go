package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
	"github.com/kernflux/opendsec/api/gen/filesystem/filesystemconnect"
	"github.com/kernflux/opendsec/internal/errdefs"
)

const xattrPrefix = "user.e2b."

// filesystem is the filesystem.Filesystem service. It acts as root and
// gives what it creates to the requesting user, as envd does.
type filesystem struct {
	cfg      *Config
	reserved reservedPaths
	users    users
	watch    watchers
	uploads  recentUploads
}

var _ filesystemconnect.FilesystemHandler = (*filesystem)(nil)

func newFilesystem(cfg *Config) *filesystem {
	return &filesystem{
		cfg:      cfg,
		reserved: newReservedPaths(append(slices.Clone(cfg.ReservedPaths), cfg.InterpreterPath)...),
		users:    users{dir: cfg.EtcDir},
		watch:    watchers{byID: map[string]*pollWatcher{}},
	}
}

// resolve returns the request's user and the absolute path for p.
func (f *filesystem) resolve(h interface{ Get(string) string }, field, p string) (*user, string, error) {
	usr, err := userFor(f.cfg, f.users, h)
	if err != nil {
		return nil, "", err
	}
	abs, err := resolvePath(field, p, usr.Home)
	if err != nil {
		return nil, "", err
	}
	return usr, abs, nil
}

func notExist(p string) error {
	return errdefs.New(errdefs.ErrNotFound, "path '%s' does not exist", p)
}

// fsErr categorizes an OS error about path p.
func fsErr(op, p string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return notExist(p)
	case errors.Is(err, fs.ErrPermission):
		return errdefs.New(errdefs.ErrPermissionDenied, "%s '%s': permission denied", op, p)
	case errors.Is(err, unix.ENOTDIR):
		return errdefs.Invalid("path", "a parent of '%s' is not a directory", p)
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT):
		return errdefs.New(errdefs.ErrResourceExhausted, "%s '%s': not enough disk space", op, p)
	}
	return fmt.Errorf("%s '%s': %w", op, p, err)
}

// entry describes p as envd does: lstat, but a symlink reports its resolved
// target and the target's type.
func (f *filesystem) entry(p string) (*fspb.EntryInfo, error) {
	st, err := os.Lstat(p)
	if err != nil {
		return nil, fsErr("stat", p, err)
	}
	return f.entryFrom(p, st), nil
}

func (f *filesystem) entryFrom(p string, st fs.FileInfo) *fspb.EntryInfo {
	e := &fspb.EntryInfo{
		Name:         filepath.Base(p),
		Path:         p,
		Size:         st.Size(),
		Mode:         uint32(st.Mode().Perm()),
		Permissions:  st.Mode().String(),
		ModifiedTime: timestamppb.New(st.ModTime()),
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		e.Owner = f.users.userName(sys.Uid)
		e.Group = f.users.groupName(sys.Gid)
	}
	switch {
	case st.Mode()&fs.ModeSymlink != 0:
		target, err := filepath.EvalSymlinks(p)
		if err != nil {
			if l, lerr := os.Readlink(p); lerr == nil {
				if !filepath.IsAbs(l) {
					l = filepath.Join(filepath.Dir(p), l)
				}
				target = filepath.Clean(l)
			}
		} else if tst, err := os.Stat(target); err == nil {
			e.Type = fileType(tst.Mode())
		}
		if target != "" {
			e.SymlinkTarget = &target
		}
	default:
		e.Type = fileType(st.Mode())
	}
	if md := readMetadata(p); len(md) > 0 {
		e.Metadata = md
	}
	return e
}

func fileType(m fs.FileMode) fspb.FileType {
	switch {
	case m.IsDir():
		return fspb.FileType_FILE_TYPE_DIRECTORY
	case m.IsRegular():
		return fspb.FileType_FILE_TYPE_FILE
	case m&fs.ModeSymlink != 0:
		return fspb.FileType_FILE_TYPE_SYMLINK
	}
	return fspb.FileType_FILE_TYPE_UNSPECIFIED
}

// readMetadata returns the user.e2b.* xattrs of p, prefix stripped.
func readMetadata(p string) map[string]string {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if err != nil || n == 0 {
		return nil
	}
	var md map[string]string
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		key, ok := strings.CutPrefix(name, xattrPrefix)
		if !ok || key == "" {
			continue
		}
		val := make([]byte, 4096)
		vn, err := unix.Lgetxattr(p, name, val)
		if err != nil {
			continue
		}
		if md == nil {
			md = map[string]string{}
		}
		md[key] = string(val[:vn])
	}
	return md
}

// mkdirAllAs creates dir and its missing parents (0755, owned by usr) and
// returns the directories it created, outermost first.
func mkdirAllAs(dir string, usr *user) ([]string, error) {
	var missing []string
	for d := dir; ; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err == nil {
			if !st.IsDir() {
				return nil, errdefs.Invalid("path", "'%s' exists and is not a directory", d)
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, fsErr("stat", d, err)
		}
		missing = append(missing, d)
		if d == "/" || d == "." {
			break
		}
	}
	var created []string
	for i := len(missing) - 1; i >= 0; i-- {
		d := missing[i]
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			removeCreated(created)
			return nil, fsErr("make directory", d, err)
		}
		created = append(created, d)
		_ = os.Lchown(d, int(usr.UID), int(usr.GID))
	}
	return created, nil
}

// removeCreated undoes mkdirAllAs (only directories still empty).
func removeCreated(created []string) {
	for i := len(created) - 1; i >= 0; i-- {
		os.Remove(created[i])
	}
}

func (f *filesystem) Stat(ctx context.Context, req *connect.Request[fspb.StatRequest]) (*connect.Response[fspb.StatResponse], error) {
	_, p, err := f.resolve(req.Header(), "path", req.Msg.GetPath())
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	e, err := f.entry(p)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&fspb.StatResponse{Entry: e}), nil
}

func (f *filesystem) MakeDir(ctx context.Context, req *connect.Request[fspb.MakeDirRequest]) (*connect.Response[fspb.MakeDirResponse], error) {
	usr, p, err := f.resolve(req.Header(), "path", req.Msg.GetPath())
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := f.reserved.check("make directory", p, false); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if st, err := os.Stat(p); err == nil {
		if st.IsDir() {
			return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrAlreadyExists, "directory '%s' already exists", p))
		}
		return nil, errdefs.ToConnect(errdefs.Invalid("path", "'%s' exists and is not a directory", p))
	}
	if _, err := mkdirAllAs(p, usr); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	e, err := f.entry(p)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&fspb.MakeDirResponse{Entry: e}), nil
}

func (f *filesystem) Move(ctx context.Context, req *connect.Request[fspb.MoveRequest]) (*connect.Response[fspb.MoveResponse], error) {
	usr, src, err := f.resolve(req.Header(), "source", req.Msg.GetSource())
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	dst, err := resolvePath("destination", req.Msg.GetDestination(), usr.Home)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := f.reserved.check("move", src, true); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := f.reserved.check("move to", dst, true); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if _, err := os.Lstat(src); err != nil {
		return nil, errdefs.ToConnect(fsErr("move", src, err))
	}
	created, err := mkdirAllAs(filepath.Dir(dst), usr)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := os.Rename(src, dst); err != nil {
		if errors.Is(err, unix.EXDEV) {
			err = moveAcross(src, dst)
		}
		if err != nil {
			removeCreated(created)
			return nil, errdefs.ToConnect(fsErr("move", src, err))
		}
	}
	e, err := f.entry(dst)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&fspb.MoveResponse{Entry: e}), nil
}

// moveAcross moves src to dst when rename cannot (EXDEV, e.g. a directory
// from an overlay's lower layer): copy, then remove the source.
func moveAcross(src, dst string) error {
	if err := copyTree(src, dst); err != nil {
		os.RemoveAll(dst)
		return err
	}
	return os.RemoveAll(src)
}

func copyTree(src, dst string) error {
	st, err := os.Lstat(src)
	if err != nil {
		return err
	}
	sys, _ := st.Sys().(*syscall.Stat_t)
	chown := func(p string) {
		if sys != nil {
			_ = os.Lchown(p, int(sys.Uid), int(sys.Gid))
		}
	}
	switch {
	case st.Mode()&fs.ModeSymlink != 0:
		l, err := os.Readlink(src)
		if err != nil {
			return err
		}
		if err := os.Symlink(l, dst); err != nil {
			return err
		}
		chown(dst)
		return nil
	case st.IsDir():
		if err := os.Mkdir(dst, st.Mode().Perm()); err != nil {
			return err
		}
		chown(dst)
		ents, err := os.ReadDir(src)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if err := copyTree(filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())); err != nil {
				return err
			}
		}
		return nil
	case st.Mode().IsRegular():
		in, err := os.Open(src)
		if err != nil {
			return err
		}
		defer in.Close()
		out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, st.Mode().Perm())
		if err != nil {
			return err
		}
		if _, err := io.Copy(out, in); err != nil {
			out.Close()
			return err
		}
		chown(dst)
		return out.Close()
	}
	return fmt.Errorf("copy '%s': unsupported file type %s", src, st.Mode().Type())
}

func (f *filesystem) ListDir(ctx context.Context, req *connect.Request[fspb.ListDirRequest]) (*connect.Response[fspb.ListDirResponse], error) {
	_, p, err := f.resolve(req.Header(), "path", req.Msg.GetPath())
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	depth := int(req.Msg.GetDepth())
	if depth == 0 {
		depth = 1
	}
	dir, err := filepath.EvalSymlinks(p)
	if err != nil {
		return nil, errdefs.ToConnect(fsErr("list", p, err))
	}
	st, err := os.Stat(dir)
	if err != nil {
		return nil, errdefs.ToConnect(fsErr("list", p, err))
	}
	if !st.IsDir() {
		return nil, errdefs.ToConnect(errdefs.Invalid("path", "'%s' is not a directory", p))
	}
	resp := &fspb.ListDirResponse{}
	if err := f.list(ctx, dir, depth, &resp.Entries); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(resp), nil
}

func (f *filesystem) list(ctx context.Context, dir string, depth int, out *[]*fspb.EntryInfo) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fsErr("list", dir, err)
	}
	for _, de := range ents {
		p := filepath.Join(dir, de.Name())
		st, err := de.Info()
		if err != nil {
			continue // removed meanwhile
		}
		*out = append(*out, f.entryFrom(p, st))
		if depth > 1 && de.IsDir() {
			if err := f.list(ctx, p, depth-1, out); err != nil && !errdefs.IsNotFound(err) {
				return err
			}
		}
	}
	return nil
}

func (f *filesystem) Remove(ctx context.Context, req *connect.Request[fspb.RemoveRequest]) (*connect.Response[fspb.RemoveResponse], error) {
	_, p, err := f.resolve(req.Header(), "path", req.Msg.GetPath())
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if p == "/" {
		return nil, errdefs.ToConnect(errdefs.Invalid("path", "refusing to remove '/'; name what to remove"))
	}
	if err := f.reserved.check("remove", p, true); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := os.RemoveAll(p); err != nil {
		return nil, errdefs.ToConnect(fsErr("remove", p, err))
	}
	return connect.NewResponse(&fspb.RemoveResponse{}), nil
}
