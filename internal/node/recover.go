package node

import (
	"context"
	"fmt"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

// recover re-attaches to every sandbox in the table. Sandboxes caught in the
// middle of a create or stop are cleaned up; dead ones are removed.
func (n *Node) recover(ctx context.Context) error {
	recs, err := n.table.all()
	if err != nil {
		return fmt.Errorf("read sandbox table: %w", err)
	}
	// A backend whose sandboxes outlive the node (VMs, jails, cgroups,
	// uids) must be there to manage them: without it they would run on
	// unmanaged, so the node does not start.
	for _, rec := range recs {
		if _, ok := n.cfg.Backends[rec.Backend]; !ok {
			if why, known := n.cfg.Unavailable[rec.Backend]; known {
				return errdefs.New(errdefs.ErrFailedPrecondition, "the sandbox table holds sandbox %q of backend %s, which cannot open at this start (%s); its processes, jails, cgroups and uids would be left unmanaged: make %s run here again (for microvm: hardware KVM and Firecracker), then start the node",
					rec.ID, rec.Backend, why, rec.Backend)
			}
		}
	}
	for _, rec := range recs {
		l := log.G(ctx).With(log.SandboxID(rec.ID))
		rt, ok := n.cfg.Backends[rec.Backend]
		if !ok {
			l.Error("sandbox uses a backend this node no longer has; leaving its record", "backend", rec.Backend)
			continue
		}
		if rec.State != stateRunning && rec.State != statePaused {
			l.Info("cleaning up sandbox interrupted while " + rec.State)
			if rec.Handle.ID != "" {
				if err := rt.Recover(ctx, rec.Handle); err != nil && !errdefs.IsNotFound(err) {
					l.Warn("recover interrupted sandbox", log.Err(err))
				}
			}
			if err := n.destroy(ctx, rec); err != nil {
				l.Error("clean up interrupted sandbox", log.Err(err))
			}
			continue
		}
		// Only a backend's definite answer — gone, or stopped — removes a
		// sandbox. Any other error (a runc hiccup, an unknown handle
		// version after an upgrade) keeps it: killing live sandboxes on a
		// transient error at start would be far worse than a stale entry.
		dead := false
		if err := rt.Recover(ctx, rec.Handle); err != nil {
			if errdefs.IsNotFound(err) {
				dead = true
			} else {
				l.Error("recover sandbox; keeping it and its reservation", log.Err(err))
			}
		} else if st, err := rt.Status(ctx, rec.ID); err == nil && (st.State == runtime.StateStopped || st.State == runtime.StateCreated) {
			// Created: the node died between recording the sandbox
			// running and its start; nothing of it ever ran.
			dead = true
		} else if err == nil {
			// A node killed between a freeze (or thaw) and its record
			// finds the backend's state newer than the record's.
			rec = reconcilePaused(ctx, n.table, rec, st)
		} else if err != nil {
			if errdefs.IsNotFound(err) {
				dead = true
			} else {
				l.Error("sandbox status after recovery; keeping it", log.Err(err))
			}
		}
		if dead {
			l.Warn("sandbox died while the node was down; removing it")
			if err := n.destroy(ctx, rec); err != nil {
				l.Error("remove dead sandbox", log.Err(err))
			}
			continue
		}
		sb := &sandbox{rec: rec, id: rec.ID, backend: rec.Backend, ready: make(chan struct{})}
		close(sb.ready)
		sb.touch()
		n.sandboxes[rec.ID] = sb
		if rec.RequestID != "" {
			n.requests[rec.RequestID] = sb
		}
		if rec.State == statePaused && rec.PausedFilesystem {
			sb.released = true // nothing of it runs: it reserves nothing
		} else {
			n.reservedCPU += rec.Spec.CPU
			n.reservedMem += rec.Spec.MemoryMB
		}
		n.watchExit(sb)
		l.Info("sandbox recovered")
	}
	return nil
}
