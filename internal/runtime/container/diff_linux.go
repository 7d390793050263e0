package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.RootfsDiffer = (*Runtime)(nil)

// diffFrozenFile, in a sandbox's bundle, says the sandbox was frozen by Diff
// and not by a pause: it is written before the freeze and removed after the
// thaw, so a node killed in between finds it and Recover thaws the sandbox
// instead of leaving it frozen for recovery to take for a user's pause.
const diffFrozenFile = "frozen-for-diff"

// DiffRootfs calls fn with the sandbox's overlayfs upper directory
// (runtime.DiffOverlayDir), holding the
// sandbox's lifecycle lock so Stop and Delete wait until fn returns. A
// running sandbox is frozen for the whole of fn, so code in it cannot
// change the upper (e.g. swap a directory for a symlink) while fn reads
// it; it is thawed afterwards, also when fn fails, and by Recover when the
// node dies before that (see diffFrozenFile). A sandbox already paused stays
// paused.
func (r *Runtime) DiffRootfs(ctx context.Context, id string, fn func(ctx context.Context, d runtime.RootfsDiff) error) (err error) {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	if sb.st.Bundle == "" {
		return errdefs.New(errdefs.ErrNotFound, "sandbox %q has no root filesystem on this node", id)
	}
	upper := sb.st.upper()
	if _, err := os.Stat(upper); err != nil {
		return fmt.Errorf("sandbox %s upper layer: %w", id, errors.Join(errdefs.ErrNotFound, err))
	}
	diff := runtime.RootfsDiff{Format: runtime.DiffOverlayDir, Dir: upper}
	if r.running(sb) != nil {
		return fn(ctx, diff) // stopped: nothing runs in it
	}
	paused, err := r.cg.frozen(sb.st.CgroupPath)
	if err != nil {
		return fmt.Errorf("sandbox %s freezer state: %w", id, err)
	}
	if paused {
		return fn(ctx, diff)
	}
	marker := filepath.Join(sb.st.Bundle, diffFrozenFile)
	if err := os.WriteFile(marker, nil, 0o600); err != nil {
		return fmt.Errorf("mark sandbox %s frozen for diff: %w", id, err)
	}
	if err := r.cg.setFrozen(ctx, sb.st.CgroupPath, true); err != nil {
		// setFrozen thaws again when the freeze does not complete.
		return errors.Join(fmt.Errorf("freeze sandbox %s for diff: %w", id, err), r.unmarkDiffFrozen(sb))
	}
	defer func() {
		if terr := r.cg.setFrozen(context.WithoutCancel(ctx), sb.st.CgroupPath, false); terr != nil {
			// The marker stays: the next Recover thaws it.
			err = errors.Join(err, fmt.Errorf("thaw sandbox %s after diff: %w", id, terr))
			return
		}
		err = errors.Join(err, r.unmarkDiffFrozen(sb))
	}()
	return fn(ctx, diff)
}

// unmarkDiffFrozen removes sb's diffFrozenFile; a missing one is fine.
func (r *Runtime) unmarkDiffFrozen(sb *sandbox) error {
	if err := os.Remove(filepath.Join(sb.st.Bundle, diffFrozenFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove diff freeze marker of sandbox %s: %w", sb.id, err)
	}
	return nil
}

// thawAfterDiff thaws a recovered sandbox that a Diff froze when the node
// died (its bundle has diffFrozenFile), so recovery finds it running, as it
// was, and not paused. The caller holds sb.op.
func (r *Runtime) thawAfterDiff(ctx context.Context, sb *sandbox) {
	if _, err := os.Stat(filepath.Join(sb.st.Bundle, diffFrozenFile)); err != nil {
		return
	}
	l := log.G(ctx).With("sandbox.id", sb.id)
	if sb.phase.Load() == phaseLaunched {
		if err := r.cg.setFrozen(ctx, sb.st.CgroupPath, false); err != nil {
			l.Error("thaw sandbox left frozen by an interrupted pack_diff; it shows as paused until resumed", "error", err)
			return
		}
		l.Warn("thawed sandbox left frozen by an interrupted pack_diff")
	}
	if err := r.unmarkDiffFrozen(sb); err != nil {
		l.Error("thaw after interrupted pack_diff", "error", err)
	}
}
