package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestFilesystemPauseBundle: the launch env (API keys, often) is kept in
// the bundle's tmpfs, never on disk; a resume clears a root mount left
// behind; a pause that fails leaves a later crash reported as one, not as
// a stop.
func TestFilesystemPauseBundle(t *testing.T) {
	f := newFactory(t)
	rti, tmpl := f(t)
	rt := rti.(*Runtime)
	ctx := t.Context()
	spec := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if err := rt.Prestart(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if err := rt.Launch(ctx, spec.ID, []string{"API_KEY=secret"}); err != nil {
		t.Fatal(err)
	}
	if err := runtimetest.WaitAgent(ctx, rt, spec.ID, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	sb, err := rt.get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	bundle := sb.st.Bundle
	if _, err := os.Lstat(filepath.Join(bundle, launchEnvFile)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("launch env on the bundle's disk: %v, want none", err)
	}
	kept := filepath.Join(launchEnvDir(bundle), launchEnvFile)
	if b, err := os.ReadFile(kept); err != nil || !strings.Contains(string(b), "API_KEY=secret") {
		t.Fatalf("launch env kept at %s: %q %v", kept, b, err)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(kept, &fs); err != nil || fs.Type != unix.TMPFS_MAGIC {
		t.Fatalf("file system of the kept launch env: %#x %v, want tmpfs", fs.Type, err)
	}

	// A root mount left behind by a node that died before `runc run`.
	if err := rt.PauseFilesystem(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(bundle, tmpDir, rootfsDir)
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", strings.Join(sb.st.Lower, ":"), sb.st.upper(), sb.st.work())
	if err := mountOverlayRetry(ctx, root, opts); err != nil {
		t.Fatal(err)
	}
	if err := rt.ResumeFilesystem(ctx, spec.ID); err != nil {
		t.Fatalf("resume over a root left mounted: %v", err)
	}
	if isMountPoint(root) {
		t.Fatalf("%s is still mounted on the host after the resume, want the old root gone", root)
	}
	if err := runtimetest.WaitAgent(ctx, rt, spec.ID, 30*time.Second); err != nil {
		t.Fatal(err)
	}

	// A pause that fails (a frozen sandbox and a context already ended:
	// runc cannot be asked its state) leaves it running, and its later
	// death is not a stop.
	if err := rt.Pause(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := rt.PauseFilesystem(cctx, spec.ID); err == nil {
		t.Fatal("filesystem pause with an ended context succeeded; the test cannot make it fail")
	}
	if err := rt.Resume(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	st, err := rt.Status(ctx, spec.ID)
	if err != nil || st.Pid <= 0 {
		t.Fatalf("status after the failed pause: %+v %v", st, err)
	}
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	end, err := rt.Wait(wctx, spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if end.Reason == "stopped" || end.Reason == "paused keeping only its files" {
		t.Fatalf("death after a failed filesystem pause reported as %q, want a crash", end.Reason)
	}
}
