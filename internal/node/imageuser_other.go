//go:build !linux

package node

import "io/fs"

// Other systems have no overlayfs layers: no whiteouts, no opaque
// directories.
func isWhiteoutInfo(fs.FileInfo) bool { return false }

func opaqueParent(string, string) bool { return false }
