package microvm

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// placeFile puts host file src at dst in a jail. owner < 0: a read-only
// file shared with the host, a hard link where both are on one filesystem
// and otherwise a read-only bind mount onto an empty file (RemoveJail
// unmounts it); the VM's uid must be able to read it (o+r), else it is
// copied for that uid. owner >= 0: the sandbox's own file (its disks), a
// hard link whose inode becomes owner's.
func placeFile(src, dst string, owner, gid int) error {
	st, err := os.Stat(src)
	if err != nil {
		return err
	}
	if owner >= 0 {
		if err := os.Link(src, dst); err != nil {
			return err
		}
		return os.Chown(dst, owner, gid)
	}
	if st.Mode().Perm()&0o004 == 0 {
		return copyFor(src, dst, gid)
	}
	if err := os.Link(src, dst); err == nil {
		return nil
	} else if !errors.Is(err, unix.EXDEV) {
		return err
	}
	f, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o444)
	if err != nil {
		return err
	}
	_ = f.Close()
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %w", src, err)
	}
	if err := unix.Mount("", dst, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
		_ = unix.Unmount(dst, unix.MNT_DETACH)
		return fmt.Errorf("bind %s read-only: %w", src, err)
	}
	return nil
}

// copyFor copies src to dst readable by group gid only (src is not
// readable by others, so no VM may share it).
func copyFor(src, dst string, gid int) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	if err := os.WriteFile(dst, b, 0o440); err != nil {
		return err
	}
	return os.Chown(dst, 0, gid)
}

// unmountUnder lazily unmounts every mount at or below dir (the bind
// mounts placeFile made), deepest first.
func unmountUnder(dir string) error {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	var mps []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 5 {
			continue
		}
		mp := unescapeMount(fs[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			mps = append(mps, mp)
		}
	}
	slices.SortFunc(mps, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, mp := range mps {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", filepath.Clean(mp), err))
		}
	}
	return errors.Join(errs...)
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
