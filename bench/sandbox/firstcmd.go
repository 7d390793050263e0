package main

import (
	"bytes"
	"context"
	"fmt"
	"time"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// firstCommandPhase: time to the first command, the three kinds
// interleaved as in createPhase. Ours: CreateSandbox + the first
// Exec(["true"]) + Wait, from the create call to the exit code. Baseline:
// `runc run --detach` + `runc exec <id> true`. Our create returns before
// the agent has answered (its socket listens before the sandbox starts and
// the first request waits in the backlog), so this shows whether that cost
// reappears in the first exec.
func (b *bench) firstCommandPhase(ctx context.Context, r *report) error {
	n := b.cfg.firstCommand
	for i := -b.cfg.warmup; i < n; i++ {
		var total, first [numKinds]time.Duration // first: create / runc run
		hit := false
		for _, k := range roundOrder(i) {
			if err := b.settle(ctx); err != nil {
				return err
			}
			switch k {
			case kindPool, kindCold:
				sb, tt, cd, err := b.createAndExec(ctx, k == kindCold)
				if sb != nil {
					if serr := b.stop(ctx, sb.GetId()); err == nil {
						err = serr
					}
				}
				if err != nil {
					return err
				}
				total[k], first[k] = tt, cd
				if k == kindPool {
					hit = sb.GetFromWarmPool()
				} else if sb.GetFromWarmPool() {
					return fmt.Errorf("sandbox %s: a create with skip_warm_pool reports from_warm_pool", sb.GetId())
				}
			case kindRunc:
				c, err := b.base.prepare()
				if err != nil {
					return err
				}
				rd, err := b.base.run(ctx, c)
				if err != nil {
					return err
				}
				ed, err := b.base.exec(ctx, c)
				if err != nil {
					return err
				}
				total[k], first[k] = rd+ed, rd
				if err := b.base.remove(ctx, c); err != nil {
					return err
				}
			}
		}
		if i < 0 {
			continue
		}
		r.fcPool.add(total[kindPool], hit)
		r.fcCold = append(r.fcCold, total[kindCold])
		r.fcRunc = append(r.fcRunc, total[kindRunc])
		for k := range numKinds {
			r.fcFirst[k] = append(r.fcFirst[k], first[k])
			r.fcExec[k] = append(r.fcExec[k], total[k]-first[k])
		}
		if (i+1)%10 == 0 {
			b.logf("  %d/%d rounds: last pool %s ms (hit %t), cold %s ms, runc run+exec %s ms",
				i+1, n, ms(total[kindPool]), hit, ms(total[kindCold]), ms(total[kindRunc]))
		}
	}
	return nil
}

// createAndExec creates a sandbox (cold: skip_warm_pool) and runs `true` in
// it. It returns the sandbox (also on a failed exec, for the caller to stop),
// the time from the create call to the exit code, and the create's share.
func (b *bench) createAndExec(ctx context.Context, cold bool) (*opendsec.Sandbox, time.Duration, time.Duration, error) {
	start := time.Now()
	sb, err := b.client.CreateSandboxWith(ctx, b.spec(), opendsec.CreateOptions{SkipWarmPool: cold})
	cd := time.Since(start)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("create sandbox: %w", err)
	}
	var out bytes.Buffer
	p, err := b.client.Exec(ctx, sb.GetId(), opendsec.ExecOptions{Command: []string{"true"}, Stdout: &out, Stderr: &out})
	if err != nil {
		return sb, 0, 0, fmt.Errorf("first exec true in %s: %w", sb.GetId(), err)
	}
	st, err := p.Wait()
	total := time.Since(start)
	if err != nil {
		return sb, 0, 0, fmt.Errorf("first exec true in %s: %w", sb.GetId(), err)
	}
	if err := b.track(sb); err != nil {
		return sb, 0, 0, err
	}
	if st.ExitCode != 0 {
		return sb, 0, 0, fmt.Errorf("first exec true in %s: %s: %q", sb.GetId(), st.Status, out.String())
	}
	return sb, total, cd, nil
}
