//go:build !linux

package microvm

import "os"

func placeFile(src, dst string, owner, gid int) error {
	if err := os.Link(src, dst); err != nil {
		return err
	}
	if owner >= 0 {
		return os.Chown(dst, owner, gid)
	}
	return nil
}

func unmountUnder(string) error { return nil }
