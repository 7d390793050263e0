package opendsec

import (
	"bytes"
	"context"
	"fmt"
)

// ReplayDifference is one replayed call whose result differs from the
// log's: the first differing Field ("exit_code", "stdout" or "stderr") with
// both values (exit codes as decimal text).
type ReplayDifference struct {
	Seq                uint64
	CallID             string
	Command            []string
	Field              string
	Recorded, Replayed string
}

// ReplayReport is what Replay found: the sandbox it made, how many exec
// calls it ran and skipped (file writes, code calls, interrupted or running
// calls), and every call that differed, in log order (Differences[0] is the
// first).
type ReplayReport struct {
	SandboxID   string
	Calls       int
	Skipped     int
	Differences []ReplayDifference
}

// ReplayOptions: Spec makes the fresh sandbox (an image or a snapshot);
// Keep leaves it running afterwards (else it is stopped).
type ReplayOptions struct {
	Spec *SandboxSpec
	Keep bool
}

// Replay re-runs a trajectory log's exec calls (entries from Trajectory,
// with output) in order in a fresh sandbox made from opts.Spec, and compares
// each call's exit code, stdout and stderr with the log's: a determinism
// check for environments. Output the log did not keep whole (truncated or
// compacted) is compared by exit code only. Calls inherited from a fork's
// parent are replayed too. See docs/concepts.md "Trajectory log".
func (c *Client) Replay(ctx context.Context, entries []*TrajectoryEntry, opts ReplayOptions) (rep *ReplayReport, err error) {
	if opts.Spec == nil {
		return nil, invalid("spec", "is required; give the image or snapshot to replay in")
	}
	sb, err := c.CreateSandbox(ctx, opts.Spec)
	if err != nil {
		return nil, err
	}
	rep = &ReplayReport{SandboxID: sb.GetId()}
	defer func() {
		if !opts.Keep {
			if serr := c.StopSandbox(context.WithoutCancel(ctx), sb.GetId()); serr != nil && err == nil {
				err = fmt.Errorf("stop the replay sandbox %s: %w", sb.GetId(), serr)
			}
		}
	}()
	for _, e := range entries {
		kind := e.GetKind()
		if kind != "" && kind != "exec" || e.GetState() != "done" || len(e.GetCommand()) == 0 {
			rep.Skipped++
			continue
		}
		rep.Calls++
		var stdout, stderr bytes.Buffer
		p, err := c.Exec(ctx, sb.GetId(), ExecOptions{Command: e.GetCommand(), Env: e.GetEnv(), Cwd: e.GetCwd(), User: e.GetUser(),
			Stdout: &stdout, Stderr: &stderr})
		if err != nil {
			return rep, fmt.Errorf("replay call %d (%s): %w", e.GetSeq(), e.GetCallId(), err)
		}
		st, err := p.Wait()
		if err != nil {
			return rep, fmt.Errorf("replay call %d (%s): %w", e.GetSeq(), e.GetCallId(), err)
		}
		whole := !e.GetOutputTruncated() && !e.GetOutputCompacted()
		diff := func(field, rec, got string) bool {
			if rec == got {
				return false
			}
			rep.Differences = append(rep.Differences, ReplayDifference{Seq: e.GetSeq(), CallID: e.GetCallId(),
				Command: e.GetCommand(), Field: field, Recorded: rec, Replayed: got})
			return true
		}
		if diff("exit_code", fmt.Sprint(e.GetExitCode()), fmt.Sprint(st.ExitCode)) || !whole {
			continue
		}
		if !diff("stdout", string(e.GetStdout()), stdout.String()) {
			diff("stderr", string(e.GetStderr()), stderr.String())
		}
	}
	return rep, nil
}
