package node

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// Pause semantics (E2B's): a paused sandbox keeps its memory and files and
// persists until resumed or stopped, or until it has been paused longer than
// Config.MaxPaused (then the reaper stops it). Its lifetime clock stops: the
// lifetime left at the pause (ExpiresAt - PausedAt) starts again at the
// resume; a sandbox paused because its lifetime ended (on_timeout "pause")
// gets a fresh full lifetime (Spec.TimeoutSec). It is never idle-reaped.
// Exec, files and ports resume it first (autoresume.go); SetTimeout while
// paused sets the lifetime left (ExpiresAt = PausedAt + timeout).

// maxBatchOps bounds the pauses or resumes one batch runs at once on a node.
const maxBatchOps = 64

// freezeDeadline bounds the backend's freeze of one pause. The freeze does
// not end with its caller (a request that gives up, a short client
// deadline): a freeze cut short is thawed again by the backend, and one that
// completes is recorded, so a caller that retries finds the sandbox paused
// (the container backend's own retries end after 10 s, well within this).
const freezeDeadline = 30 * time.Second

// reclaimDeadline bounds one sandbox's reclaim. Like a freeze, a reclaim
// does not end with its caller: one cut short would say nothing of what it
// freed, and the pause it follows is done.
const reclaimDeadline = 2 * time.Minute

// pauser returns the backend of rec if it can pause.
func (n *Node) pauser(rec *record) (runtime.Pauser, error) {
	p, ok := n.cfg.Backends[rec.Backend].(runtime.Pauser)
	if !ok {
		return nil, errdefs.New(errdefs.ErrUnimplemented, "backend %s cannot pause sandboxes", rec.Backend)
	}
	return p, nil
}

// readyRunning waits for a create in progress and returns the sandbox.
func (n *Node) readySandbox(ctx context.Context, id string) (*sandbox, error) {
	sb, err := n.get(id)
	if err != nil {
		return nil, err
	}
	select {
	case <-sb.ready:
	case <-ctx.Done():
		return nil, fmt.Errorf("wait for sandbox %s: %w", id, ctx.Err())
	}
	if sb.err != nil {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", id)
	}
	return sb, nil
}

// Pause freezes a running sandbox. Pausing a paused sandbox succeeds.
func (n *Node) Pause(ctx context.Context, id string) (*record, error) {
	rec, _, err := n.pauseReclaimIf(ctx, id, pauseMode{}, nil)
	return rec, err
}

// PauseFilesystem pauses a running sandbox keeping only its files (E2B's
// pause with memory false): its processes end, its memory is freed and its
// CPU and memory reservation given back; its writable layer, network,
// spec, owner and ID stay. A resume (Resume, or a call into it) starts it
// again on the same files with a fresh init, after admitting its CPU and
// memory again. Pausing a paused sandbox succeeds (and leaves its mode).
// Backends without runtime.FilesystemPauser refuse.
func (n *Node) PauseFilesystem(ctx context.Context, id string) (*record, error) {
	rec, _, err := n.pauseReclaimIf(ctx, id, pauseMode{filesystemOnly: true}, nil)
	return rec, err
}

// pauseMode is how a pause pauses.
type pauseMode struct {
	// reclaim: after the freeze, push the memory out (PauseReclaim).
	reclaim bool
	// filesystemOnly: end the processes, keep the files (PauseFilesystem).
	filesystemOnly bool
}

// pauseIf is Pause; check, when set, may refuse the freeze of the running
// sandbox: it runs under the sandbox's pause lock once calls arriving see
// the pause coming (sb.pausing), so a call it does not see waits for the
// pause and resumes the sandbox.
func (n *Node) pauseIf(ctx context.Context, id string, filesystemOnly bool, check func(*sandbox, *record) error) (*record, error) {
	rec, _, err := n.pauseReclaimIf(ctx, id, pauseMode{filesystemOnly: filesystemOnly}, check)
	return rec, err
}

