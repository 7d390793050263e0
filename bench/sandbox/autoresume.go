package main

import (
	"context"
	"fmt"
	"time"
)

// autoResumePhase times what an auto-resume adds to a call: exec `true`
// into a paused sandbox (the node resumes it first), against the same exec
// into the running sandbox and against an explicit ResumeSandbox followed
// by the exec, in interleaved rounds on one sandbox. The pauses between are
// not timed.
func (b *bench) autoResumePhase(ctx context.Context, r *report) error {
	if b.cfg.pauses == 0 {
		return nil
	}
	sb, _, err := b.create(ctx)
	if err != nil {
		return err
	}
	id := sb.GetId()
	if _, err := b.execTrue(ctx, id); err != nil {
		return err
	}
	pause := func() error {
		if _, err := b.client.PauseSandbox(ctx, id); err != nil {
			return fmt.Errorf("pause: %w", err)
		}
		return nil
	}
	for i := -b.cfg.warmup; i < b.cfg.pauses; i++ {
		running, err := b.execTrue(ctx, id)
		if err != nil {
			return err
		}
		if err := pause(); err != nil {
			return err
		}
		auto, err := b.execTrue(ctx, id) // resumes it
		if err != nil {
			return fmt.Errorf("exec into a paused sandbox: %w", err)
		}
		if err := pause(); err != nil {
			return err
		}
		t := time.Now()
		if _, err := b.client.ResumeSandbox(ctx, id, 0); err != nil {
			return fmt.Errorf("resume: %w", err)
		}
		if _, err := b.execTrue(ctx, id); err != nil {
			return err
		}
		explicit := time.Since(t)
		if i >= 0 {
			r.arRunning = append(r.arRunning, running)
			r.arAuto = append(r.arAuto, auto)
			r.arExplicit = append(r.arExplicit, explicit)
		}
	}
	return b.stop(ctx, id)
}
