package container

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// mountsAt counts the mounts at path in the process's mount namespace.
func mountsAt(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && unescapeMountPoint(f[4]) == path {
			n++
		}
	}
	return n
}

// TestStateRootTmpfs: the default state root (tmpfsStateRoot) on disk, and
// the intent dir next to it, each get a tmpfs of mode 0700 capped at stateRootTmpfsSize, in which the
// OCI runtime keeps its containers' state; a restarted node reuses that
// mount (no second one) and recovers, stops and deletes the sandbox made
// before; a state root on disk that holds state already is left as it
// is.
func TestStateRootTmpfs(t *testing.T) {
	var roots []string
	var root string
	f := newFactoryWith(t, func(c *Config) {
		root = c.StateRoot
		c.tmpfsStateRoot = true
		roots = append(roots, root)
	})
	// After newFactoryWith's: runs before its temp dir is removed.
	t.Cleanup(func() {
		for _, r := range roots {
			for _, p := range []string{r, r + ".intents"} {
				for mountsAt(t, p) > 0 {
					if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
						t.Errorf("unmount %s: %v", p, err)
						break
					}
				}
			}
		}
	})
	rt1, tmpl := f(t)
	var fs unix.Statfs_t
	if err := unix.Statfs(root, &fs); err != nil || fs.Type != unix.TMPFS_MAGIC {
		t.Fatalf("state root %s: file system %#x, %v; want a tmpfs (%s)", root, fs.Type, err, rt1.(*Runtime).stateRootFS)
	}
	if fs.Blocks*uint64(fs.Bsize) != stateRootTmpfsSize {
		t.Fatalf("state root tmpfs holds %d bytes; want %d", fs.Blocks*uint64(fs.Bsize), stateRootTmpfsSize)
	}
	if st, err := os.Stat(root); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("state root mode: %v %v; want 0700", st.Mode(), err)
	}
	// Create's intents, next to the state root, are in memory too.
	intents := root + ".intents"
	if err := unix.Statfs(intents, &fs); err != nil || fs.Type != unix.TMPFS_MAGIC {
		t.Fatalf("intent dir %s: file system %#x, %v; want a tmpfs (%s)", intents, fs.Type, err, rt1.(*Runtime).stateRootFS)
	}
	sb, h := runtimetest.StartSandbox(t, rt1, tmpl)
	kind := rt1.(*Runtime).oci.kind
	if _, err := os.Stat(filepath.Join(root, sb.ID, stateFileOf(kind))); err != nil {
		t.Fatalf("%s's state of the sandbox is not in the state root: %v", kind, err)
	}

	rt2, _ := f(t) // the node restarts
	if got := rt2.(*Runtime).stateRootFS; !strings.Contains(got, "already") || mountsAt(t, root) != 1 || mountsAt(t, intents) != 1 {
		t.Fatalf("restarted node: %q, %d mounts at %s; want the one tmpfs reused", got, mountsAt(t, root), root)
	}
	ctx := t.Context()
	if err := rt2.Recover(ctx, h); err != nil {
		t.Fatal(err)
	}
	if st, err := rt2.Status(ctx, sb.ID); err != nil || st.State != runtime.StateRunning {
		t.Fatalf("recovered sandbox: %+v %v; want running", st, err)
	}
	if err := rt2.Stop(ctx, sb.ID, runtimetest.StopOptions()); err != nil {
		t.Fatal(err)
	}
	if err := rt2.Delete(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, sb.ID)); !os.IsNotExist(err) {
		t.Fatalf("state dir after delete: %v; want it gone", err)
	}

	// A state root on disk that holds a container's state (a node from
	// before): mounting over it would hide that container.
	old := filepath.Join(t.TempDir(), "runc")
	if err := os.MkdirAll(filepath.Join(old, "sandbox-from-before"), 0o700); err != nil {
		t.Fatal(err)
	}
	roots = append(roots, old)
	got, err := stateRootTmpfs(old)
	if err != nil || !strings.HasPrefix(got, "on disk") || mountsAt(t, old) != 0 {
		t.Fatalf("state root with state on disk: %q, %v, %d mounts; want it left on disk", got, err, mountsAt(t, old))
	}
}