// PauseReclaim freezes a running sandbox and, with reclaim, then pushes its
// memory out (Reclaim; also when it was paused already). The reclaim's
// result is nil without reclaim. A reclaim that fails leaves the sandbox
// paused and says why in the result's Note.
func (n *Node) PauseReclaim(ctx context.Context, id string, reclaim bool) (*record, *runtime.ReclaimStats, error) {
	return n.pauseReclaimIf(ctx, id, pauseMode{reclaim: reclaim}, nil)
}

// pauseReclaimIf is PauseReclaim or PauseFilesystem, with pauseIf's check.
func (n *Node) pauseReclaimIf(ctx context.Context, id string, mode pauseMode, check func(*sandbox, *record) error) (*record, *runtime.ReclaimStats, error) {
	end, err := n.begin("pause sandbox " + id)
	if err != nil {
		return nil, nil, err
	}
	defer end()
	if mode.reclaim && mode.filesystemOnly {
		return nil, nil, errdefs.Invalid("reclaim", "a filesystem-only pause (filesystem_only) frees all of the sandbox's memory already; drop reclaim")
	}
	c, rs, err := n.pauseReclaim(ctx, id, mode, check)
	if err != nil || c.sb == nil {
		return c.next, rs, err
	}
	if err := n.table.put(c.next); err != nil {
		n.undo(ctx, c)
		return nil, nil, fmt.Errorf("record paused sandbox %s (the pause was undone): %w", id, err)
	}
	log.G(ctx).Info("sandbox paused", log.SandboxID(id), "reclaimed_bytes", rs.Freed(), "filesystem_only", c.next.PausedFilesystem)
	return c.next, rs, nil
}

// pauseReclaim is pause followed, with reclaim, by a reclaim of the paused
// sandbox.
func (n *Node) pauseReclaim(ctx context.Context, id string, mode pauseMode, check func(*sandbox, *record) error) (change, *runtime.ReclaimStats, error) {
	c, err := n.pause(ctx, id, mode.filesystemOnly, check)
	if err != nil || !mode.reclaim {
		return c, nil, err
	}
	rs := n.reclaim(ctx, id)
	return c, &rs, nil
}

// reclaim pushes the memory of a paused sandbox out through its backend's
// Reclaimer, under the sandbox's pause lock (a resume waits for it). It
// never fails: what stopped it is in the Note (a backend that cannot
// reclaim, a sandbox resumed or stopped meanwhile, a kernel error).
func (n *Node) reclaim(ctx context.Context, id string) runtime.ReclaimStats {
	sb, err := n.get(id)
	if err != nil {
		return runtime.ReclaimStats{Note: "not reclaimed: " + err.Error()}
	}
	sb.pauseMu.Lock()
	defer sb.pauseMu.Unlock()
	n.mu.Lock()
	rec := sb.rec
	n.mu.Unlock()
	if rec.State != statePaused {
		return runtime.ReclaimStats{Note: fmt.Sprintf("not reclaimed: the sandbox is %s (resumed or stopped meanwhile)", rec.State)}
	}
	if rec.PausedFilesystem {
		return runtime.ReclaimStats{Note: "not reclaimed: the sandbox is paused keeping only its files; it holds no memory"}
	}
	rc, ok := n.cfg.Backends[rec.Backend].(runtime.Reclaimer)
	if !ok {
		return runtime.ReclaimStats{Note: fmt.Sprintf("not reclaimed: backend %s cannot reclaim a paused sandbox's memory", rec.Backend)}
	}
	rctx, cancel := context.WithTimeoutCause(context.WithoutCancel(ctx), reclaimDeadline,
		fmt.Errorf("the reclaim took longer than %s", reclaimDeadline))
	defer cancel()
	rs, err := rc.Reclaim(rctx, id)
	if err != nil {
		log.G(ctx).Warn("reclaim memory of a paused sandbox", log.SandboxID(id), log.Err(err))
		return runtime.ReclaimStats{Before: rs.Before, After: rs.Before, Note: "not reclaimed: " + err.Error()}
	}
	return rs
}

