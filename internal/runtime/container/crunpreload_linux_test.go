package container

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// crun gets the libsystemd without systemd only where it links libsystemd,
// the file is root's alone, and it defines every symbol crun takes.
func TestCrunPreloadChoice(t *testing.T) {
	testutil.RequiresRoot(t) // the file's owner must be root
	crun, err := exec.LookPath("crun")
	if err != nil {
		t.Skip("crun is not installed")
	}
	lib := filepath.Join(filepath.Dir(testutil.AgentBinary(t)), CrunLibsystemdName)
	needs, err := libsystemdImports(crun)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cp := func(src, name string, mode os.FileMode) string {
		t.Helper()
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if got, err := crunPreload(crun, filepath.Join(dir, "none.so")); got != "" || err != nil {
		t.Fatalf("no file: %q, %v; want nothing and no error", got, err)
	}
	// A binary that does not link libsystemd: nothing to preload.
	if got, err := crunPreload("/bin/true", lib); got != "" || err != nil {
		t.Fatalf("/bin/true: %q, %v; want nothing and no error", got, err)
	}
	if got, err := crunPreload(crun, cp(lib, "writable.so", 0o666)); got != "" || err == nil {
		t.Fatalf("a file others can write: %q, %v; want it refused", got, err)
	}
	if len(needs) == 0 {
		t.Skipf("this crun (%s) does not link libsystemd", crun)
	}
	// A library that defines none of crun's libsystemd symbols.
	if got, err := crunPreload(crun, cp("/bin/true", "other.so", 0o755)); got != "" || err == nil || !strings.Contains(err.Error(), "does not define") {
		t.Fatalf("a library without crun's symbols: %q, %v; want it refused naming the symbol", got, err)
	}
	good := cp(lib, "good.so", 0o755)
	if got, err := crunPreload(crun, good); got != good || err != nil {
		t.Fatalf("the built stub: %q, %v; want it preloaded (crun imports %v)", got, err, needs)
	}
}

// The node's crun runs with the stub in place of Debian's libsystemd (and
// its five libraries) and with nothing of the node's environment.
func TestCrunRunsWithoutLibsystemd(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	r := rt.(*Runtime)
	if r.oci.kind != OCIRuntimeCrun {
		t.Skipf("the OCI runtime is %s", r.oci.kind)
	}
	needs, err := libsystemdImports(r.oci.path)
	if err != nil {
		t.Fatal(err)
	}
	if len(needs) == 0 {
		t.Skipf("%s does not link libsystemd", r.oci.path)
	}
	want, err := filepath.EvalSymlinks(filepath.Join(filepath.Dir(r.cfg.AgentPath), CrunLibsystemdName))
	if err != nil {
		t.Fatal(err)
	}
	if r.oci.preload == "" && r.oci.preloadErr != nil && strings.Contains(r.oci.preloadErr.Error(), "does not define") {
		t.Skipf("this crun needs more of libsystemd than the stub has: %v", r.oci.preloadErr)
	}
	if r.oci.preload != want {
		t.Fatalf("crun preloads %q (%v), want %s (built beside the agent)", r.oci.preload, r.oci.preloadErr, want)
	}
	cmd := r.oci.command(t.Context(), "--root", t.TempDir(), "list")
	cmd.Env = append(cmd.Env, "LD_DEBUG=files")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("crun list: %v: %s", err, stderr.String())
	}
	loaded := stderr.String()
	if !strings.Contains(loaded, want) {
		t.Fatalf("crun did not load %s:\n%s", want, loaded)
	}
	for _, lib := range []string{"libsystemd.so.0", "libgcrypt", "liblzma", "libzstd", "liblz4", "libgpg-error"} {
		if strings.Contains(loaded, "file="+lib) {
			t.Fatalf("crun loaded %s with the stub preloaded:\n%s", lib, loaded)
		}
	}
	if !strings.Contains(loaded, "file=libc.so.6") {
		t.Fatalf("LD_DEBUG=files names no library crun loaded (libc.so.6):\n%s", loaded)
	}
	// Nothing of the node's environment reaches crun.
	t.Setenv("NOTIFY_SOCKET", "/run/systemd/notify")
	t.Setenv("LISTEN_FDS", "1")
	cmd = r.oci.command(t.Context(), "--version")
	if cmd.Env == nil {
		t.Fatal("crun runs with the node's environment")
	}
	for _, kv := range cmd.Env {
		if !strings.HasPrefix(kv, "PATH=") && kv != "LD_PRELOAD="+want {
			t.Fatalf("crun's environment has %q: %q", kv, cmd.Env)
		}
	}
	// A sandbox starts with it.
	runtimetest.StartSandbox(t, rt, tmpl)
}
