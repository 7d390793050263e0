package image

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// A staging dir whose lock file the listing missed (created while tmp/
// was being read) is left alone when the lock is there by the time
// cleanTmp would remove the dir; a dir with no lock at all still goes.
func TestCleanTmpKeepsStagingLockedDuringListing(t *testing.T) {
	s := newStore(t)
	live, orphan := s.path("tmp", "live"), s.path("tmp", "orphan")
	for _, d := range []string{live, orphan} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var lock *os.File
	cleanTmpListed = func() {
		// The importer's lock file appears after the listing.
		f, err := os.OpenFile(live+".lock", os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			t.Fatal(err)
		}
		lock = f
	}
	t.Cleanup(func() {
		cleanTmpListed = nil
		if lock != nil {
			lock.Close()
		}
	})
	if err := s.cleanTmp(); err != nil {
		t.Fatal(err)
	}
	if lock == nil {
		t.Fatal("cleanTmp never listed tmp/")
	}
	if _, err := os.Lstat(live); err != nil {
		t.Fatalf("a live import's staging dir was removed: %v", err)
	}
	if _, err := os.Lstat(orphan); !os.IsNotExist(err) {
		t.Fatalf("a staging dir without a lock file survived: %v", err)
	}
}
