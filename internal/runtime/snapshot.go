package runtime

import (
	"context"
	"time"
)

// SnapshotInfo describes a snapshot a backend wrote.
type SnapshotInfo struct {
	// Memory: the snapshot holds the sandbox's memory and processes, so a
	// restore resumes them; otherwise only its files are kept and a
	// restore starts its init again.
	Memory bool
	// Bytes is what the snapshot takes on disk.
	Bytes int64
	// SourceFrozen is how long the snapshot kept the sandbox frozen (0
	// when it did not freeze it).
	SourceFrozen time.Duration
}

// Snapshotter is implemented by backends that can save a sandbox and make
// new sandboxes from what they saved.
type Snapshotter interface {
	// Snapshot saves sandbox id's state into dir, an empty directory the
	// node made and owns (it may copy it to another node). The sandbox
	// keeps running; the backend may freeze it while it copies.
	Snapshot(ctx context.Context, id, dir string) (SnapshotInfo, error)
	// Restore is Create from a snapshot in dir: the new sandbox (spec's
	// ID, StateDir, network) is prepared, not started; Start runs it
	// (resuming its memory when the snapshot has it). dir is only read.
	// On error nothing is left behind.
	Restore(ctx context.Context, spec Spec, dir string) (Handle, error)
}

// ForkResult is one new sandbox of a Fork.
type ForkResult struct {
	Handle Handle
	// MemoryPreserved: the fork resumes the source's processes and memory;
	// otherwise it has the source's files and starts its init again.
	MemoryPreserved bool
	// SourceFrozen is how long the fork kept the source frozen (the same
	// in every result of one Fork); 0 when it did not freeze it (it was
	// paused already, or never started).
	SourceFrozen time.Duration
}

// Forker is implemented by backends that copy a running sandbox into new
// ones on the same node, cheaper than Snapshot and Restore.
type Forker interface {
	// Fork makes one new sandbox per spec (each with its own ID, StateDir
	// and network) from sandbox id's state at this instant, prepared, not
	// started. The source is frozen at most while its state is copied and
	// runs on after. Either every fork is made or none is (on error
	// nothing is left behind).
	Fork(ctx context.Context, id string, specs []Spec) ([]ForkResult, error)
}

// DiffFormat is how a RootfsDiff presents a sandbox's changes.
type DiffFormat string

// DiffOverlayDir: RootfsDiff.Dir is a directory tree of the changed files,
// with overlayfs' conventions for deletions: a whiteout is a 0/0 character
// device, a replaced directory carries the trusted.overlay.opaque xattr.
// (A VM backend would mount its writable disk and hand out its upper
// directory the same way.)
const DiffOverlayDir DiffFormat = "overlay-dir"

// RootfsDiff is a sandbox's changes to its root filesystem since its image.
type RootfsDiff struct {
	Format DiffFormat
	Dir    string
}

// RootfsDiffer is implemented by backends that can hand out a sandbox's
// changes to its root filesystem, so the node can pack them into a new
// image layer (pack_diff).
type RootfsDiffer interface {
	// DiffRootfs calls fn with the sandbox's changes. The sandbox is not
	// deleted while fn runs; it may keep running, so a file written during
	// fn may be captured mid-write (pause the sandbox first for a
	// consistent copy). errdefs.ErrNotFound if the sandbox is unknown.
	DiffRootfs(ctx context.Context, id string, fn func(ctx context.Context, d RootfsDiff) error) error
}
