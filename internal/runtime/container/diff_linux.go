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
// sandbox's lifecycle lock so Stop and Delete wait until fn returns.
func (r *Runtime) Diff(ctx context.Context, id string, fn func(ctx context.Context, upper string) error) error {
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
	return fn(ctx, upper)
}
