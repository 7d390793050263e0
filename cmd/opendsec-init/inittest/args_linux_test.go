package inittest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/testutil"
)

// TestBadArgs: every bad command line stops init at once with status 2, an
// error naming the argument, and the usage; nothing is made (no socket).
func TestBadArgs(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "a.sock")
	for _, tc := range []struct {
		args []string
		want string // in the error
	}{
		{[]string{"--", "/agent"}, "--listen: missing"},
		{[]string{"--listen", "rel.sock", "--", "/agent"}, "not absolute"},
		{[]string{"--listen", sock}, "server: missing"},
		{[]string{"--listen", sock, "--"}, "server: missing"},
		{[]string{"--listen", sock, "--", ""}, "server: missing"},
		{[]string{"--listen"}, "--listen needs a value"},
		{[]string{"--seccomp-filter", "", "--listen", sock, "--", "/x"}, "--seccomp-filter needs a value"},
		{[]string{"--bogus", "--listen", sock, "--", "/x"}, "unknown argument --bogus"},
		{[]string{"--listen-fd", "x", "--", "/x"}, "not a file descriptor number"},
		{[]string{"--listen-fd", "3x", "--", "/x"}, "not a file descriptor number"},
		{[]string{"--listen-fd", "3", "--env-file", "", "--", "/x"}, "--env-file needs a value"},
		{[]string{"--listen-fd", "2", "--", "/x"}, "not a file descriptor number"},
		{[]string{"--listen-fd", "99999999999", "--", "/x"}, "not a file descriptor number"},
		{[]string{"--listen-fd", "3", "--listen", sock, "--", "/x"}, "not both"},
		{[]string{"--listen-fd", "3", "--own-env", "GOMAXPROCS=1", "--", "/x"}, "unknown argument --own-env"},
		{[]string{"--help"}, "help requested"},
	} {
		out, err := exec.Command(testutil.InitBinary(t), tc.args...).CombinedOutput()
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), tc.want) || !strings.Contains(string(out), "usage: opendsec-init") {
			t.Errorf("init %q: %v, %q; want status 2 with %q and the usage", tc.args, err, out, tc.want)
		}
	}
	if ents, _ := filepath.Glob(filepath.Join(dir, "*")); len(ents) != 0 {
		t.Errorf("bad command lines left %v", ents)
	}
}

// TestSeccompFilterRefused: a filter file that is missing or not whole
// BPF instructions stops init before it listens, naming the file.
func TestSeccompFilterRefused(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "a.sock")
	odd := filepath.Join(dir, "odd.bpf")
	if err := writeFile(odd, "1234567"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ file, want string }{
		{filepath.Join(dir, "none.bpf"), "read seccomp filter: open " + filepath.Join(dir, "none.bpf") + ": no such file or directory"},
		{odd, "seccomp filter " + odd + ": 7 bytes is not 1 to 4096 8-byte instructions"},
	} {
		out, err := exec.Command(testutil.InitBinary(t), "--seccomp-filter", tc.file, "--listen", sock, "--", "/bin/true").CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(string(out), tc.want) {
			t.Errorf("filter %s: %v, %q; want status 1 with %q", tc.file, err, out, tc.want)
		}
		if listening(sock) {
			t.Errorf("filter %s: init listened before its filter", tc.file)
		}
	}
}

func writeFile(path, data string) error { return os.WriteFile(path, []byte(data), 0o644) }