// change is a pause or resume applied to the backend and the in-memory
// record (prev became next) but not yet to the table. A zero sb means
// nothing changed (next is the record as it is).
type change struct {
	sb         *sandbox
	prev, next *record
}

// undo reverts c after its table write failed: the backend and the
// in-memory record go back to prev, so the caller's error leaves the
// sandbox as it was. When something else changed the sandbox meanwhile it
// does nothing; when the backend cannot be reverted, memory keeps next (it
// agrees with the backend, which recovery trusts).
func (n *Node) undo(ctx context.Context, c change) {
	ctx = context.WithoutCancel(ctx)
	id := c.prev.ID
	c.sb.pauseMu.Lock()
	defer c.sb.pauseMu.Unlock()
	n.mu.Lock()
	cur := c.sb.rec
	n.mu.Unlock()
	if cur != c.next {
		return
	}
	var err error
	switch {
	case c.prev.State == statePaused && c.next.State == statePaused:
		// A dropped memory cannot come back: memory keeps next, as the
		// backend has it.
		log.G(ctx).Error("unrecorded drop of a paused sandbox's memory kept", log.SandboxID(id))
		return
	case c.prev.PausedFilesystem && c.prev.State == statePaused: // a resume
		c.sb.fsPauses.Add(1)
		err = n.backendPause(ctx, c.sb, c.prev)
	case c.next.PausedFilesystem && c.next.State == statePaused: // a pause
		n.mu.Lock()
		err = n.readmit(c.sb)
		n.mu.Unlock()
		if err == nil {
			if err = n.backendResume(ctx, c.prev.Backend, id, true); err != nil {
				// Still paused: it reserves nothing.
				n.mu.Lock()
				n.releaseRoom(c.sb)
				n.mu.Unlock()
			}
		}
	default:
		var p runtime.Pauser
		if p, err = n.pauser(c.prev); err == nil {
			if c.prev.State == statePaused {
				err = p.Pause(ctx, id)
			} else {
				err = p.Resume(ctx, id)
			}
		}
	}
	if err != nil {
		log.G(ctx).Error("undo unrecorded pause state change", log.SandboxID(id), "state", c.next.State, log.Err(err))
		return
	}
	n.mu.Lock()
	if c.sb.rec == c.next {
		c.sb.rec = c.prev
		if c.prev.PausedFilesystem && c.prev.State == statePaused {
			n.releaseRoom(c.sb)
		}
	}
	n.mu.Unlock()
}

