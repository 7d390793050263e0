package container

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

func writeMiB(t *testing.T, path string) {
	t.Helper()
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestDiskCacheServesCachedUntilTTL(t *testing.T) {
	dir := t.TempDir()
	writeMiB(t, filepath.Join(dir, "a"))
	var c diskCache
	u1, total, at1 := c.get(t.Context(), dir)
	if u1 < 1<<20 || total <= 0 || at1.IsZero() {
		t.Fatalf("first measurement: used %d total %d at %v; want >= 1 MiB, a size and a time", u1, total, at1)
	}
	writeMiB(t, filepath.Join(dir, "b"))
	c.mu.Lock()
	c.ttl = time.Hour // as after an expensive walk
	c.mu.Unlock()
	if u2, _, at2 := c.get(t.Context(), dir); u2 != u1 || !at2.Equal(at1) {
		t.Fatalf("within the TTL: used %d at %v, want the cached %d at %v", u2, at2, u1, at1)
	}
	c.mu.Lock()
	c.ttl = 0 // expired
	c.mu.Unlock()
	if u3, _, at3 := c.get(t.Context(), dir); u3 < u1+1<<20 || !at3.After(at1) {
		t.Fatalf("after the TTL: used %d at %v, want >= %d measured after %v", u3, at3, u1+1<<20, at1)
	}
}

// Concurrent callers of a cold cache share one walk.
func TestDiskCacheOneWalkAtATime(t *testing.T) {
	dir := t.TempDir()
	for i := range 2000 {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", i)), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var c diskCache
	var wg sync.WaitGroup
	ats := make([]time.Time, 8)
	for i := range ats {
		wg.Go(func() { _, _, ats[i] = c.get(t.Context(), dir) })
	}
	wg.Wait()
	for i, at := range ats {
		if at.IsZero() || !at.Equal(ats[0]) {
			t.Fatalf("caller %d got a measurement from %v, caller 0 from %v; want one shared walk", i, at, ats[0])
		}
	}
}

// A caller that cannot wait gets what the cache holds; the walk it started
// still fills the cache.
func TestDiskCacheCallerDoesNotWaitPastContext(t *testing.T) {
	dir := t.TempDir()
	writeMiB(t, filepath.Join(dir, "a"))
	var c diskCache
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	c.get(ctx, dir) // may or may not see the walk's result
	deadline := time.Now().Add(10 * time.Second)
	for {
		c.mu.Lock()
		used, walking := c.used, c.walking
		c.mu.Unlock()
		if walking == nil && used >= 1<<20 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the walk started by a cancelled caller did not fill the cache")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
}

func TestDiskTTLAndWalkLimit(t *testing.T) {
	if got := diskTTL(time.Millisecond, true); got != 50*time.Millisecond {
		t.Errorf("ttl after a 1 ms walk = %s, want 50ms", got)
	}
	if got := diskTTL(time.Second, true); got != diskMaxTTL {
		t.Errorf("ttl after a 1 s walk = %s, want %s", got, diskMaxTTL)
	}
	if got := diskTTL(time.Minute, false); got != diskPartialTTL {
		t.Errorf("ttl after a walk stopped at its limit = %s, want %s", got, diskPartialTTL)
	}
	dir := t.TempDir()
	for i := range 3000 {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", i)), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, complete := diskUsage(dir, time.Now().Add(-time.Second)); complete {
		t.Fatalf("a walk past its deadline over 3000 files reported complete")
	}
	if used, _, complete := diskUsage(dir, time.Now().Add(time.Minute)); !complete || used <= 0 {
		t.Fatalf("a walk within its deadline: used %d complete %v", used, complete)
	}
}
