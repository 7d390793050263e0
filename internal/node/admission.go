package node

import (
	"context"
	"fmt"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// admit reserves room for sb (its spec's CPU within the node's quota of
// CPUOvercommit times its cores, its memory within MemoryOvercommit times
// the node's, one of the node's sandboxes) and registers it by its ID, the ID its create asked for
// (askedID, an alias when they differ) and its request ID, all at once. When
// a create with the same request ID was admitted before, admit returns it
// as prev and reserves nothing. forget releases what admit reserved.
func (n *Node) admit(sb *sandbox, askedID string) (prev *sandbox, err error) {
	rec := sb.rec
	n.mu.Lock()
	defer n.mu.Unlock()
	if rec.RequestID != "" {
		if p, ok := n.requests[rec.RequestID]; ok {
			return p, nil
		}
	}
	for _, id := range []string{askedID, rec.ID} {
		if _, ok := n.sandboxes[id]; ok {
			return nil, errdefs.New(errdefs.ErrAlreadyExists, "sandbox %s already exists", id)
		}
	}
	if err := n.checkRoom(1, rec.Spec.CPU, rec.Spec.MemoryMB); err != nil {
		return nil, err
	}
	n.sandboxes[rec.ID] = sb
	if rec.RequestID != "" {
		n.requests[rec.RequestID] = sb
	}
	if askedID != "" && askedID != rec.ID {
		n.aliases[askedID] = rec.ID
	}
	n.reservedCPU += rec.Spec.CPU
	n.reservedMem += rec.Spec.MemoryMB
	n.usedSeq++
	return nil, nil
}

// repeatedCreate stops a create pipeline that repeats an admitted create
// (same request ID): the caller gets that one's outcome.
type repeatedCreate struct{ prev *sandbox }

func (r *repeatedCreate) Error() string {
	return fmt.Sprintf("create repeats the create of sandbox %s", r.prev.id)
}

// step is one step of a create pipeline, with what undoes it.
type step struct {
	name string
	do   func(ctx context.Context) error
	// undo reverses a do that succeeded; nil when there is nothing to undo.
	undo func(ctx context.Context)
}

// runSteps runs steps in order. When one fails, the steps done so far are
// undone, last first (even when ctx has ended), and its error is returned.
func runSteps(ctx context.Context, steps []step) error {
	for i, s := range steps {
		if err := s.do(ctx); err != nil {
			log.G(ctx).Debug("create step failed; undoing the steps before it", "step", s.name, log.Err(err))
			uctx := context.WithoutCancel(ctx)
			for j := i - 1; j >= 0; j-- {
				if steps[j].undo != nil {
					steps[j].undo(uctx)
				}
			}
			return err
		}
	}
	return nil
}

// Disk defaults of a node (Config.Disk*).
const (
	DefaultDiskMB        = 5120
	DefaultDiskMaxMB     = 51200
	DefaultDiskReserveMB = 2048
)

// checkDiskReserve refuses a create when the filesystem of the node's state
// dir (the sandbox table and every sandbox's writable layer) has less than
// the reserve free: quotas may add up to more than the disk.
func (n *Node) checkDiskReserve() error {
	if n.cfg.DiskReserveMB == 0 {
		return nil
	}
	free, err := freeMB(n.cfg.StateDir)
	if err != nil || free >= n.cfg.DiskReserveMB {
		return nil //nolint:nilerr // unknown free space: the backend's quota still holds
	}
	return errdefs.New(errdefs.ErrResourceExhausted, "node %s has %d MiB free on its state filesystem, below its reserve of %d MiB (node.disk.reserve_mb); stop sandboxes or free disk space",
		n.cfg.ID, free, n.cfg.DiskReserveMB)
}

// checkRoom reports whether count more sandboxes needing cpu and mem in
// all fit the node: its maximum of sandboxes (counting those still being
// torn down), its CPU quota (cores × node.cpu_overcommit), its memory
// (node.memory_overcommit) and its disk reserve. n.mu is held.
func (n *Node) checkRoom(count int, cpu float64, mem int64) error {
	what := "the sandbox does"
	if count > 1 {
		what = fmt.Sprintf("%d sandboxes do", count)
	}
	if free := n.cfg.MaxSandboxes - int64(len(n.sandboxes)+n.tearing); int64(count) > free {
		return errdefs.New(errdefs.ErrResourceExhausted, "node %s runs %d of its maximum of %d sandboxes (node.max_sandboxes; %d of them stopped and still being torn down) and %s not fit; stop some or add nodes",
			n.cfg.ID, len(n.sandboxes), n.cfg.MaxSandboxes, n.tearing, what)
	}
	// The same capacity Info offers placement: 1e-9 absorbs float sums.
	if quota := n.cpuQuota(); n.reservedCPU+cpu > quota+1e-9 {
		return errdefs.New(errdefs.ErrResourceExhausted, "node %s has %g CPU of quota free (%g cores × %g, node.cpu_overcommit), %g requested; stop sandboxes or ask for less",
			n.cfg.ID, max(quota-n.reservedCPU, 0), n.cfg.CPU, n.cfg.CPUOvercommit, cpu)
	}
	if quota := n.memQuota(); n.reservedMem+mem > quota {
		return errdefs.New(errdefs.ErrResourceExhausted, "node %s has %d MiB of memory free (%d MiB × %g, node.memory_overcommit), %d requested; stop sandboxes or ask for less",
			n.cfg.ID, max(quota-n.reservedMem, 0), n.cfg.MemoryMB, n.cfg.MemoryOvercommit, mem)
	}
	return n.checkDiskReserve()
}
