package runtime

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// TestExitLatch: Wait returns the first recorded end (at once once there
// is one), not found for a sandbox deleted before it ran, waits for the
// end of one deleted after it ran, and ctx's cause.
func TestExitLatch(t *testing.T) {
	l := NewExitLatch()
	got := make(chan ExitStatus, 1)
	go func() { es, _ := l.Wait(context.Background(), "a", nil); got <- es }()
	l.Finish(ExitStatus{ExitCode: 3, Reason: "init exited"})
	l.Finish(ExitStatus{ExitCode: 9})
	if es := <-got; es.ExitCode != 3 || !l.Ended() || l.Status().ExitCode != 3 {
		t.Fatalf("wait: %+v, ended %v; want the first end (3)", es, l.Ended())
	}

	never := NewExitLatch()
	never.Gone()
	if _, err := never.Wait(context.Background(), "b", func() bool { return false }); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("wait on a sandbox deleted before it ran: %v; want not found", err)
	}

	ran := NewExitLatch()
	ran.Gone()
	go func() { es, _ := ran.Wait(context.Background(), "c", func() bool { return true }); got <- es }()
	select {
	case es := <-got:
		t.Fatalf("wait on a deleted sandbox that ran returned %+v before its end", es)
	case <-time.After(50 * time.Millisecond): // it must still be waiting
	}
	ran.Finish(ExitStatus{ExitCode: -1, Reason: "killed"})
	if es := <-got; es.Reason != "killed" {
		t.Fatalf("wait after the end: %+v", es)
	}

	ctx, cancel := context.WithCancelCause(context.Background())
	cause := errors.New("caller gave up")
	cancel(cause)
	if _, err := NewExitLatch().Wait(ctx, "d", nil); !errors.Is(err, cause) {
		t.Fatalf("wait with a canceled ctx: %v; want its cause", err)
	}
}
