package fsutil

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

// A directory swapped for a symlink between the walk's look at it and its
// descent fails WalkNoFollow and is skipped by WalkNoFollowSkipChanged;
// neither walks what the symlink points at.
func TestWalkNeverFollowsSwappedDirectory(t *testing.T) {
	for _, skip := range []bool{false, true} {
		outside := t.TempDir()
		if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		root := t.TempDir()
		for _, d := range []string{"a", "z"} {
			if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		var seen []string
		fn := func(rel, _ string, fi fs.FileInfo) error {
			seen = append(seen, rel)
			if rel == "a" {
				os.Remove(filepath.Join(root, "a"))
				if err := os.Symlink(outside, filepath.Join(root, "a")); err != nil {
					t.Fatal(err)
				}
			}
			return nil
		}
		walk := WalkNoFollow
		if skip {
			walk = WalkNoFollowSkipChanged
		}
		err := walk(context.Background(), root, fn)
		if skip && err != nil {
			t.Fatalf("skip changed: %v", err)
		}
		if !skip && err == nil {
			t.Fatal("strict walk of a directory swapped for a symlink succeeded")
		}
		for _, rel := range seen {
			if rel == "a/secret" {
				t.Fatalf("skip %v: walked through the symlink: %v", skip, seen)
			}
		}
		if skip && seen[len(seen)-1] != "z" {
			t.Fatalf("the walk did not go on after the swapped directory: %v", seen)
		}
	}
}
