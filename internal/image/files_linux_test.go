package image

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// TestImageFiles: a file kept with an image is seen through another Store
// on the same directory (another node), and goes with the image's Remove.
func TestImageFiles(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "images")
	s := openStore(t, dir, WithFormat(FormatDir))
	importTree(t, s, "snapshot/abc", map[string]string{"f": "x"})
	src := filepath.Join(t.TempDir(), "log")
	if err := os.WriteFile(src, []byte("calls"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.PutFile(t.Context(), "snapshot/abc", "trajectory.log", src); err != nil {
		t.Fatal(err)
	}
	other := openStore(t, dir, WithFormat(FormatDir))
	p, err := other.File("snapshot/abc:latest", "trajectory.log")
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); string(b) != "calls" {
		t.Fatalf("file reads %q", b)
	}
	if _, err := other.File("snapshot/abc", "other"); !errdefs.IsNotFound(err) {
		t.Fatalf("missing file: %v", err)
	}
	if err := s.PutFile(t.Context(), "snapshot/abc", "../x", src); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("bad key: %v", err)
	}
	if err := other.Remove(t.Context(), "snapshot/abc"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.File("snapshot/abc", "trajectory.log"); !errdefs.IsNotFound(err) {
		t.Fatalf("file after the image's removal: %v", err)
	}
}
