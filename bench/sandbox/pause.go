package main

import (
	"context"
	"fmt"
	"time"
)

// pausePhase times PauseSandbox and ResumeSandbox through the public API
// against the least a pause can cost: a write of the cgroup freezer of a
// plain runc container (and the wait until the kernel says frozen), in
// interleaved rounds on one sandbox and one container.
func (b *bench) pausePhase(ctx context.Context, r *report) error {
	if b.cfg.pauses == 0 {
		return nil
	}
	sb, _, err := b.create(ctx)
	if err != nil {
		return err
	}
	id := sb.GetId()
	// The first exec makes sure the agent runs: a pause waits for it.
	if _, err := b.execTrue(ctx, id); err != nil {
		return err
	}
	c, err := b.base.prepare()
	if err != nil {
		return err
	}
	if _, err := b.base.run(ctx, c); err != nil {
		return err
	}
	cg := b.base.cgParent + "/" + c.id
	for i := -b.cfg.warmup; i < b.cfg.pauses; i++ {
		t := time.Now()
		if _, err := b.client.PauseSandbox(ctx, id); err != nil {
			return fmt.Errorf("pause: %w", err)
		}
		dp := time.Since(t)
		t = time.Now()
		if _, err := b.client.ResumeSandbox(ctx, id, 0); err != nil {
			return fmt.Errorf("resume: %w", err)
		}
		dr := time.Since(t)
		t = time.Now()
		if err := b.cg.freeze(cg, true); err != nil {
			return fmt.Errorf("freeze the baseline container: %w", err)
		}
		df := time.Since(t)
		t = time.Now()
		if err := b.cg.freeze(cg, false); err != nil {
			return fmt.Errorf("thaw the baseline container: %w", err)
		}
		dt := time.Since(t)
		if i >= 0 {
			r.pauseOurs = append(r.pauseOurs, dp)
			r.resumeOurs = append(r.resumeOurs, dr)
			r.freezeRaw = append(r.freezeRaw, df)
			r.thawRaw = append(r.thawRaw, dt)
		}
	}
	if err := b.stop(ctx, id); err != nil {
		return err
	}
	return b.base.remove(ctx, c)
}
