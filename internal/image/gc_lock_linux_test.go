package image

import (
	"context"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/testutil"
)

// TestGCDeletesOutsideTheLock checks a Hold (what every sandbox create
// does) succeeds while GC is still deleting a doomed layer: the deletion
// runs after the store lock is released.
func TestGCDeletesOutsideTheLock(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := t.Context()
	s := newStore(t)
	importTree(t, s, "keep", map[string]string{"etc/keep": "keep"})
	importTree(t, s, "doomed", map[string]string{"big/file": "doomed"})
	if err := s.Remove(ctx, "doomed"); err != nil {
		t.Fatal(err)
	}
	// Trash a GC that crashed mid-deletion left behind.
	writeFile(t, s.path("tmp", "prune-crashed", "dir", "file"), "x", 0o644)
	var holdErr error
	deleting := 0
	pruneRemove = func(dir string) error {
		deleting++
		// Still deleting: a create must not wait for the GC.
		hctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		_, holdErr = s.Hold(hctx, "keep", "sbxduringgc")
		return removeTree(dir)
	}
	t.Cleanup(func() { pruneRemove = removeTree; s.Release(context.Background(), "sbxduringgc") })
	res, err := s.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if deleting != 1 || len(res.Removed) != 1 {
		t.Fatalf("GC deleted %d layers (removed %v), want the doomed one", deleting, res.Removed)
	}
	if holdErr != nil {
		t.Fatalf("Hold during the GC's deletion: %v; want it to succeed at once", holdErr)
	}
	if ents := tmpEntries(t, s); len(ents) != 0 {
		t.Fatalf("tmp/ after GC: %v, want the trash (and a crashed GC's) gone", ents)
	}
}
