package node

import (
	"io/fs"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// isWhiteoutInfo reports whether fi is an overlayfs whiteout (a 0/0
// character device).
func isWhiteoutInfo(fi fs.FileInfo) bool {
	if fi.Mode()&fs.ModeCharDevice == 0 || fi.Mode()&fs.ModeDevice == 0 {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && st.Rdev == 0
}

// opaqueParent reports whether a directory above rel in layer dir is
// opaque (trusted.overlay.opaque=y): lower layers' entries there are
// hidden.
func opaqueParent(dir, rel string) bool {
	buf := make([]byte, 1)
	for p := filepath.Dir(rel); p != "." && p != "/"; p = filepath.Dir(p) {
		if n, err := unix.Lgetxattr(filepath.Join(dir, p), "trusted.overlay.opaque", buf); err == nil && n == 1 && buf[0] == 'y' {
			return true
		}
	}
	return false
}
