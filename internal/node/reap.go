package node

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// autoPauseTimeout bounds the reaper's pause of an on_timeout "pause"
// sandbox; past it the sandbox is stopped instead.
const autoPauseTimeout = time.Minute

// maxReapStops bounds the stops the reaper runs at once, so one stuck
// backend call delays no other expiry (unless that many are stuck).
const maxReapStops = 8

// reapLoop stops sandboxes whose lifetime or idle timeout has passed.
func (n *Node) reapLoop() {
	defer n.wg.Done()
	t := time.NewTicker(n.cfg.ReapInterval)
	defer t.Stop()
	slots := make(chan struct{}, maxReapStops)
	for {
		select {
		case <-n.closed:
			return
		case <-t.C:
			now := n.now()
			n.reap(now, slots)
			n.forgetDead(now)
			n.sweepTrajectories(now)
		}
	}
}

// reap starts a stop for every sandbox that expired (or stayed paused longer
// than MaxPaused) and has none running from the reaper, at most cap(slots)
// at once. Shutdown waits for them, up to its deadline.
func (n *Node) reap(now time.Time, slots chan struct{}) {
	type victim struct {
		id, reason string
		pause      bool // on_timeout "pause": pause instead of stopping
		// fsOnly: on_timeout "pause_filesystem": the pause keeps only files.
		fsOnly bool
	}
	var vs []victim
	n.mu.Lock()
	if n.reaping == nil {
		n.reaping = map[string]bool{}
	}
	for id, sb := range n.sandboxes {
		if n.reaping[id] {
			continue
		}
		rec := sb.rec
		if rec.State == stateStopping && sb.stopDone == nil {
			vs = append(vs, victim{id, "retry of a failed stop", false, false})
			continue
		}
		if rec.State == statePaused && n.cfg.MaxPaused > 0 && now.Sub(rec.PausedAt) > n.cfg.MaxPaused {
			vs = append(vs, victim{id, "paused too long", false, false})
			continue
		}
		if rec.State != stateRunning {
			continue
		}
		if now.After(rec.ExpiresAt) {
			vs = append(vs, victim{id, "timeout", rec.Spec.PauseOnTimeout(), rec.Spec.FilesystemPauseOnTimeout()})
			continue
		}
		if rec.Spec.IdleSec > 0 && sb.active.Load() == 0 &&
			now.Sub(time.Unix(0, sb.lastActivity.Load())) > time.Duration(rec.Spec.IdleSec)*time.Second {
			vs = append(vs, victim{id, "idle", rec.Spec.PauseOnTimeout(), rec.Spec.FilesystemPauseOnTimeout()})
		}
	}
	for _, v := range vs {
		n.reaping[v.id] = true
	}
	n.mu.Unlock()
	for _, v := range vs {
		n.wg.Add(1)
		go n.reapOne(v.id, v.reason, v.pause, v.fsOnly, slots)
	}
}

// reapOne stops one expired sandbox once a slot is free, unless the node
// closes first.
func (n *Node) reapOne(id, reason string, pause, fsOnly bool, slots chan struct{}) {
	defer n.wg.Done()
	defer func() {
		n.mu.Lock()
		delete(n.reaping, id)
		n.mu.Unlock()
	}()
	select {
	case slots <- struct{}{}:
	case <-n.closed:
		return
	}
	defer func() { <-slots }()
	select {
	case <-n.closed:
		return
	default:
	}
	ctx := n.life // ends at shutdown; Stop finishes what it began regardless
	if pause {
		pctx, cancel := context.WithTimeoutCause(ctx, autoPauseTimeout,
			fmt.Errorf("auto-pause took longer than %s", autoPauseTimeout))
		_, err := n.pauseIf(pctx, id, fsOnly, n.stillDue(reason))
		cancel()
		if err == nil || errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errNotDue) || n.shuttingDown(err) {
			return
		}
		// A sandbox that cannot be paused (a freezer stuck, a backend
		// that lost the ability) must not outlive its timeout: stop it.
		log.G(ctx).Warn("auto-pause of expired sandbox failed; stopping it instead", log.SandboxID(id), "reason", reason, log.Err(err))
		reason += " (auto-pause failed)"
	}
	if err := n.stopIf(ctx, id, reason, n.stillDueStop(reason)); err != nil && !errors.Is(err, errdefs.ErrNotFound) &&
		!errors.Is(err, errNotDue) && !n.shuttingDown(err) {
		log.G(ctx).Error("stop expired sandbox", log.SandboxID(id), log.Err(err))
	}
}

// errNotDue: a timeout the reaper saw had been put off (a call came in, a
// set_timeout extended the lifetime) by the time it came to act.
var errNotDue = errors.New("timeout no longer due")

// stillDue checks, right before the freeze of an on_timeout "pause", that
// the timeout that chose the sandbox still holds: a call that came in
// meanwhile (it counts as active before it looks at the sandbox's state)
// or a longer lifetime puts it off, so no call is frozen mid-flight by a
// timeout that no longer applies.
func (n *Node) stillDue(reason string) func(*sandbox, *record) error {
	return func(sb *sandbox, rec *record) error {
		now := n.now()
		switch reason {
		case "idle":
			if sb.active.Load() > 0 || now.Sub(time.Unix(0, sb.lastActivity.Load())) <= time.Duration(rec.Spec.IdleSec)*time.Second {
				return errNotDue
			}
		case "timeout":
			if !now.After(rec.ExpiresAt) {
				return errNotDue
			}
		}
		return nil
	}
}

// stillDueStop is stillDue for the reaper's stops, checked under the node's
// lock right before the sandbox moves to stopping: a lifetime or idle
// timeout holds only for a sandbox still running (a paused one's clock
// stands still) whose timeout has not been put off meanwhile, and
// "paused too long" only for a sandbox still paused that long. Other
// reasons (a retry of a failed stop, a failed auto-pause) always stop.
func (n *Node) stillDueStop(reason string) func(*sandbox, *record) error {
	due := n.stillDue(reason)
	return func(sb *sandbox, rec *record) error {
		switch reason {
		case "timeout", "idle":
			if rec.State != stateRunning {
				return errNotDue
			}
			return due(sb, rec)
		case "paused too long":
			if rec.State != statePaused || n.cfg.MaxPaused <= 0 || n.now().Sub(rec.PausedAt) <= n.cfg.MaxPaused {
				return errNotDue
			}
		}
		return nil
	}
}
