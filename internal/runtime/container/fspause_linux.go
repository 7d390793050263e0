package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

var _ runtime.FilesystemPauser = (*Runtime)(nil)

// fsPausedFile in a bundle marks a sandbox paused with only its files
// kept: written before its processes are killed, removed once it runs
// again, so a node that dies in between finds it paused, not dead.
const fsPausedFile = "fs-paused"

// launchEnvFile in a bundle's tmpfs (tmp, outside the run directory the
// sandbox sees) keeps the environment Launch gave a prestarted sandbox's
// agent, for its start again at a ResumeFilesystem. It often holds API
// keys: it lives in memory only, never on the node's disk.
const launchEnvFile = "launch.env"

// launchEnvDir is the tmpfs directory of sb's bundle that keeps
// launchEnvFile: tmp, or log in sandboxes made before tmp (log had a
// tmpfs of its own then, which the sandbox does not see either).
func launchEnvDir(bundle string) string {
	if fi, err := os.Lstat(filepath.Join(bundle, tmpDir)); err == nil && fi.IsDir() {
		return filepath.Join(bundle, tmpDir)
	}
	return filepath.Join(bundle, logDir)
}

// PauseFilesystem ends every process of a running sandbox (its memory and
// cgroups go with them, runc forgets the container) and keeps its bundle:
// the writable layer and its quota, config.json, the agent's run and log
// tmpfs, the network namespace it joins. ResumeFilesystem starts it again
// on them. A sandbox paused so already is left as it is.
func (r *Runtime) PauseFilesystem(ctx context.Context, id string) error {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	switch {
	case sb.phase.Load() == phaseFSPaused:
		return nil
	case sb.phase.Load() != phaseLaunched || sb.prestarted.Load():
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q has not started; only a running sandbox can be paused keeping its files", id)
	case len(sb.st.Lower) == 0:
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q was created before filesystem-only pauses (its handle does not name its image layers); pause it with its memory, or make a new sandbox", id)
	}
	if initGone(sb) {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q has ended; only a running sandbox can be paused keeping its files", id)
	}
	marker := filepath.Join(sb.st.Bundle, fsPausedFile)
	if err := writeFileSync(marker, nil); err != nil {
		return fmt.Errorf("pause sandbox %s keeping its files: write its pause mark: %w", id, unwrapPath(err))
	}
	sb.exit.fsPausing.Store(true)
	if err := r.stop(ctx, sb, 0); err != nil {
		// Its processes may still run: it is not paused, and a later end
		// of them is a crash, not a stop.
		sb.exit.fsPausing.Store(false)
		sb.exit.stopping.Store(false)
		if rerr := os.Remove(marker); rerr != nil {
			log.G(ctx).Warn("remove the filesystem-pause mark after a failed pause", log.SandboxID(id), log.Err(rerr))
		}
		return fmt.Errorf("pause sandbox %s keeping its files: %w", id, err)
	}
	// From here on nothing of it runs: the pause holds whatever fails
	// below (ResumeFilesystem removes a runc state left behind).
	r.forgetContainer(ctx, sb)
	next := &sandbox{id: id, st: sb.st, netNS: sb.netNS, guestEnv: sb.guestEnv, exit: newExitWatch()}
	next.phase.Store(phaseFSPaused)
	r.mu.Lock()
	r.sandboxes[id] = next
	r.mu.Unlock()
	sb.replaced.Store(true)
	log.G(ctx).Debug("sandbox paused keeping its files", log.SandboxID(id))
	return nil
}

// forgetContainer removes runc's container of a sandbox whose init ended,
// and its cgroup; what fails is logged (the next start removes it).
func (r *Runtime) forgetContainer(ctx context.Context, sb *sandbox) {
	ctx = context.WithoutCancel(ctx)
	if pid := int(sb.pid.Load()); pid > 0 {
		waitPidGone(ctx, pid, 10*time.Second)
	}
	if _, err := r.runcOut(ctx, sb.st.StateRoot, "delete", "--force", sb.id); err != nil && !errdefs.IsNotFound(err) {
		log.G(ctx).Warn("remove the container of a sandbox paused keeping its files", log.SandboxID(sb.id), log.Err(err))
	}
	if err := r.cg.remove(ctx, sb.st.CgroupPath); err != nil {
		log.G(ctx).Warn("remove the cgroups of a sandbox paused keeping its files", log.SandboxID(sb.id), log.Err(err))
	}
}

