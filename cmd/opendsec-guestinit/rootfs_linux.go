package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// agentInRoot is where the agent binary is bound in the image's root.
const agentInRoot = "/run/opendsec/agent"

const newRoot = "/newroot"

// switchRoot mounts the EROFS layers (vda... topmost first), the writable
// ext4 disk and an overlay of them, moves the kernel filesystems into it,
// binds the agent at agentInRoot and makes it the root (the initramfs's
// switch_root, without exec: this process stays PID 1).
func switchRoot(args bootArgs) error {
	n, err := strconv.Atoi(args["layers"])
	if err != nil || n < 0 || n > 20 {
		return fmt.Errorf("opendsec.layers=%q: want a count 0..20", args["layers"])
	}
	rw := args["rw"]
	if !strings.HasPrefix(rw, "vd") || len(rw) != 3 {
		return fmt.Errorf("opendsec.rw=%q: want the writable disk, e.g. vdb", rw)
	}
	var lower []string
	for i := range n {
		dir := "/layers/" + strconv.Itoa(i)
		if args["layerdev"] == "pmem" {
			if err := mountPmemLayer(i, dir); err != nil {
				return err
			}
		} else if err := mountOn("/dev/vd"+string(rune('a'+i)), dir, "erofs", unix.MS_RDONLY, ""); err != nil {
			return err
		}
		lower = append(lower, dir)
	}
	if err := mountOn("/dev/"+rw, "/rw", "ext4", 0, ""); err != nil {
		return err
	}
	for _, d := range []string{"/rw/upper", "/rw/work"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("writable layer %s: %w", d, err)
		}
	}
	opts := "lowerdir=" + strings.Join(lower, ":") + ",upperdir=/rw/upper,workdir=/rw/work"
	if err := mountOn("overlay", newRoot, "overlay", 0, opts); err != nil {
		return err
	}
	for _, m := range []string{"/proc", "/sys", "/dev"} {
		if err := os.MkdirAll(newRoot+m, 0o755); err != nil {
			return fmt.Errorf("root %s: %w", m, err)
		}
		if err := unix.Mount(m, newRoot+m, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s into the root: %w", m, err)
		}
	}
	if err := mountOn("tmpfs", newRoot+"/run", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=755"); err != nil {
		return err
	}
	bin := newRoot + agentInRoot
	if err := os.MkdirAll(filepath.Dir(bin), 0o755); err != nil {
		return fmt.Errorf("agent in the root: %w", err)
	}
	if err := os.WriteFile(bin, nil, 0o755); err != nil {
		return fmt.Errorf("agent in the root: %w", err)
	}
	if err := unix.Mount("/bin/opendsec-agent", bin, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind the agent into the root: %w", err)
	}
	if err := unix.Chdir(newRoot); err != nil {
		return fmt.Errorf("switch root: %w", err)
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("switch root: move: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("switch root: chroot: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return fmt.Errorf("switch root: %w", err)
	}
	return nil
}

func mountOn(src, dir, fs string, flags uintptr, data string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("mount %s: %w", dir, err)
	}
	if err := unix.Mount(src, dir, fs, flags, data); err != nil {
		return fmt.Errorf("mount %s (%s) on %s: %w", src, fs, dir, err)
	}
	return nil
}

// mountPmemLayer mounts layer i from the virtio-pmem device /dev/pmem<i>
// with DAX: the guest reads the host's page cache of the layer file
// directly, so it keeps no copy in its own cache. Without DAX (a kernel or
// region that cannot) it mounts it as a block device and says so.
func mountPmemLayer(i int, dir string) error {
	dev := "/dev/pmem" + strconv.Itoa(i)
	// nd_pmem binds to the region asynchronously after virtio_pmem's probe.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(dev); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("layer %d: %s did not appear in 10 s (virtio_pmem and nd_pmem loaded?)", i, dev)
		}
		time.Sleep(5 * time.Millisecond) // waiting for the kernel's device, nothing to be told by
	}
	if err := mountOn(dev, dir, "erofs", unix.MS_RDONLY, "dax=always"); err == nil {
		return nil
	} else {
		logf("layer " + strconv.Itoa(i) + " without DAX: " + err.Error())
	}
	return mountOn(dev, dir, "erofs", unix.MS_RDONLY, "")
}
