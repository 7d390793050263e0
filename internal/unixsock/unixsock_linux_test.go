package unixsock

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestListenAt: a socket in a directory whose path is longer than
// sun_path accepts connections, is 0600, and replaces a stale socket of
// the same name; a name that is a directory is an error.
func TestListenAt(t *testing.T) {
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 100), strings.Repeat("e", 100))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	dfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Close(dfd) }()
	for range 2 { // the second replaces the first's socket file
		f, err := ListenAt(dfd, "agent.sock", 8)
		if err != nil {
			t.Fatal(err)
		}
		l, err := net.FileListener(f)
		_ = f.Close()
		if err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(filepath.Join(dir, "agent.sock"))
		if err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
			t.Fatalf("socket file: %v, %v; want a socket, mode 0600", fi.Mode(), err)
		}
		// Dial through the directory's fd too: the full path is too long.
		c, err := net.Dial("unix", filepath.Join("/proc/self/fd", strconv.Itoa(dfd), "agent.sock"))
		if err != nil {
			t.Fatal(err)
		}
		a, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Close(), a.Close()
		_ = l.Close()
	}
	if err := os.Mkdir(filepath.Join(dir, "taken"), 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := ListenAt(dfd, "taken", 8); err == nil || !strings.Contains(err.Error(), "remove stale socket") {
		t.Fatalf("ListenAt over a directory: %v; want the stale socket's removal refused", err)
	}
}
