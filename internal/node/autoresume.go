package node

import (
	"context"
	"fmt"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// Auto-resume: every call into a paused sandbox — exec, files, PTY,
// processes, port traffic (HTTP, ConnectPort, the E2B gateway's envd and
// user ports), which all come through AgentProxy — resumes it first, with
// the lifetime semantics of a Resume without a timeout (resumedExpiry): the
// lifetime clock starts again with what it had left when it was paused, or
// with a fresh full lifetime (Spec.TimeoutSec) when it was paused because
// its lifetime ended (on_timeout "pause"). Calls that arrive together share
// one resume (single-flight per sandbox); a call that arrives while the
// sandbox is being paused waits for the pause to finish, then resumes it. A
// sandbox paused longer than max_paused is not resumed: it is due to be
// stopped, and is.

// resumeFlight is one auto-resume in progress; the calls that need it wait
// on done and share err.
type resumeFlight struct {
	done    chan struct{}
	err     error
	waiters int // calls waiting on it; guarded by Node.mu
}

// needsResume reports whether a call into sb must resume it first: it is
// paused, or a pause of it is in progress.
func (n *Node) needsResume(sb *sandbox) bool {
	if sb.pausing.Load() {
		return true
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return sb.rec.State == statePaused
}

// autoResume resumes sb for a call into it (what names the call, for the
// log). Concurrent callers share one resume; a caller that gives up stops
// waiting, but the resume goes on for the others.
func (n *Node) autoResume(ctx context.Context, sb *sandbox, what string) error {
	n.mu.Lock()
	f := sb.resuming
	if f == nil {
		f = &resumeFlight{done: make(chan struct{})}
		sb.resuming = f
		// Detached from the caller: the others waiting share it.
		go func() {
			f.err = n.autoResumeOnce(context.WithoutCancel(ctx), sb, what)
			n.mu.Lock()
			sb.resuming = nil
			n.mu.Unlock()
			close(f.done)
		}()
	}
	f.waiters++
	n.mu.Unlock()
	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
		return fmt.Errorf("wait for the resume of sandbox %s: %w", sb.id, context.Cause(ctx))
	}
}

// autoResumeOnce is one auto-resume: it waits for a pause in progress (the
// resume takes the sandbox's pause lock), refuses a sandbox paused longer
// than max_paused, and records the resume.
func (n *Node) autoResumeOnce(ctx context.Context, sb *sandbox, what string) error {
	end, err := n.begin("resume sandbox " + sb.id + " for a call into it")
	if err != nil {
		return err
	}
	defer end()
	c, err := n.resumeIf(ctx, sb.id, 0, func(rec *record) error {
		if n.cfg.MaxPaused > 0 && n.now().Sub(rec.PausedAt) > n.cfg.MaxPaused {
			return errdefs.New(errdefs.ErrNotFound, "sandbox %s was paused longer than node.max_paused (%s) and is being stopped", sb.id, n.cfg.MaxPaused)
		}
		return nil
	})
	if err != nil {
		n.mu.Lock()
		st := sb.rec.State
		n.mu.Unlock()
		if st != statePaused && st != stateRunning { // stopped meanwhile
			return errdefs.New(errdefs.ErrNotFound, "sandbox %s is %s", sb.id, st)
		}
		return err
	}
	if c.sb == nil { // resumed by someone else meanwhile
		return nil
	}
	if err := n.table.put(c.next); err != nil {
		n.undo(ctx, c)
		return fmt.Errorf("record resumed sandbox %s (the resume was undone): %w", sb.id, err)
	}
	n.metrics.autoResumes.Inc()
	log.G(ctx).Info("sandbox auto-resumed", log.SandboxID(sb.id), "call", what, "expires_at", c.next.ExpiresAt)
	return nil
}
