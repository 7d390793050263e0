package agent

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// DefaultReservedPaths are the sandbox paths that belong to the agent: its
// binaries, init, the seccomp filter and the interpreter runner under
// /.opendsec, and /run/opendsec, which holds the socket the node reaches
// the agent on. The file API never changes them (see reservedPaths).
var DefaultReservedPaths = []string{"/.opendsec", "/run/opendsec"}

// reservedPaths is the set of paths the file API refuses to change: every
// root and everything inside it.
type reservedPaths struct {
	roots []string // cleaned; each also with its symlinks resolved
}

func newReservedPaths(paths ...string) reservedPaths {
	var r reservedPaths
	add := func(p string) {
		for _, q := range r.roots {
			if q == p {
				return
			}
		}
		r.roots = append(r.roots, p)
	}
	for _, p := range paths {
		if p == "" || !filepath.IsAbs(p) {
			continue
		}
		p = filepath.Clean(p)
		add(p)
		add(resolveDir(p))
	}
	return r
}

// reservedPath reports whether p (absolute, cleaned) is a reserved root
// or inside one.
func (r reservedPaths) reservedPath(p string) (root string, ok bool) {
	for _, q := range r.roots {
		if p == q || strings.HasPrefix(p, q+"/") {
			return q, true
		}
	}
	return "", false
}

// holdsReserved reports whether the directory p (absolute, cleaned) has a
// reserved root below it, so removing or moving p would take it along.
func (r reservedPaths) holdsReserved(p string) (root string, ok bool) {
	for _, q := range r.roots {
		if p == "/" || strings.HasPrefix(q, p+"/") {
			return q, true
		}
	}
	return "", false
}

// check refuses a change (op, e.g. "write") of the path p the caller
// named (absolute, cleaned), judged on p as named and on p as the kernel
// will resolve it: a symlink in p's parents cannot reach a reserved path
// another way. With subtree, p may also not hold a reserved path (remove,
// move).
func (r reservedPaths) check(op, p string, subtree bool) error {
	real := realPath(p)
	for _, c := range []string{p, real} {
		via := ""
		if c != p {
			via = " (it resolves to '" + c + "')"
		}
		if _, ok := r.reservedPath(c); ok {
			return errdefs.New(errdefs.ErrPermissionDenied,
				"%s '%s'%s: permission denied: the path belongs to the sandbox's agent, which the file API does not change; use a path outside %s",
				op, p, via, strings.Join(r.roots, " and "))
		}
		if !subtree {
			continue
		}
		if root, ok := r.holdsReserved(c); ok {
			return errdefs.New(errdefs.ErrPermissionDenied,
				"%s '%s'%s: permission denied: it holds '%s', which belongs to the sandbox's agent; name a path that does not hold it",
				op, p, via, root)
		}
	}
	return nil
}

// realPath resolves the absolute, cleaned path p as the kernel will for an
// operation on p itself (rename, unlink, mkdir, which do not follow p's last
// component): every symlink in p's parents is followed, dangling ones
// included, and what does not exist is kept as named.
func realPath(p string) string {
	if p == "/" {
		return p
	}
	return filepath.Join(resolveDir(filepath.Dir(p)), filepath.Base(p))
}

// resolveDir follows every symlink in the absolute path d.
func resolveDir(d string) string {
	out := "/"
	todo := strings.Split(d, "/")
	for links := 0; len(todo) > 0; {
		c := todo[0]
		todo = todo[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			out = filepath.Dir(out)
			continue
		}
		next := filepath.Join(out, c)
		st, err := os.Lstat(next)
		if err != nil || st.Mode()&fs.ModeSymlink == 0 || links >= 255 {
			out = next
			continue
		}
		l, err := os.Readlink(next)
		if err != nil {
			out = next
			continue
		}
		links++
		if filepath.IsAbs(l) {
			out = "/"
		}
		todo = append(strings.Split(l, "/"), todo...)
	}
	return out
}
