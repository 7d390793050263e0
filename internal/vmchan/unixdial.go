package vmchan

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	goruntime "runtime"
)

// maxSunPath is the longest unix socket path connect(2) takes (sun_path
// holds 108 bytes with its NUL).
const maxSunPath = 107

// DialUnix connects to the unix socket at path, whatever its length: a
// path longer than sun_path is reached on Linux through /proc/self/fd/<n>
// of its directory (a sandbox's StateDir may be long).
func DialUnix(ctx context.Context, path string) (net.Conn, error) {
	var d net.Dialer
	if len(path) <= maxSunPath || goruntime.GOOS != "linux" {
		return d.DialContext(ctx, "unix", path)
	}
	dir, err := os.Open(filepath.Dir(path))
	if err != nil {
		return nil, err
	}
	defer func() { _ = dir.Close() }()
	return d.DialContext(ctx, "unix", fmt.Sprintf("/proc/self/fd/%d/%s", dir.Fd(), filepath.Base(path)))
}
