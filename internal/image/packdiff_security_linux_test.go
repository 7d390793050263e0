package image

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/testutil"
)

// grepStore fails the test if any regular file in the store's layers holds
// needle (a plain directory layer or an EROFS file: both keep file content
// uncompressed).
func grepStore(t *testing.T, s *Store, needle string) {
	t.Helper()
	err := filepath.Walk(s.path("layers"), func(p string, fi os.FileInfo, err error) error {
		if err != nil || !fi.Mode().IsRegular() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if strings.Contains(string(b), needle) {
			t.Errorf("store file %s holds %q: a host file was packed", p, needle)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestPackDiffScrubDoesNotFollowSymlinks is the reviewer's scenario: in the
// sandbox `rm -rf /home; ln -s HOSTDIR /home`, then pack_diff with
// scrub_paths ["/home/.cache"]. The host directory must survive, and the
// packed image holds /home as the symlink, with no .cache anywhere.
func TestPackDiffScrubDoesNotFollowSymlinks(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	s := newStore(t)
	importTree(t, s, "base", map[string]string{"etc/keep": "keep", "home/user/.profile": "p"})
	host := t.TempDir() // stands for /var/lib/opendsec: outside the upper
	writeFile(t, filepath.Join(host, ".cache", "precious"), "host data", 0o600)

	root, upper := sandboxRoot(t, s, "base", "sbxevil")
	if err := os.RemoveAll(filepath.Join(root, "home")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(host, filepath.Join(root, "home")); err != nil {
		t.Fatal(err)
	}
	// A real directory to scrub too, next to the trap.
	writeFile(t, filepath.Join(root, "root", ".cache", "token"), "secret", 0o600)

	img, err := s.PackDiff(ctx, PackDiffRequest{Holder: "sbxevil", Upper: upper, Name: "packed", ScrubPaths: []string{"/home/.cache", "/root/.cache"}})
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(host, ".cache", "precious")); err != nil || string(b) != "host data" {
		t.Fatalf("host file after pack_diff: %q, %v: scrub_paths followed the sandbox's symlink onto the host", b, err)
	}
	if len(img.Layers) != 2 {
		t.Fatalf("packed image has %d layers, want 2", len(img.Layers))
	}
	ri, err := s.Hold(ctx, "packed", "sbxcheck")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Release(t.Context(), "sbxcheck") })
	top := heldDirs(t, ri, "sbxcheck")[0]
	if dest, err := os.Readlink(filepath.Join(top, "home")); err != nil || dest != host {
		t.Fatalf("home in the packed layer: %q, %v; want the symlink to %s", dest, err, host)
	}
	if _, err := os.Lstat(filepath.Join(top, "root", ".cache")); !os.IsNotExist(err) {
		t.Fatalf("root/.cache in the packed layer: %v, want it scrubbed", err)
	}
	if _, err := os.Lstat(filepath.Join(top, "root")); err != nil {
		t.Fatalf("root/ (the scrubbed path's parent) missing from the packed layer: %v", err)
	}
	grepStore(t, s, "secret")
}

// TestPackDiffNeverTraversesSymlinks packs an upper where a directory is a
// symlink to / (packed as the symlink), and one where a directory is
// swapped for a symlink to a host directory while the walk is between
// reading the entry and opening it: the walk must fail or pack the link,
// never read the host directory into the store.
func TestPackDiffNeverTraversesSymlinks(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	s := newStore(t)
	importTree(t, s, "base", map[string]string{"etc/keep": "keep"})

	_, upper := sandboxRoot(t, s, "base", "sbxroot")
	if err := os.Symlink("/", filepath.Join(upper, "escape")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.PackDiff(ctx, PackDiffRequest{Holder: "sbxroot", Upper: upper, Name: "rootlink"}); err != nil {
		t.Fatal(err)
	}
	ri, err := s.Hold(ctx, "rootlink", "chk1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Release(t.Context(), "chk1") })
	if dest, err := os.Readlink(filepath.Join(heldDirs(t, ri, "chk1")[0], "escape")); err != nil || dest != "/" {
		t.Fatalf("escape in the packed layer: %q, %v; want the symlink to /", dest, err)
	}
	if ents, _ := os.ReadDir(heldDirs(t, ri, "chk1")[0]); len(ents) != 1 {
		t.Fatalf("packed layer holds %d entries, want only the symlink", len(ents))
	}

	host := t.TempDir()
	writeFile(t, filepath.Join(host, "shadow"), "host-secret-bytes", 0o600)
	_, upper2 := sandboxRoot(t, s, "base", "sbxrace")
	writeFile(t, filepath.Join(upper2, "a", "file"), "innocent", 0o644)
	swapped := false
	packWalkHook = func(rel string) {
		if rel == "a" && !swapped {
			swapped = true
			if err := os.Rename(filepath.Join(upper2, "a"), filepath.Join(upper2, "a.old")); err != nil {
				t.Error(err)
			}
			if err := os.Symlink(host, filepath.Join(upper2, "a")); err != nil {
				t.Error(err)
			}
		}
	}
	t.Cleanup(func() { packWalkHook = nil })
	_, err = s.PackDiff(ctx, PackDiffRequest{Holder: "sbxrace", Upper: upper2, Name: "raced"})
	if !swapped {
		t.Fatal("the walk never reached a/")
	}
	t.Logf("pack of a raced upper: %v", err)
	if err != nil && strings.Contains(err.Error(), "shadow") {
		t.Fatalf("the walk listed the host directory through the swapped symlink: %v", err)
	}
	grepStore(t, s, "host-secret-bytes")
}
