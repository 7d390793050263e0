package container

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// A sandbox that swaps a directory of its upper for a symlink while the
// walk runs does not lead the walk out of the upper: nothing outside is
// counted.
func TestDiskUsageIgnoresDirectorySwappedForSymlink(t *testing.T) {
	outside := t.TempDir()
	for _, n := range []string{"big1", "big2", "big3", "big4"} {
		writeMiB(t, filepath.Join(outside, n))
	}
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "a"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "a", "small"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	swapped := false
	diskWalkHook = func(rel string) {
		if rel != "a" || swapped {
			return
		}
		swapped = true
		// Between the walk's look at a (a directory) and its descent.
		if err := os.Rename(filepath.Join(dir, "a"), filepath.Join(dir, "b")); err != nil {
			t.Error(err)
		}
		if err := os.Symlink(outside, filepath.Join(dir, "a")); err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(func() { diskWalkHook = nil })
	used, _, complete := diskUsage(dir, time.Now().Add(time.Minute))
	if !swapped {
		t.Fatal("the walk never reached a")
	}
	if used >= 1<<20 {
		t.Fatalf("disk used = %d bytes with 4 MiB outside the upper behind a swapped-in symlink; want the upper's few KiB", used)
	}
	if !complete {
		t.Fatal("a walk that skipped a swapped directory reported incomplete")
	}
}
