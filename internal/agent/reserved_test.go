package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// TestSecurityAgentPathsDefaults: with the default roots, every change at,
// inside or (for remove and move) above /.opendsec and /run/opendsec is
// refused as permission denied naming the path; neighbours are not.
func TestSecurityAgentPathsDefaults(t *testing.T) {
	r := newReservedPaths(DefaultReservedPaths...)
	for _, c := range []struct {
		op      string
		p       string
		subtree bool
		denied  bool
	}{
		{"write", "/run/opendsec/agent.sock", false, true},
		{"write", "/run/opendsec/agent.env", false, true},
		{"write", "/.opendsec/agent", false, true},
		{"write", "/.opendsec/init", false, true},
		{"write", "/.opendsec/seccomp.bpf", false, true},
		{"write", "/.opendsec/interpreter.py", false, true},
		{"make directory", "/run/opendsec/x/y", false, true},
		{"make directory", "/.opendsec", false, true},
		{"move", "/run/opendsec", true, true},
		{"remove", "/run", true, true},
		{"remove", "/", true, true},
		{"remove", "/.opendsec/agent", true, true},
		{"write", "/run/opendsecx", false, false},
		{"write", "/.opendsecrc", false, false},
		{"remove", "/run/other", true, false},
		{"remove", "/home/user", true, false},
		{"make directory", "/run", false, false},
	} {
		err := r.check(c.op, c.p, c.subtree)
		if !c.denied {
			if err != nil {
				t.Errorf("%s %s: %v, want allowed", c.op, c.p, err)
			}
			continue
		}
		if !errors.Is(err, errdefs.ErrPermissionDenied) {
			t.Errorf("%s %s: %v, want permission denied", c.op, c.p, err)
			continue
		}
		if msg := err.Error(); !strings.Contains(msg, "'"+c.p+"'") || !strings.Contains(msg, "belongs to the sandbox's agent") {
			t.Errorf("%s %s: message %q does not name the path and its owner", c.op, c.p, msg)
		}
	}
}

// TestSecurityAgentPathsRealPath: realPath follows symlinks in the parents
// (dangling ones too) but not the last component.
func TestSecurityAgentPathsRealPath(t *testing.T) {
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	res := filepath.Join(dir, "run", "opendsec")
	if err := os.MkdirAll(res, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{
		"abs":  res,
		"rel":  "../run/opendsec",
		"up":   "..",
		"dang": filepath.Join(res, "missing"),
		"last": filepath.Join(res, "agent.sock"),
	} {
		if err := os.MkdirAll(filepath.Join(dir, "home"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, filepath.Join(dir, "home", name)); err != nil {
			t.Fatal(err)
		}
	}
	h := filepath.Join(dir, "home")
	for in, want := range map[string]string{
		h + "/abs/agent.sock":             res + "/agent.sock",
		h + "/rel/agent.sock":             res + "/agent.sock",
		h + "/up/run/opendsec/agent.sock": res + "/agent.sock",
		h + "/dang/x/y":                   res + "/missing/x/y",
		h + "/last":                       h + "/last",
		h + "/missing/x":                  h + "/missing/x",
		"/":                               "/",
	} {
		if got := realPath(in); got != want {
			t.Errorf("realPath(%s) = %s, want %s", in, got, want)
		}
	}
}
