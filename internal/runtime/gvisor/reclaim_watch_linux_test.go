package gvisor

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
)

// fakeRunsc answers state (paused), checkpoint and delete at once; its
// `wait` returns only once the file release exists (the sandbox process
// whose exit the watcher reports).
const fakeRunsc = `#!/bin/sh
for a; do cmd=$a; case $a in state|checkpoint|delete|wait) break;; esac; done
case $cmd in
state) echo '{"status":"paused","pid":1}';;
wait) while [ ! -e "$(dirname "$0")/release" ]; do sleep 0.02; done; echo '{"exitStatus":0}';;
esac
`

// TestReclaimLateWatcherKeepsSandbox: a watcher that returns after
// Reclaim stopped waiting for it (a slow runsc wait) leaves the
// reclaimed sandbox paused, not ended.
func TestReclaimLateWatcherKeepsSandbox(t *testing.T) {
	dir := t.TempDir()
	runsc := filepath.Join(dir, "runsc")
	if err := os.WriteFile(runsc, []byte(fakeRunsc), 0o755); err != nil {
		t.Fatal(err)
	}
	defer func(d time.Duration) { reclaimWatcherWait = d }(reclaimWatcherWait)
	reclaimWatcherWait = 50 * time.Millisecond
	sb := &sandbox{id: "gv-late", exit: runtime.NewExitLatch(), started: true, st: handleState{Bundle: t.TempDir()}}
	r := &Runtime{runsc: runsc, cfg: Config{CgroupParent: filepath.Join(dir, "cg")}, sandboxes: map[string]*sandbox{sb.id: sb}}
	r.startWatch(sb)
	w := sb.watched
	ctx := context.Background()
	if _, err := r.Reclaim(ctx, sb.id); err != nil {
		t.Fatalf("reclaim: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "release"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-w:
	case <-time.After(10 * time.Second):
		t.Fatal("the watcher did not return after its runsc wait did")
	}
	if st, err := r.Status(ctx, sb.id); err != nil || st.State != runtime.StatePaused {
		t.Fatalf("reclaimed sandbox after its late watcher returned: %+v %v; want paused", st, err)
	}
}