// pause freezes the sandbox and updates its in-memory record; a change with
// sb set must be written to the table (or undone). Until it is, a node
// killed meanwhile finds the backend paused and the record running, and
// recover trusts the backend.
func (n *Node) pause(ctx context.Context, id string, filesystemOnly bool, check func(*sandbox, *record) error) (change, error) {
	sb, err := n.readySandbox(ctx, id)
	if err != nil {
		return change{}, err
	}
	if err := waitStarted(ctx, sb); err != nil {
		return change{}, err
	}
	sb.pauseMu.Lock()
	defer sb.pauseMu.Unlock()
	n.mu.Lock()
	rec := sb.rec
	n.mu.Unlock()
	switch rec.State {
	case statePaused:
		if !filesystemOnly || rec.PausedFilesystem {
			return change{next: rec}, nil
		}
		// Paused with its memory, now to keep only its files (E2B's
		// connect with memory false: a reboot from its files).
		return n.dropMemory(ctx, sb, rec)
	case stateRunning:
	default:
		return change{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is %s; only a running sandbox can be paused", id, rec.State)
	}
	if err := n.canPause(rec, filesystemOnly); err != nil {
		return change{}, err
	}
	// Calls arriving now wait for the freeze, then resume (autoResume).
	sb.pausing.Store(true)
	defer sb.pausing.Store(false)
	if check != nil {
		if err := check(sb, rec); err != nil {
			return change{}, err
		}
	}
	fctx, cancel := context.WithTimeoutCause(context.WithoutCancel(ctx), freezeDeadline,
		fmt.Errorf("the freeze took longer than %s", freezeDeadline))
	defer cancel()
	if filesystemOnly {
		sb.fsPauses.Add(1)
		if err := n.backendPause(fctx, sb, rec); err != nil {
			return change{}, fmt.Errorf("pause sandbox %s keeping its files: %w", id, err)
		}
	} else {
		p, err := n.pauser(rec)
		if err != nil {
			return change{}, err
		}
		if err := p.Pause(fctx, id); err != nil {
			return change{}, fmt.Errorf("pause sandbox %s: %w", id, err)
		}
	}
	now := n.now()
	n.mu.Lock()
	defer n.mu.Unlock()
	// Stopped meanwhile (the stop thaws and kills): nothing to record.
	prev := sb.rec
	r2, err := transition(prev, statePaused)
	if err != nil {
		return change{}, err
	}
	r2.PausedAt = now
	r2.PausedFilesystem = filesystemOnly
	sb.rec = &r2
	if filesystemOnly {
		n.releaseRoom(sb)
		if t := sb.transport.Load(); t != nil {
			t.CloseIdleConnections() // to the agent that ended
		}
	}
	return change{sb: sb, prev: prev, next: &r2}, nil
}

// dropMemory turns a sandbox paused with its memory into one paused keeping
// only its files (its frozen processes end). sb.pauseMu is held.
func (n *Node) dropMemory(ctx context.Context, sb *sandbox, rec *record) (change, error) {
	if err := n.canPause(rec, true); err != nil {
		return change{}, err
	}
	fctx, cancel := context.WithTimeoutCause(context.WithoutCancel(ctx), freezeDeadline,
		fmt.Errorf("the pause took longer than %s", freezeDeadline))
	defer cancel()
	sb.fsPauses.Add(1)
	if err := n.backendPause(fctx, sb, rec); err != nil {
		return change{}, fmt.Errorf("pause sandbox %s keeping only its files: %w", sb.id, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	prev := sb.rec
	if prev.State != statePaused { // stopped meanwhile
		return change{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is %s", sb.id, prev.State)
	}
	r2 := *prev
	r2.PausedFilesystem = true
	sb.rec = &r2
	n.releaseRoom(sb)
	if t := sb.transport.Load(); t != nil {
		t.CloseIdleConnections()
	}
	return change{sb: sb, prev: prev, next: &r2}, nil
}

// canPause refuses a pause the sandbox's backend cannot do, naming the fix.
func (n *Node) canPause(rec *record, filesystemOnly bool) error {
	if !filesystemOnly {
		_, err := n.pauser(rec)
		return err
	}
	if _, ok := n.cfg.Backends[rec.Backend].(runtime.FilesystemPauser); !ok {
		return errdefs.New(errdefs.ErrUnimplemented, "backend %s cannot pause a sandbox keeping only its files (filesystem_only); pause it with its memory, or run it on the container backend (microvm, vm and gvisor cannot)", rec.Backend)
	}
	return nil
}

// backendPause is the backend's filesystem-only pause of sb; sb's
// watcher (watchExit) waits for its next run once it returns.
func (n *Node) backendPause(ctx context.Context, sb *sandbox, rec *record) error {
	fp, ok := n.cfg.Backends[rec.Backend].(runtime.FilesystemPauser)
	if !ok {
		return errdefs.New(errdefs.ErrUnimplemented, "backend %s cannot pause a sandbox keeping only its files", rec.Backend)
	}
	return fp.PauseFilesystem(ctx, sb.id)
}

// backendResume is the backend's resume of sandbox id: a thaw, or with
// filesystemOnly a fresh start on its kept files.
func (n *Node) backendResume(ctx context.Context, backend, id string, filesystemOnly bool) error {
	if filesystemOnly {
		fp, ok := n.cfg.Backends[backend].(runtime.FilesystemPauser)
		if !ok {
			return errdefs.New(errdefs.ErrUnimplemented, "backend %s cannot resume a sandbox paused keeping only its files", backend)
		}
		return fp.ResumeFilesystem(ctx, id)
	}
	p, ok := n.cfg.Backends[backend].(runtime.Pauser)
	if !ok {
		return errdefs.New(errdefs.ErrUnimplemented, "backend %s cannot pause sandboxes", backend)
	}
	return p.Resume(ctx, id)
}

// releaseRoom gives back sb's CPU and memory reservation (it is paused
// keeping only its files). n.mu is held.
func (n *Node) releaseRoom(sb *sandbox) {
	if sb.released {
		return
	}
	n.reservedCPU -= sb.rec.Spec.CPU
	n.reservedMem -= sb.rec.Spec.MemoryMB
	sb.released = true
	n.usedSeq++
}

// readmit reserves sb's CPU and memory again for its resume, or refuses
// when they no longer fit the node (it then stays paused). n.mu is held.
func (n *Node) readmit(sb *sandbox) error {
	if !sb.released {
		return nil
	}
	cpu, mem := sb.rec.Spec.CPU, sb.rec.Spec.MemoryMB
	if quota := n.cpuQuota(); n.reservedCPU+cpu > quota+1e-9 {
		return errdefs.New(errdefs.ErrResourceExhausted, "sandbox %s is paused keeping only its files and its %g CPU do not fit node %s now (%g of quota free: %g cores × %g, node.cpu_overcommit); it stays paused: stop other sandboxes, then resume it",
			sb.id, cpu, n.cfg.ID, max(quota-n.reservedCPU, 0), n.cfg.CPU, n.cfg.CPUOvercommit)
	}
	if quota := n.memQuota(); n.reservedMem+mem > quota {
		return errdefs.New(errdefs.ErrResourceExhausted, "sandbox %s is paused keeping only its files and its %d MiB of memory do not fit node %s now (%d MiB free: %d MiB × %g, node.memory_overcommit); it stays paused: stop other sandboxes, then resume it",
			sb.id, mem, n.cfg.ID, max(quota-n.reservedMem, 0), n.cfg.MemoryMB, n.cfg.MemoryOvercommit)
	}
	n.reservedCPU += cpu
	n.reservedMem += mem
	sb.released = false
	n.usedSeq++
	return nil
}

// now is the node's clock (Config.Clock, or the wall clock), in UTC.
func (n *Node) now() time.Time {
	if n.cfg.Clock != nil {
		return n.cfg.Clock().UTC()
	}
	return time.Now().UTC()
}

// Resume thaws a paused sandbox. Its lifetime ends timeoutSec from now when
// timeoutSec > 0; else it continues with what was left at the pause, or
// starts afresh (Spec.TimeoutSec) when the pause came at its expiry (an
// auto-pause on timeout). Resuming a running sandbox succeeds (and applies
// timeoutSec the same way).
func (n *Node) Resume(ctx context.Context, id string, timeoutSec int64) (*record, error) {
	end, err := n.begin("resume sandbox " + id)
	if err != nil {
		return nil, err
	}
	defer end()
	if timeoutSec < 0 || timeoutSec > sandboxspec.MaxTimeoutSec {
		return nil, errdefs.Invalid("timeout_seconds", "is %d; give 1..%d seconds, or 0 to keep the lifetime left at the pause", timeoutSec, sandboxspec.MaxTimeoutSec)
	}
	c, err := n.resumeIf(ctx, id, timeoutSec, nil)
	if err != nil || c.sb == nil {
		return c.next, err
	}
	if err := n.table.put(c.next); err != nil {
		n.undo(ctx, c)
		return nil, fmt.Errorf("record resumed sandbox %s (the resume was undone): %w", id, err)
	}
	log.G(ctx).Info("sandbox resumed", log.SandboxID(id), "expires_at", c.next.ExpiresAt)
	return c.next, nil
}

// resumeIf thaws the sandbox and updates its in-memory record; a change
// with sb set must be written to the table (or undone). check, when set,
// may refuse the resume of a paused sandbox (under its pause lock).
func (n *Node) resumeIf(ctx context.Context, id string, timeoutSec int64, check func(*record) error) (change, error) {
	sb, err := n.readySandbox(ctx, id)
	if err != nil {
		return change{}, err
	}
	sb.pauseMu.Lock()
	defer sb.pauseMu.Unlock()
	n.mu.Lock()
	rec := sb.rec
	n.mu.Unlock()
	switch rec.State {
	case stateRunning:
		if timeoutSec > 0 {
			rec, err := n.setTimeout(ctx, sb, timeoutSec)
			return change{next: rec}, err
		}
		return change{next: rec}, nil
	case statePaused:
		if check != nil {
			if err := check(rec); err != nil {
				return change{}, err
			}
		}
	default:
		return change{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is %s; only a paused sandbox can be resumed", id, rec.State)
	}
	if rec.PausedFilesystem {
		n.mu.Lock()
		err := n.readmit(sb)
		n.mu.Unlock()
		if err != nil {
			return change{}, err
		}
		if err := n.backendResume(ctx, rec.Backend, id, true); err != nil {
			n.mu.Lock()
			n.releaseRoom(sb)
			n.mu.Unlock()
			return change{}, fmt.Errorf("resume sandbox %s (it stays paused, its files kept): %w", id, err)
		}
	} else if err := n.backendResume(ctx, rec.Backend, id, false); err != nil {
		return change{}, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	sb.touch() // time spent paused is not idle time
	now := n.now()
	n.mu.Lock()
	defer n.mu.Unlock()
	prev := sb.rec
	if prev.State != statePaused { // resumed or stopped meanwhile
		return change{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is %s", id, prev.State)
	}
	r2, err := transition(prev, stateRunning)
	if err != nil {
		return change{}, err
	}
	r2.ExpiresAt = resumedExpiry(&r2, now, timeoutSec)
	if timeoutSec > 0 {
		r2.Spec.TimeoutSec = timeoutSec
	}
	r2.PausedAt = time.Time{}
	r2.PausedFilesystem = false
	sb.rec = &r2
	return change{sb: sb, prev: prev, next: &r2}, nil
}

// resumedExpiry is when a sandbox resumed at now ends: timeoutSec from now;
// else, when it was paused at or after its expiry (an auto-pause on
// timeout), a fresh full lifetime (Spec.TimeoutSec) from now; else the
// lifetime it had left when it was paused (at least a second).
func resumedExpiry(rec *record, now time.Time, timeoutSec int64) time.Time {
	if timeoutSec > 0 {
		return now.Add(time.Duration(timeoutSec) * time.Second)
	}
	if rec.PausedAt.IsZero() || !rec.PausedAt.Before(rec.ExpiresAt) {
		full := rec.Spec.TimeoutSec
		if full <= 0 {
			full = sandboxspec.DefaultTimeoutSec
		}
		return now.Add(time.Duration(full) * time.Second)
	}
	return now.Add(max(rec.ExpiresAt.Sub(rec.PausedAt), time.Second))
}

// Selector picks sandboxes on this node; set fields are AND-ed.
type Selector struct {
	Labels map[string]string
	TaskID string
	IDs    []string
	// owner, when set, matches only the sandboxes the caller owns
	// (ownedBy).
	owner func(*record) bool
}

func (s Selector) empty() bool {
	return len(s.Labels) == 0 && s.TaskID == "" && len(s.IDs) == 0
}

func (s Selector) match(rec *record) bool {
	if s.owner != nil && !s.owner(rec) {
		return false
	}
	if s.TaskID != "" && rec.Spec.TaskID != s.TaskID {
		return false
	}
	for k, v := range s.Labels {
		if got, ok := rec.Spec.Labels[k]; !ok || got != v {
			return false
		}
	}
	if len(s.IDs) > 0 {
		for _, id := range s.IDs {
			if id == rec.ID {
				return true
			}
		}
		return false
	}
	return true
}

// BatchResult is the outcome of a batch operation on one sandbox.
type BatchResult struct {
	ID  string
	Rec *record
	Err error
	// Reclaim is what a pause with reclaim freed (nil otherwise, or when
	// the pause failed).
	Reclaim *runtime.ReclaimStats
}

// ReclaimedBytes sums what the reclaims of rs freed.
func ReclaimedBytes(rs []BatchResult) int64 {
	var sum int64
	for _, r := range rs {
		if r.Err == nil && r.Reclaim != nil {
			sum += r.Reclaim.Freed()
		}
	}
	return sum
}

// PauseMatching pauses every sandbox matching sel, concurrently, and
// records them in one table write. With reclaim each paused sandbox's
// memory is then pushed out (see PauseReclaim), those paused already too.
func (n *Node) PauseMatching(ctx context.Context, sel Selector, reclaim bool) ([]BatchResult, error) {
	end, err := n.begin("pause sandboxes matching a selector")
	if err != nil {
		return nil, err
	}
	defer end()
	var mu sync.Mutex
	var changed []change
	reclaims := map[string]*runtime.ReclaimStats{}
	rs, err := n.batch(ctx, sel, func(ctx context.Context, id string) (*record, error) {
		c, r, err := n.pauseReclaim(ctx, id, pauseMode{reclaim: reclaim}, nil)
		mu.Lock()
		if c.sb != nil {
			changed = append(changed, c)
		}
		if r != nil {
			reclaims[id] = r
		}
		mu.Unlock()
		return c.next, err
	})
	if err != nil {
		return nil, err
	}
	for i := range rs {
		rs[i].Reclaim = reclaims[rs[i].ID]
	}
	rs, err = n.recordBatch(ctx, rs, changed, "paused", sel)
	if err == nil && reclaim {
		log.G(ctx).Info("paused sandboxes reclaimed", "task_id", sel.TaskID, "bytes_freed", ReclaimedBytes(rs))
	}
	return rs, err
}

// ResumeMatching resumes every sandbox matching sel, concurrently.
func (n *Node) ResumeMatching(ctx context.Context, sel Selector, timeoutSec int64) ([]BatchResult, error) {
	end, err := n.begin("resume sandboxes matching a selector")
	if err != nil {
		return nil, err
	}
	defer end()
	if timeoutSec < 0 || timeoutSec > sandboxspec.MaxTimeoutSec {
		return nil, errdefs.Invalid("timeout_seconds", "is %d; give 1..%d seconds, or 0 to keep the lifetime left at the pause", timeoutSec, sandboxspec.MaxTimeoutSec)
	}
	var mu sync.Mutex
	var changed []change
	rs, err := n.batch(ctx, sel, func(ctx context.Context, id string) (*record, error) {
		c, err := n.resumeIf(ctx, id, timeoutSec, nil)
		if c.sb != nil {
			mu.Lock()
			changed = append(changed, c)
			mu.Unlock()
		}
		return c.next, err
	})
	if err != nil {
		return nil, err
	}
	return n.recordBatch(ctx, rs, changed, "resumed", sel)
}

// recordBatch writes the records a batch changed in one transaction; when
// that fails every change is undone and every item reports the failure.
func (n *Node) recordBatch(ctx context.Context, rs []BatchResult, changed []change, what string, sel Selector) ([]BatchResult, error) {
	recs := make([]*record, len(changed))
	for i, c := range changed {
		recs[i] = c.next
	}
	if err := n.table.putAll(recs); err != nil {
		for _, c := range changed {
			n.undo(ctx, c)
		}
		err = fmt.Errorf("record %s sandboxes (undone): %w", what, err)
		for i := range rs {
			if rs[i].Err == nil {
				rs[i].Err, rs[i].Rec, rs[i].Reclaim = err, nil, nil
			}
		}
		return rs, nil
	}
	log.G(ctx).Info("sandboxes "+what, "count", len(changed), "task_id", sel.TaskID)
	return rs, nil
}

func (n *Node) batch(ctx context.Context, sel Selector, op func(context.Context, string) (*record, error)) ([]BatchResult, error) {
	if sel.empty() {
		return nil, errdefs.Invalid("selector", "is empty; give labels, task_id or ids (an empty selector would match every sandbox)")
	}
	var ids []string
	n.mu.Lock()
	for id, sb := range n.sandboxes {
		if sel.match(sb.rec) && (sb.rec.State == stateRunning || sb.rec.State == statePaused) {
			ids = append(ids, id)
		}
	}
	n.mu.Unlock()
	out := make([]BatchResult, len(ids))
	slots := make(chan struct{}, maxBatchOps)
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			rec, err := op(ctx, id)
			out[i] = BatchResult{ID: id, Rec: rec, Err: err}
		}()
	}
	wg.Wait()
	return out, nil
}

// Metrics is one sample of a sandbox's resource use.
type Metrics struct {
	Time       time.Time
	CPUCount   float64
	CPUUsedPct float64
	runtime.Stats
	State string
}

// cpuSample is the previous CPU reading of a sandbox, for CPUUsedPct.
type cpuSample struct {
	at    time.Time
	nanos uint64
}

// Metrics reads a sandbox's resource use. CPUUsedPct covers the time since
// the previous call (or since the sandbox started).
func (n *Node) Metrics(ctx context.Context, id string) (Metrics, error) {
	sb, err := n.readySandbox(ctx, id)
	if err != nil {
		return Metrics{}, err
	}
	n.mu.Lock()
	rec := sb.rec
	n.mu.Unlock()
	sr, ok := n.cfg.Backends[rec.Backend].(runtime.StatsReader)
	if !ok {
		return Metrics{}, errdefs.New(errdefs.ErrUnimplemented, "backend %s does not report resource use", rec.Backend)
	}
	st, err := sr.Stats(ctx, id)
	if err != nil {
		return Metrics{}, fmt.Errorf("sandbox stats: %w", err)
	}
	now := time.Now().UTC()
	m := Metrics{Time: now, CPUCount: rec.Spec.CPU, Stats: st, State: rec.State}
	if m.MemoryLimitBytes == 0 {
		m.MemoryLimitBytes = rec.Spec.MemoryMB << 20
	}
	if m.PidsLimit == 0 {
		m.PidsLimit = rec.Spec.PidsLimit
	}
	prev := cpuSample{at: rec.CreatedAt}
	if p := sb.lastCPU.Swap(&cpuSample{at: now, nanos: st.CPUNanos}); p != nil {
		prev = *p
	}
	if dt := now.Sub(prev.at); dt > 0 && st.CPUNanos >= prev.nanos && rec.Spec.CPU > 0 {
		pct := float64(st.CPUNanos-prev.nanos) / float64(dt.Nanoseconds()) / rec.Spec.CPU * 100
		m.CPUUsedPct = min(pct, 100)
	}
	return m, nil
}

// reconcilePaused makes a recovered record's paused state agree with the
// backend's and records the change; on a write error it keeps rec.
func reconcilePaused(ctx context.Context, t *table, rec *record, st runtime.Status) *record {
	r2 := *rec
	switch {
	case st.State == runtime.StatePaused && rec.State == stateRunning:
		r2.State, r2.PausedAt = statePaused, time.Now().UTC()
		r2.PausedFilesystem = st.FilesystemPaused
	case st.State == runtime.StateRunning && rec.State == statePaused:
		r2.State = stateRunning
		r2.ExpiresAt = resumedExpiry(rec, time.Now().UTC(), 0)
		r2.PausedAt = time.Time{}
		r2.PausedFilesystem = false
	case st.State == runtime.StatePaused && rec.State == statePaused && st.FilesystemPaused != rec.PausedFilesystem:
		r2.PausedFilesystem = st.FilesystemPaused
	default:
		return rec
	}
	if err := t.put(&r2); err != nil {
		log.G(ctx).Error("record recovered pause state", log.SandboxID(rec.ID), log.Err(err))
		return rec
	}
	log.G(ctx).Info("sandbox pause state taken from the backend", log.SandboxID(rec.ID), "state", r2.State)
	return &r2
}
