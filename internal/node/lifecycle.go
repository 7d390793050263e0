package node

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// forget drops sb from memory and releases its reservation.
func (n *Node) forget(sb *sandbox) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if cur, ok := n.sandboxes[sb.rec.ID]; ok && cur == sb {
		delete(n.sandboxes, sb.rec.ID)
		if !sb.released {
			n.reservedCPU -= sb.rec.Spec.CPU
			n.reservedMem -= sb.rec.Spec.MemoryMB
		}
		n.usedSeq++
	}
	if sb.rec.RequestID != "" && n.requests[sb.rec.RequestID] == sb {
		delete(n.requests, sb.rec.RequestID)
	}
	if sb.alias != "" && n.aliases[sb.alias] == sb.rec.ID {
		delete(n.aliases, sb.alias)
	}
	if t := sb.transport.Load(); t != nil {
		t.CloseIdleConnections()
	}
}

// destroy stops and deletes the sandbox's backend state and its directory,
// then removes its record. Errors are logged: the record is kept when the
// backend could not delete, so the next start retries.
func (n *Node) destroy(ctx context.Context, rec *record) error {
	if err := n.kill(ctx, rec); err != nil {
		log.G(ctx).Warn("stop sandbox", log.SandboxID(rec.ID), log.Err(err))
	}
	return n.teardown(ctx, rec)
}

// teardown is destroy of a sandbox already killed: everything but the
// backend's stop.
func (n *Node) teardown(ctx context.Context, rec *record) error {
	l := log.G(ctx).With(log.SandboxID(rec.ID))
	rt, ok := n.cfg.Backends[rec.Backend]
	if ok {
		if err := rt.Delete(ctx, rec.ID); err != nil {
			l.Error("delete sandbox; will retry at next node start", log.Err(err))
			return fmt.Errorf("delete sandbox: %w", err)
		}
	}
	if n.cfg.Network != nil {
		if err := n.cfg.Network.Teardown(ctx, rec.ID); err != nil {
			l.Error("tear down sandbox network; will retry at next node start", log.Err(err))
			return fmt.Errorf("tear down sandbox network: %w", err)
		}
	}
	if err := os.RemoveAll(rec.StateDir); err != nil {
		l.Error("remove sandbox dir", log.Err(err))
		return fmt.Errorf("remove sandbox dir: %w", err)
	}
	if err := n.cfg.Images.Release(ctx, rec.ID); err != nil {
		l.Warn("release image hold", log.Err(err))
	}
	if err := n.table.delete(rec); err != nil {
		return fmt.Errorf("delete sandbox record: %w", err)
	}
	if n.traj != nil {
		// Kept for node.trajectory.retention_sec, then swept.
		if err := n.traj.Close(rec.ID); err != nil {
			l.Warn("close trajectory log", log.Err(err))
		}
	}
	return nil
}

// Stop stops and deletes a sandbox. reason is logged.
func (n *Node) Stop(ctx context.Context, id, reason string) error {
	return n.stopIf(ctx, id, reason, nil)
}

