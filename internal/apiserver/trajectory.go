package apiserver

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// maxTrajectoryLine bounds one line of the node's log stream: one call with
// both streams at the largest output cap (1 GiB KiB-capped), base64'd.
const maxTrajectoryLine = 64 << 20

// GetTrajectory streams a sandbox's trajectory log from its node (which
// checks the caller owns the sandbox, also once it stopped).
func (s *Server) GetTrajectory(ctx context.Context, req *connect.Request[v1.GetTrajectoryRequest], stream *connect.ServerStream[v1.TrajectoryEntry]) error {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	u := a.node.AgentURL(a.id, "/"+trajectory.Path)
	if req.Msg.GetWithoutOutput() {
		u.RawQuery = "output=0"
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return fmt.Errorf("trajectory request: %w", err)
	}
	resp, err := a.node.HTTPClient().Do(hreq)
	if err != nil {
		return ctxErr(ctx, errdefs.New(errdefs.ErrUnavailable, "read trajectory log: %s", err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nodeclient.MapResponse(resp, "read trajectory log")
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), maxTrajectoryLine)
	var meta trajectory.Meta
	first := true
	for sc.Scan() {
		var line trajectory.Line
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			return errdefs.New(errdefs.ErrUnavailable, "read trajectory log: bad line from the node: %w", err)
		}
		if line.Meta != nil {
			meta = *line.Meta
			continue
		}
		if line.Call == nil {
			continue
		}
		e := TrajectoryEntryOf(line.Call)
		if first {
			e.SandboxId, e.ParentId, e.ParentSeq = meta.SandboxID, meta.ParentID, meta.ForkSeq
			first = false
		}
		if err := stream.Send(e); err != nil {
			return err
		}
	}
	if err := sc.Err(); err != nil {
		return ctxErr(ctx, errdefs.New(errdefs.ErrUnavailable, "read trajectory log: %s", err))
	}
	if first && meta.SandboxID != "" {
		// An empty log still says whose it is.
		return stream.Send(&v1.TrajectoryEntry{SandboxId: meta.SandboxID, ParentId: meta.ParentID, ParentSeq: meta.ForkSeq})
	}
	return nil
}

// TrajectoryEntryOf is a call of the log in the public API's message.
func TrajectoryEntryOf(c *trajectory.Call) *v1.TrajectoryEntry {
	e := &v1.TrajectoryEntry{
		Seq: c.Seq, CallId: c.CallID, Kind: c.Req.Kind, State: c.State, Origin: c.Origin,
		Command: c.Req.Command, Env: c.Req.Env, Cwd: c.Req.Cwd, User: c.Req.User,
		Path: c.Req.Path, Sha256: c.Req.SHA256, Size: c.Req.Size, TimeoutMs: c.Req.TimeoutMs,
		Pid: c.Pid, ExitCode: c.ExitCode, Status: c.Status, ErrorCode: c.ErrCode, Error: c.ErrMsg,
		StdoutTotalBytes: c.StdoutBytes, StderrTotalBytes: c.StderrBytes,
		OutputTruncated: c.Truncated, OutputCompacted: c.Compacted,
	}
	if c.Req.Kind == trajectory.KindCode {
		e.Code, e.Language, e.ContextId, e.HttpStatus = c.Req.Code, c.Req.Language, c.Req.ContextID, int32(c.HTTPStatus)
		if c.Status == "error" {
			e.CodeError = c.ExitErr
		}
		e.Stdout = append(e.Stdout, c.Body...)
	}
	if c.Req.Kind == trajectory.KindFileWrite {
		e.HttpStatus = int32(c.HTTPStatus)
		e.Stdout = append(e.Stdout, c.Body...)
		for _, f := range c.Req.Files {
			e.Files = append(e.Files, &v1.TrajectoryFile{Path: f.Path, Sha256: f.SHA256, Size: f.Size})
		}
	}
	if !c.Started.IsZero() {
		e.Started = timestamppb.New(c.Started)
	}
	if !c.Ended.IsZero() {
		e.Ended = timestamppb.New(c.Ended)
	}
	if c.ExitErr != "" && e.Status == "" && c.Req.Kind != trajectory.KindCode {
		e.Status = c.ExitErr
	}
	for _, ch := range c.Output {
		switch ch.Stream {
		case trajectory.Stderr:
			e.Stderr = append(e.Stderr, ch.Data...)
		case trajectory.PTY:
			e.Pty = append(e.Pty, ch.Data...)
		default:
			e.Stdout = append(e.Stdout, ch.Data...)
		}
	}
	return e
}
