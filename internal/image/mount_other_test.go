//go:build !linux

package image

import "testing"

func mountOverlay(t *testing.T, lower, upper, work, mnt string) {
	t.Skip("overlayfs is Linux only")
}