// stopIf is Stop that first runs check (when not nil) under the node's
// lock, right before the sandbox moves to stopping: an error from it
// stops nothing and is returned. The reaper checks there that the timeout
// that chose the sandbox still holds (a set_timeout or a pause may have
// come in since).
func (n *Node) stopIf(ctx context.Context, id, reason string, check func(*sandbox, *record) error) error {
	end, err := n.begin("stop sandbox " + id)
	if err != nil {
		return err
	}
	defer end()
	sb, err := n.get(id)
	if errdefs.IsNotFound(err) {
		n.mu.Lock()
		real, ok := n.aliases[id]
		n.mu.Unlock()
		if ok {
			sb, err = n.get(real)
			id = real
		}
	}
	if err != nil {
		return err
	}
	select {
	case <-sb.ready:
	case <-ctx.Done():
		return ctx.Err()
	}
	if sb.err != nil {
		return errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", id)
	}
	n.mu.Lock()
	if done := sb.stopDone; done != nil {
		// Another stop is under way: report its outcome, not an early nil.
		n.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
		n.mu.Lock()
		err := sb.stopErr
		n.mu.Unlock()
		return err
	}
	if check != nil {
		if err := check(sb, sb.rec); err != nil {
			n.mu.Unlock()
			return err
		}
	}
	rec, err := transition(sb.rec, stateStopping) // allowed from every state
	if err != nil {
		n.mu.Unlock()
		return err
	}
	done := make(chan struct{})
	sb.stopDone = done
	sb.rec = &rec
	n.mu.Unlock()
	sb.reason.Store(reason)
	ctx = context.WithoutCancel(ctx)
	t0 := time.Now()
	derr := n.table.put(&rec)
	// The critical path ends once nothing of the sandbox runs (so nothing
	// reaches it or is reached from it): the rest of its teardown — runc's
	// delete, unmounts, loop detach, netns, cgroups, state dir, image hold,
	// record — goes to a background worker (teardownLater).
	deferred := false
	if derr == nil {
		if derr = n.kill(ctx, &rec); derr == nil {
			deferred = !sb.syncTeardown && n.teardownLater(&rec)
			if !deferred {
				derr = n.teardown(ctx, &rec)
			}
		}
	}
	n.mu.Lock()
	sb.stopErr = derr
	if derr != nil {
		// Keep the sandbox (and its reservation) so nothing runs unseen;
		// the reaper retries.
		sb.stopDone = nil
	} else if deferred {
		n.tearing++ // until its teardown ends (admit counts it)
	}
	n.mu.Unlock()
	close(done)
	if derr != nil {
		return fmt.Errorf("stop sandbox %s (will retry): %w", id, derr)
	}
	n.forget(sb)
	log.G(ctx).Info("sandbox stopped", log.SandboxID(id), "reason", reason, "stop_ms", ms(time.Since(t0)), "teardown_deferred", deferred)
	return nil
}

// kill stops the backend's sandbox: when it returns nil, nothing of it
// runs.
func (n *Node) kill(ctx context.Context, rec *record) error {
	rt, ok := n.cfg.Backends[rec.Backend]
	if !ok {
		return nil
	}
	if err := rt.Stop(ctx, rec.ID, runtime.StopOptions{}); err != nil && !errdefs.IsNotFound(err) {
		return fmt.Errorf("stop sandbox: %w", err)
	}
	return nil
}

// teardownLater hands the rest of a killed sandbox's teardown (teardown) to
// the background, at most teardownWorkers at a time, and reports whether it
// did (not once the node shuts down: then the caller tears down itself).
// Its record stays "stopping" in the table until destroy removes it, so a
// node that dies first finishes the teardown at its next start (recover
// destroys every record caught stopping). CPU and memory are released at
// once — the sandbox's processes are dead, the kernel has freed their
// memory — but the sandbox still counts against max_sandboxes (it holds a
// loop device, a netns, mounts) until destroy has freed them. Shutdown
// waits for pending teardowns (each is an operation of the gate).
func (n *Node) teardownLater(rec *record) bool {
	if !n.cfg.DeferTeardown {
		return false
	}
	end, err := n.begin("tear down sandbox " + rec.ID)
	if err != nil {
		return false
	}
	n.teardowns.Add(1)
	go func() {
		defer n.teardowns.Done()
		defer end()
		ctx := context.WithoutCancel(n.life)
		l := log.G(ctx).With(log.SandboxID(rec.ID))
		for attempt := 0; ; attempt++ {
			n.teardownSlots <- struct{}{}
			t0 := time.Now()
			err := n.teardown(ctx, rec)
			<-n.teardownSlots
			if err == nil {
				l.Debug("sandbox torn down", "teardown_ms", ms(time.Since(t0)))
				break
			}
			if attempt >= 4 {
				l.Error("tear down stopped sandbox; giving up until the next node start", log.Err(err))
				break
			}
			select {
			case <-n.life.Done():
				l.Warn("tear down stopped sandbox interrupted by shutdown; the next node start finishes it", log.Err(err))
				return // still counted in tearing: the node is going away
			case <-time.After(time.Duration(1<<attempt) * time.Second):
			}
		}
		n.mu.Lock()
		n.tearing--
		n.usedSeq++
		n.mu.Unlock()
	}()
	return true
}

