package vm

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/testutil"
)

// testImageDir holds the layers the package's tests make, once per test
// process; TestMain removes it.
var testImageDir = sync.OnceValues(func() (string, error) { return os.MkdirTemp("", "opendsec-vm-image-") })

// haltRootfs is a one-layer image for the halting stand-in kernel, which
// never reads its disks: 4 KiB of zeros.
func haltRootfs() runtime.Rootfs {
	dir, err := testImageDir()
	if err != nil {
		panic(err)
	}
	p := filepath.Join(dir, "blank.erofs")
	if _, err := os.Stat(p); err != nil {
		if err := os.WriteFile(p, make([]byte, 4096), 0o644); err != nil {
			panic(err)
		}
	}
	return runtime.Rootfs{Image: "test/blank", Layers: []runtime.Layer{{Digest: "sha256:blank", Format: runtime.LayerEROFS, Path: p}}}
}

// haltRes are the stand-in kernel's resources: 1 vCPU, 64 MiB and a
// writable disk of diskMB.
func haltRes(diskMB int64) runtime.Resources {
	return runtime.Resources{CPU: 1, MemoryMB: 64, DiskMB: diskMB}
}

// guestRes are a real guest's resources: 1 vCPU, 256 MiB and a writable
// disk of diskMB.
func guestRes(diskMB int64) runtime.Resources {
	return runtime.Resources{CPU: 1, MemoryMB: 256, DiskMB: diskMB}
}

// guestRootfs is the busybox root filesystem (testutil.BusyboxRootfs, the
// one the container and gvisor suites run in) as one EROFS layer, made once
// per test process: the real guest's image.
func guestRootfs(t testing.TB) runtime.Rootfs {
	t.Helper()
	busybox.Lock()
	defer busybox.Unlock()
	if !busybox.done {
		if _, err := exec.LookPath("mkfs.erofs"); err != nil {
			skipOrFail(t, "mkfs.erofs (erofs-utils) makes the guest's image layer: "+err.Error())
		}
		src := testutil.BusyboxRootfs(t)
		dir, err := testImageDir()
		if err == nil {
			busybox.layer, err = erofsLayer(src, filepath.Join(dir, "busybox.erofs"), "sha256:busybox")
		}
		if err != nil {
			t.Fatal(err)
		}
		busybox.done = true
	}
	return runtime.Rootfs{Image: "test/busybox", Layers: []runtime.Layer{busybox.layer}}
}

var busybox struct {
	sync.Mutex
	layer runtime.Layer
	done  bool
}

func erofsLayer(src, img, digest string) (runtime.Layer, error) {
	if out, err := exec.Command("mkfs.erofs", "--quiet", "--all-root", img, src).CombinedOutput(); err != nil {
		return runtime.Layer{}, fmt.Errorf("mkfs.erofs %s: %w: %s", src, err, out)
	}
	return runtime.Layer{Digest: digest, Format: runtime.LayerEROFS, Path: img}, nil
}
