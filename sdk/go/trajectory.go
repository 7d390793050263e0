package opendsec

import (
	"context"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// TrajectoryEntry is one call of a sandbox's trajectory log (see
// docs/concepts.md "Trajectory log"). The first entry also carries the
// log's SandboxId and, for a fork, its ParentId.
type TrajectoryEntry = opendsecv1.TrajectoryEntry

// Trajectory returns sandbox id's trajectory log, oldest call first: every
// exec, file write and code-interpreter execution (Kind "exec",
// "file_write" or "code": Code, Language, ContextId, CodeError) with its
// call ID, request, times, exit (a write's or code call's HttpStatus) and recorded output (withOutput false leaves the output out). A stopped sandbox's
// log is kept for its node's node.trajectory.retention_sec.
func (c *Client) Trajectory(ctx context.Context, id string, withOutput bool) ([]*TrajectoryEntry, error) {
	stream, err := c.processes.GetTrajectory(ctx, connect.NewRequest(&opendsecv1.GetTrajectoryRequest{SandboxId: id, WithoutOutput: !withOutput}))
	if err != nil {
		return nil, convertError(err)
	}
	defer stream.Close()
	var out []*TrajectoryEntry
	for stream.Receive() {
		out = append(out, stream.Msg())
	}
	if err := stream.Err(); err != nil {
		return nil, convertError(err)
	}
	return out, nil
}
