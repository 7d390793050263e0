package runtime

import (
	"context"
	"fmt"
	"sync"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// ExitLatch keeps a sandbox's end for Wait, the same way in every backend:
// Finish records how init ended (the first call wins) and wakes every
// Wait; Gone says the sandbox was deleted. The zero value is not usable:
// make one with NewExitLatch.
type ExitLatch struct {
	done, gone         chan struct{}
	doneOnce, goneOnce sync.Once
	status             ExitStatus
}

// NewExitLatch returns a latch of a sandbox that has not ended.
func NewExitLatch() *ExitLatch {
	return &ExitLatch{done: make(chan struct{}), gone: make(chan struct{})}
}

// Finish records es as the sandbox's end unless one is recorded already.
func (l *ExitLatch) Finish(es ExitStatus) {
	l.doneOnce.Do(func() { l.status = es; close(l.done) })
}

// Gone marks the sandbox deleted.
func (l *ExitLatch) Gone() { l.goneOnce.Do(func() { close(l.gone) }) }

// Done is closed once the sandbox's end is recorded.
func (l *ExitLatch) Done() <-chan struct{} { return l.done }

// Ended says whether the end is recorded.
func (l *ExitLatch) Ended() bool {
	select {
	case <-l.done:
		return true
	default:
		return false
	}
}

// Status is the recorded end (the zero ExitStatus before Finish).
func (l *ExitLatch) Status() ExitStatus {
	if !l.Ended() {
		return ExitStatus{}
	}
	return l.status
}

// Wait is Runtime.Wait for sandbox id: the recorded end, at once when
// there is one; else it blocks until Finish, or until Gone: a deleted
// sandbox that ran (ran reports true; nil means never) still has its end
// to come from its watcher and is waited for, one that never ran is
// errdefs.ErrNotFound. ctx's end is returned as its cause.
func (l *ExitLatch) Wait(ctx context.Context, id string, ran func() bool) (ExitStatus, error) {
	select {
	case <-l.done:
		return l.status, nil
	default:
	}
	select {
	case <-l.done:
		return l.status, nil
	case <-l.gone:
		if ran != nil && ran() {
			select {
			case <-l.done:
				return l.status, nil
			case <-ctx.Done():
				return ExitStatus{}, fmt.Errorf("wait for sandbox %s: %w", id, context.Cause(ctx))
			}
		}
		if l.Ended() {
			return l.status, nil
		}
		return ExitStatus{}, errdefs.New(errdefs.ErrNotFound, "sandbox %q was deleted before it ran", id)
	case <-ctx.Done():
		return ExitStatus{}, fmt.Errorf("wait for sandbox %s: %w", id, context.Cause(ctx))
	}
}
