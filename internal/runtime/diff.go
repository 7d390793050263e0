package runtime

import "context"

// Differ is implemented by backends whose sandbox root has a writable
// overlayfs upper layer on the node that can be read back, so the node can
// pack a sandbox's changes into a new image layer (pack_diff).
type Differ interface {
	// Diff calls fn with the host path of the sandbox's overlayfs upper
	// directory (whiteouts as 0/0 character devices, replaced directories
	// marked with the trusted.overlay.opaque xattr). The sandbox is not
	// deleted while fn runs; it may keep running, so a file written during
	// fn may be captured mid-write (pause the sandbox first for a
	// consistent copy). errdefs.ErrNotFound if the sandbox is unknown.
	Diff(ctx context.Context, id string, fn func(ctx context.Context, upper string) error) error
}
