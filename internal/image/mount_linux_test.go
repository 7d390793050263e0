package image

import (
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

// mountOverlay mounts an overlayfs of lower (colon-separated) with upper and
// work at mnt, as the container backend makes a sandbox's root, until the
// test ends.
func mountOverlay(t *testing.T, lower, upper, work, mnt string) {
	t.Helper()
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work)
	if err := unix.Mount("overlay", mnt, "overlay", 0, opts); err != nil {
		t.Fatalf("mount overlay: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
}
