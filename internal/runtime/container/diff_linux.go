package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.Differ = (*Runtime)(nil)

// Diff calls fn with the sandbox's overlayfs upper directory, holding the
// sandbox's lifecycle lock so Stop and Delete wait until fn returns. A
// running sandbox is frozen for the whole of fn, so code in it cannot
// change the upper (e.g. swap a directory for a symlink) while fn reads
// it; it is thawed afterwards, also when fn fails. A sandbox already paused
// stays paused.
func (r *Runtime) Diff(ctx context.Context, id string, fn func(ctx context.Context, upper string) error) (err error) {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	if sb.st.Bundle == "" {
		return errdefs.New(errdefs.ErrNotFound, "sandbox %q has no root filesystem on this node", id)
	}
	upper := filepath.Join(sb.st.Bundle, upperDir)
	if _, err := os.Stat(upper); err != nil {
		return fmt.Errorf("sandbox %s upper layer: %w", id, errors.Join(errdefs.ErrNotFound, err))
	}
	if r.running(sb) != nil {
		return fn(ctx, upper) // stopped: nothing runs in it
	}
	paused, err := r.cg.frozen(sb.st.CgroupPath)
	if err != nil {
		return fmt.Errorf("sandbox %s freezer state: %w", id, err)
	}
	if paused {
		return fn(ctx, upper)
	}
	if err := r.cg.setFrozen(ctx, sb.st.CgroupPath, true); err != nil {
		return fmt.Errorf("freeze sandbox %s for diff: %w", id, err)
	}
	defer func() {
		if terr := r.cg.setFrozen(context.WithoutCancel(ctx), sb.st.CgroupPath, false); terr != nil {
			err = errors.Join(err, fmt.Errorf("thaw sandbox %s after diff: %w", id, terr))
		}
	}()
	return fn(ctx, upper)
}
