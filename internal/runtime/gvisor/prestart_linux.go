package gvisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.Prestarter = (*Runtime)(nil)

// Prestart makes the sandbox ahead with `runsc create`: the sandbox
// process, the Sentry with the spec loaded, the gofer, the network wired;
// the agent does not run until Launch (`runsc start`).
func (r *Runtime) Prestart(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	if sb.started || sb.prestarted || sb.ended() {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q was prestarted, started or stopped already", id)
	}
	if sb.st.RestoreFrom != "" {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q restores a checkpoint; start it instead of prestarting it", id)
	}
	if sb.st.Network != nil {
		if err := setupGuestNet(ctx, *sb.st.Network, filepath.Join(sb.st.Bundle, guestNetNS)); err != nil {
			return fmt.Errorf("wire sandbox %s's network: %w", id, err)
		}
	}
	if _, err := r.runscOut(ctx, sb, "create", "--bundle", sb.st.Bundle, id); err != nil {
		return err
	}
	sb.prestarted = true
	return nil
}

// Launch runs a prestarted sandbox's agent with env on top of the guest's:
// the agent reads it from the launch dir at its start (--env-file).
func (r *Runtime) Launch(ctx context.Context, id string, env []string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	if !sb.prestarted || sb.started || sb.ended() {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not prestarted and waiting; launch a sandbox once, after Prestart", id)
	}
	return r.launch(ctx, sb, env)
}

// launch writes the env file and starts the container; sb.op is held.
func (r *Runtime) launch(ctx context.Context, sb *sandbox, env []string) error {
	var b strings.Builder
	for _, e := range env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" || strings.ContainsAny(e, "\n\x00") {
			return errdefs.Invalid("env", "entry %q is not K=V without newlines or NUL bytes", e)
		}
		b.WriteString(e + "\n")
	}
	if err := os.WriteFile(filepath.Join(sb.st.Bundle, launchDir, launchEnvFile), []byte(b.String()), 0o644); err != nil {
		return fmt.Errorf("write launch env: %w", err)
	}
	if _, err := r.runscOut(ctx, sb, "start", sb.id); err != nil {
		return err
	}
	sb.started = true
	r.startWatch(sb)
	return nil
}