// SetTimeout makes the sandbox's lifetime end seconds from now. On a paused
// sandbox it sets the lifetime it resumes with: seconds from its resume
// (the paused clock does not run, and the max_paused clock is not reset).
func (n *Node) SetTimeout(ctx context.Context, id string, seconds int64) (*record, error) {
	end, err := n.begin("set timeout of sandbox " + id)
	if err != nil {
		return nil, err
	}
	defer end()
	if err := checkTimeout(seconds); err != nil {
		return nil, err
	}
	sb, err := n.get(id)
	if err != nil {
		return nil, err
	}
	// A pause or resume in progress finishes first, so the lifetime is
	// set on the state it leaves.
	sb.pauseMu.Lock()
	defer sb.pauseMu.Unlock()
	return n.setTimeout(ctx, sb, seconds)
}

func checkTimeout(seconds int64) error {
	if seconds <= 0 || seconds > sandboxspec.MaxTimeoutSec {
		return errdefs.Invalid("timeout_seconds", "is %d; give 1..%d seconds", seconds, sandboxspec.MaxTimeoutSec)
	}
	return nil
}

// setTimeout is SetTimeout with sb.pauseMu held.
func (n *Node) setTimeout(_ context.Context, sb *sandbox, seconds int64) (*record, error) {
	if err := checkTimeout(seconds); err != nil {
		return nil, err
	}
	d := time.Duration(seconds) * time.Second
	n.mu.Lock()
	rec := *sb.rec
	switch rec.State {
	case stateRunning:
		rec.ExpiresAt = n.now().Add(d)
	case statePaused:
		// resumedExpiry gives a resumed sandbox what it had left at the
		// pause: ExpiresAt - PausedAt.
		rec.ExpiresAt = rec.PausedAt.Add(d)
	default:
		n.mu.Unlock()
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is %s", sb.id, rec.State)
	}
	rec.Spec.TimeoutSec = seconds
	sb.rec = &rec
	n.mu.Unlock()
	if err := n.table.put(&rec); err != nil {
		return nil, fmt.Errorf("record sandbox: %w", err)
	}
	return &rec, nil
}

// SetNetwork replaces a running sandbox's network rules. Invalid rules
// change nothing.
func (n *Node) SetNetwork(ctx context.Context, id string, rules netpolicy.Rules) (*record, error) {
	end, err := n.begin("set network of sandbox " + id)
	if err != nil {
		return nil, err
	}
	defer end()
	if n.cfg.Network == nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "node %s has network policy turned off (node.network.enabled); its sandboxes have no network", n.cfg.ID)
	}
	sb, err := n.get(id)
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	if sb.rec.State != stateRunning {
		n.mu.Unlock()
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is %s", id, sb.rec.State)
	}
	n.mu.Unlock()
	if err := n.cfg.Network.Validate(rules); err != nil {
		return nil, prefixField("network.", err)
	}
	if err := n.cfg.Network.SetRules(ctx, id, rules); err != nil {
		return nil, fmt.Errorf("set network rules: %w", err)
	}
	n.mu.Lock()
	rec := *sb.rec
	rec.Spec.Network = &rules
	sb.rec = &rec
	n.mu.Unlock()
	if err := n.table.put(&rec); err != nil {
		return nil, fmt.Errorf("record sandbox: %w", err)
	}
	return &rec, nil
}