// ResumeFilesystem starts a sandbox paused by PauseFilesystem again: its
// root mounted anew over the same writable layer, a fresh init and agent
// (`runc run`) in the same network namespace. A running sandbox is left as
// it is. On error it stays paused.
func (r *Runtime) ResumeFilesystem(ctx context.Context, id string) error {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	switch sb.phase.Load() {
	case phaseLaunched:
		return nil
	case phaseFSPaused:
	default:
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not paused keeping its files", id)
	}
	// A container a failed delete left at the pause.
	if _, err := r.runcOut(ctx, sb.st.StateRoot, "delete", "--force", id); err != nil && !errdefs.IsNotFound(err) {
		return fmt.Errorf("resume sandbox %s: remove its old container: %w", id, err)
	}
	for _, d := range sb.st.Lower {
		if fi, err := os.Stat(d); err != nil || !fi.IsDir() {
			return errdefs.New(errdefs.ErrFailedPrecondition, "resume sandbox %s: its image layer %s is gone (%v); it cannot run again", id, d, err)
		}
	}
	for _, d := range []string{runDir, logDir} {
		if _, err := os.Stat(filepath.Join(sb.st.ociDir(), d)); err != nil {
			return errdefs.New(errdefs.ErrFailedPrecondition, "resume sandbox %s: its %s directory is gone (%v; the host restarted?); it cannot run again", id, d, err)
		}
	}
	env, err := os.ReadFile(filepath.Join(launchEnvDir(sb.st.Bundle), launchEnvFile))
	if errors.Is(err, os.ErrNotExist) {
		// Launched by a node before the env moved to the tmpfs.
		env, err = os.ReadFile(filepath.Join(sb.st.Bundle, launchEnvFile))
	}
	if err == nil {
		if err := writeEnvFile(filepath.Join(sb.st.ociDir(), runDir), agentEnvFile, string(env)); err != nil {
			return fmt.Errorf("resume sandbox %s: %w", id, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("resume sandbox %s: read its launch environment: %w", id, err)
	}
	root := filepath.Join(sb.st.ociDir(), rootfsDir)
	// A root left mounted (the node died between the mount below and
	// `runc run`, or the host's unmount after it failed) goes first: an
	// overlay on it would stack on the same upper.
	if isMountPoint(root) {
		if err := unmount(ctx, root); err != nil {
			return fmt.Errorf("resume sandbox %s: remove its old root mount: %w", id, err)
		}
	}
	if err := r.mountRootOverlay(r.resumeMountPoints(ctx, sb.st.MountPoints), sb.st.Lower, sb.st.upper(), sb.st.work(), func(opts string) error {
		return mountOverlayRetry(ctx, root, opts)
	}); err != nil {
		return fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	pid, err := r.runcRun(ctx, id, sb.st.ociDir(), sb.netNS)
	if err != nil {
		uctx := context.WithoutCancel(ctx)
		if _, derr := r.runcOut(uctx, sb.st.StateRoot, "delete", "--force", id); derr != nil && !errdefs.IsNotFound(derr) {
			log.G(ctx).Warn("remove container after a failed resume", log.SandboxID(id), log.Err(derr))
		}
		if uerr := unmount(uctx, root); uerr != nil {
			log.G(ctx).Warn("unmount root after a failed resume", log.SandboxID(id), log.Err(uerr))
		}
		return fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	sb.pid.Store(int64(pid))
	sb.phase.Store(phaseLaunched)
	r.watch(sb, pid)
	if err := os.Remove(filepath.Join(sb.st.Bundle, fsPausedFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		log.G(ctx).Warn("remove the filesystem-pause mark of a resumed sandbox", log.SandboxID(id), log.Err(err))
	}
	log.G(ctx).Debug("sandbox resumed on its kept files", log.SandboxID(id), "pid", pid)
	return nil
}

// mountOverlayRetry mounts the overlay root; while the old root's overlay
// is still being released (its mount namespace ends with the last of the
// sandbox's processes) the kernel may call the upper directory busy.
func mountOverlayRetry(ctx context.Context, target, opts string) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := unix.Mount("overlay", target, "overlay", 0, opts)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("mount overlay root: %w", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// recoverFSPaused reports whether sb, found at a node's start with runc's
// state s (or stateErr), is paused keeping its files; a pause the node's
// death interrupted before its kill is dropped (the sandbox still runs),
// one interrupted after it is finished.
func (r *Runtime) recoverFSPaused(ctx context.Context, sb *sandbox, s runcStateJSON, stateErr error) bool {
	marker := filepath.Join(sb.st.Bundle, fsPausedFile)
	if _, err := os.Stat(marker); err != nil {
		return false
	}
	switch {
	case stateErr != nil && !errdefs.IsNotFound(stateErr):
		return false // runc cannot say: the caller keeps its error
	case stateErr == nil && s.Status != "stopped":
		if err := os.Remove(marker); err != nil {
			log.G(ctx).Warn("remove the mark of an interrupted filesystem pause", log.SandboxID(sb.id), log.Err(err))
		}
		return false
	}
	r.forgetContainer(ctx, sb)
	return true
}
