package node

import (
	"time"

	"github.com/kernflux/opendsec/internal/runtime"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// deadTTL is how long the node remembers a sandbox that died (its init
// ended without a stop), so GetSandbox reports it failed with the reason
// instead of not found.
const deadTTL = 10 * time.Minute

// tombstone is a dead sandbox kept for Get.
type tombstone struct {
	sb *sandbox
	at time.Time
}

// watchExit waits, for the node's lifetime, for sb's init to end. An end
// the node did not cause (a crash, a kill from outside, the OOM killer) is
// recorded at once: the sandbox is stopped and removed, and Get reports it
// failed with the backend's reason for deadTTL. Ends that a stop or the
// node's shutdown caused are left to those.
//
// One watcher serves a sandbox for its whole life: a filesystem-only pause
// ends init, and the watcher then waits again, for the next run.
func (n *Node) watchExit(sb *sandbox) {
	rt, ok := n.cfg.Backends[sb.backend]
	if !ok {
		return
	}
	pauses := sb.fsPauses.Load()
	go func() {
		var st runtime.ExitStatus
		for {
			var err error
			st, err = rt.Wait(n.life, sb.id)
			if err != nil {
				return // the node closes, or the sandbox was deleted
			}
			if sb.fsPauses.Load() == pauses {
				break
			}
			// A filesystem-only pause began since the Wait: the end may
			// be its. Once the pause is over (it holds pauseMu), wait
			// again: for the next run after a pause that succeeded, for
			// the same init after one that failed (a Wait returns at once
			// if that init ended meanwhile: a death).
			sb.pauseMu.Lock()
			pauses = sb.fsPauses.Load()
			sb.pauseMu.Unlock()
		}
		n.mu.Lock()
		cur, ok := n.sandboxes[sb.id]
		ours := ok && cur == sb && sb.stopDone == nil && sb.rec.State != stateStopping &&
			!sb.rec.PausedFilesystem
		n.mu.Unlock()
		if !ours {
			return
		}
		reason := "died: " + st.Reason
		l := log.G(n.life).With(log.SandboxID(sb.id))
		l.Warn("sandbox died", "reason", st.Reason, "exit_code", st.ExitCode, "oom_killed", st.OOMKilled)
		n.metrics.deaths.Inc()
		// The tombstone goes first: Get finds the sandbox (stopping) in
		// the table's view, then here, never nowhere.
		// Reported failed at once, with the reason; the cleanup (the stop)
		// follows. The tombstone goes first: Get finds the sandbox in the
		// table's view, then there, never nowhere.
		sb.reason.Store(reason)
		sb.died.Store(true)
		n.mu.Lock()
		n.dead[sb.id] = tombstone{sb: sb, at: time.Now()}
		n.mu.Unlock()
		if err := n.Stop(n.life, sb.id, reason); err != nil && !errdefs.IsNotFound(err) && !n.shuttingDown(err) {
			l.Error("remove dead sandbox; the reaper retries", log.Err(err))
		}
	}()
}

// deadSandbox returns the tombstone of a sandbox that died lately.
func (n *Node) deadSandbox(id string) (*sandbox, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	t, ok := n.dead[id]
	if !ok || time.Since(t.at) > deadTTL {
		return nil, false
	}
	return t.sb, true
}

// forgetDead drops tombstones older than deadTTL; called by the reaper.
func (n *Node) forgetDead(now time.Time) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for id, t := range n.dead {
		if now.Sub(t.at) > deadTTL {
			delete(n.dead, id)
		}
	}
}
