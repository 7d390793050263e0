package container

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// onDisk lists the names in dir on its own file system (what a mount over
// a name hides is not listed twice: a mount point is one name).
func onDisk(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	slices.Sort(names)
	return names
}

// TestBundleInTmpfs: a sandbox's OCI bundle (config.json, the root's mount
// point, run, log, init.pid, the layer image's mount point) is its state
// dir's tmpfs, so the state dir on disk holds only tmp and the layer image.
// A restarted node recovers a running and a created sandbox through it (the
// agent answers, the created one starts). After a reboot (the tmpfs, the
// layer's mount, the container and the intent gone) Recover reports the
// sandbox not found, as before, Delete succeeds, and nothing is left
// mounted in the state dir the node then removes.
func TestBundleInTmpfs(t *testing.T) {
	f := newFactory(t)
	rt1, tmpl := f(t)
	tmpl.Resources.DiskMB = 64
	ctx := t.Context()

	running, hRun := runtimetest.StartSandbox(t, rt1, tmpl)
	if got, want := onDisk(t, running.StateDir), []string{layerImage, tmpDir}; !slices.Equal(got, want) {
		t.Fatalf("state dir on disk holds %v; want %v", got, want)
	}
	tmp := filepath.Join(running.StateDir, tmpDir)
	var fs unix.Statfs_t
	if err := unix.Statfs(tmp, &fs); err != nil || fs.Type != unix.TMPFS_MAGIC {
		t.Fatalf("%s: file system %#x, %v; want a tmpfs", tmp, fs.Type, err)
	}
	for _, p := range []string{configFile, pidFile, rootfsDir, filepath.Join(runDir, agentSocketName), filepath.Join(logDir, agentLog), filepath.Join(layerDir, upperDir)} {
		if _, err := os.Lstat(filepath.Join(tmp, p)); err != nil {
			t.Errorf("bundle tmpfs: %v", err)
		}
	}
	prepared := runtimetest.Prepare(t, rt1, tmpl)
	hPrep, err := rt1.Create(ctx, prepared)
	if err != nil {
		t.Fatal(err)
	}
	gone, hGone := runtimetest.StartSandbox(t, rt1, tmpl)

	// The node restarts: the tmpfs mounts stay in the host's namespace.
	rt2, _ := f(t)
	for _, h := range []runtime.Handle{hRun, hPrep} {
		if err := rt2.Recover(ctx, h); err != nil {
			t.Fatalf("recover %s: %v", h.ID, err)
		}
	}
	if res, err := runtimetest.Run(ctx, rt2, running.ID, "", "/bin/sh", "-c", "echo alive"); err != nil || res.Stdout != "alive\n" {
		t.Fatalf("recovered running sandbox: %+v, %v", res, err)
	}
	if st, err := rt2.Status(ctx, prepared.ID); err != nil || st.State != runtime.StateCreated {
		t.Fatalf("recovered created sandbox: %+v, %v; want created", st, err)
	}
	if err := rt2.Start(ctx, prepared.ID); err != nil {
		t.Fatalf("start the recovered created sandbox: %v", err)
	}
	if err := runtimetest.WaitAgent(ctx, rt2, prepared.ID, 20*time.Second); err != nil {
		t.Fatal(err)
	}

	// A reboot, for the third: its processes, mounts and everything in
	// memory (the OCI runtime's state, the intent) are gone; its state dir
	// on disk stays.
	c2 := rt2.(*Runtime)
	if _, err := c2.runcOut(ctx, c2.cfg.StateRoot, "delete", "--force", gone.ID); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(gone.StateDir, tmpDir, layerDir), filepath.Join(gone.StateDir, tmpDir)} {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
			t.Fatalf("unmount %s: %v", p, err)
		}
	}
	if err := os.Remove(c2.intentPath(gone.ID)); err != nil {
		t.Fatal(err)
	}
	rt3, _ := f(t)
	if err := rt3.Recover(ctx, hGone); !errdefs.IsNotFound(err) {
		t.Fatalf("recover after a reboot: %v; want not found (a dead sandbox)", err)
	}
	if err := rt3.Delete(ctx, gone.ID); err != nil {
		t.Fatalf("delete after a reboot: %v", err)
	}
	if m := runtimetest.MountsUnder(t, gone.StateDir); len(m) > 0 {
		t.Errorf("mounts left under %s: %v", gone.StateDir, m)
	}
	if l := loopsBacking(gone.StateDir); len(l) > 0 {
		t.Errorf("loop devices left: %v", l)
	}
	// What the node does next with a dead sandbox's state dir.
	if err := os.RemoveAll(gone.StateDir); err != nil {
		t.Fatalf("remove the state dir: %v", err)
	}
}
