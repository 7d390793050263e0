package testutil

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// SwapBytes returns SwapTotal of /proc/meminfo in bytes (0 when none or
// unreadable).
func SwapBytes() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "SwapTotal:"); ok {
			fs := strings.Fields(v)
			if len(fs) > 0 {
				n, _ := strconv.ParseInt(fs[0], 10, 64)
				return n << 10
			}
		}
	}
	return 0
}

// EnsureSwap makes sure the host has swap for the test: when it has none
// it sets up a zram swap device of size bytes (MakeZramSwap) and removes it
// when the test ends (only what it made). As root it fails the test loudly
// when it cannot.
func EnsureSwap(t testing.TB, size int64) {
	t.Helper()
	RequiresRoot(t)
	if SwapBytes() > 0 {
		return
	}
	dev, undo, err := MakeZramSwap(size)
	if err != nil {
		t.Fatalf("the host has no swap and a zram swap device could not be set up: %v", err)
	}
	t.Logf("no swap on the host: set up %s (%d MiB of zram swap) for the test", dev, size>>20)
	t.Cleanup(func() {
		if err := undo(); err != nil {
			t.Errorf("remove the test's zram swap %s: %v", dev, err)
		}
	})
}

// MakeZramSwap adds a zram device (zram-control's hot_add, so devices
// others use are left alone), sizes it, makes it swap and turns it on at
// priority 100. undo turns it off and removes the device.
func MakeZramSwap(size int64) (dev string, undo func() error, err error) {
	if _, err := os.Stat("/sys/class/zram-control/hot_add"); err != nil {
		if out, merr := exec.Command("modprobe", "zram", "num_devices=0").CombinedOutput(); merr != nil {
			return "", nil, fmt.Errorf("no zram-control and modprobe zram failed: %v: %s", merr, out)
		}
	}
	b, err := os.ReadFile("/sys/class/zram-control/hot_add")
	if err != nil {
		return "", nil, fmt.Errorf("add a zram device: %w", err)
	}
	id := strings.TrimSpace(string(b))
	name := "zram" + id
	dev = "/dev/" + name
	sys := filepath.Join("/sys/block", name)
	remove := func() error {
		_ = os.WriteFile(filepath.Join(sys, "reset"), []byte("1"), 0)
		if err := os.WriteFile("/sys/class/zram-control/hot_remove", []byte(id), 0); err != nil {
			return fmt.Errorf("hot_remove %s: %w", name, err)
		}
		return nil
	}
	fail := func(err error) (string, func() error, error) {
		_ = remove()
		return "", nil, err
	}
	// lz4 where the kernel has it; else the default (lzo-rle) stays.
	_ = os.WriteFile(filepath.Join(sys, "comp_algorithm"), []byte("lz4"), 0)
	if err := os.WriteFile(filepath.Join(sys, "disksize"), []byte(strconv.FormatInt(size, 10)), 0); err != nil {
		return fail(fmt.Errorf("size %s: %w", name, err))
	}
	if out, err := exec.Command("mkswap", dev).CombinedOutput(); err != nil {
		return fail(fmt.Errorf("mkswap %s: %v: %s", dev, err, out))
	}
	if out, err := exec.Command("swapon", "-p", "100", dev).CombinedOutput(); err != nil {
		return fail(fmt.Errorf("swapon %s: %v: %s", dev, err, out))
	}
	undo = func() error {
		if out, err := exec.Command("swapoff", dev).CombinedOutput(); err != nil {
			return fmt.Errorf("swapoff %s: %v: %s", dev, err, out)
		}
		return remove()
	}
	return dev, undo, nil
}

// ZramStats reads mm_stat of /dev/<name>: the bytes stored (orig_data_size)
// and the RAM they take compressed (mem_used_total).
func ZramStats(name string) (orig, used int64, err error) {
	b, err := os.ReadFile(filepath.Join("/sys/block", strings.TrimPrefix(name, "/dev/"), "mm_stat"))
	if err != nil {
		return 0, 0, err
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return 0, 0, fmt.Errorf("mm_stat %q: too few fields", b)
	}
	orig, _ = strconv.ParseInt(f[0], 10, 64)
	used, _ = strconv.ParseInt(f[2], 10, 64)
	return orig, used, nil
}

// MemhogBinary builds ./internal/testutil/memhog (static) into a temporary
// directory of the test and returns its path.
func MemhogBinary(t testing.TB) string {
	t.Helper()
	root, err := moduleRoot()
	if err != nil {
		t.Fatalf("find module root: %v", err)
	}
	out := filepath.Join(t.TempDir(), "memhog")
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, "./internal/testutil/memhog")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build memhog: %v\n%s", err, b)
	}
	return out
}
