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

// Pause freezes every process of the sandbox with the cgroup freezer.
// Pausing a paused sandbox succeeds.
func (r *Runtime) Pause(ctx context.Context, id string) error {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	if err := r.running(sb); err != nil {
		return err
	}
	if err := r.cg.setFrozen(ctx, sb.st.CgroupPath, true); err != nil {
		return fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	return nil
}

// Resume thaws a paused sandbox. Resuming a running sandbox succeeds.
func (r *Runtime) Resume(ctx context.Context, id string) error {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	if err := r.running(sb); err != nil {
		return err
	}
	if err := r.cg.setFrozen(ctx, sb.st.CgroupPath, false); err != nil {
		return fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	return nil
}

// running returns a failed-precondition error unless sb's init was started
// and is still alive (a frozen init is alive).
func (r *Runtime) running(sb *sandbox) error {
	if sb.phase.Load() != phaseLaunched {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not running (not started, or stopped)", sb.id)
	}
	if pid := int(sb.pid.Load()); pid > 0 && !pidAlive(pid) {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is stopped", sb.id)
	}
	return nil
}

// Stats reads memory, cpu and pids use from the sandbox's cgroup and the
// size of its writable layer.
func (r *Runtime) Stats(ctx context.Context, id string) (runtime.Stats, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Stats{}, err
	}
	st, err := r.cg.stats(sb.st.CgroupPath)
	if errors.Is(err, os.ErrNotExist) {
		return st, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q has no cgroup (not started or already deleted)", id)
	}
	if err != nil {
		return st, fmt.Errorf("sandbox stats: %w", err)
	}
	st.DiskUsedBytes, st.DiskTotalBytes = diskUsage(filepath.Join(sb.st.Bundle, upperDir))
	return st, nil
}
