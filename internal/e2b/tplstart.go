package e2b

import (
	"context"
	"encoding/base64"
	"errors"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// DefaultReadyTimeout bounds how long a create from a template with a
// start command waits for its ready command to succeed.
const DefaultReadyTimeout = 60 * time.Second

// readyPoll is the pause between two runs of a ready command.
const readyPoll = 200 * time.Millisecond

// startTemplateCmd runs a template's start command in the background in a
// new sandbox (as user, in workdir) and then its ready command until it
// exits 0: E2B starts both when the template is built and snapshots the
// running sandbox; OpenDsec's containers start them in every sandbox of
// the template, before the create returns.
func (g *Gateway) startTemplateCmd(ctx context.Context, id, user, workdir, start, ready string) error {
	// The node takes the gateway's node token, not the principal's.
	ctx = auth.WithBearer(ctx, "")
	node, err := g.nodes.ForSandbox(ctx, "sandbox_id", id)
	if err != nil {
		return err
	}
	pc := processconnect.NewProcessClient(node.HTTPClient(), node.AgentURL(id, "").String())
	run := func(ctx context.Context, cmd string, wait bool) (int32, error) {
		cfg := &process.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", cmd}}
		if workdir != "" {
			cfg.Cwd = proto.String(workdir)
		}
		req := connect.NewRequest(&process.StartRequest{Process: cfg, Stdin: proto.Bool(false)})
		if user != "" {
			req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
		}
		if !wait {
			req.Header().Set("Keepalive-Ping-Interval", "50")
		}
		st, err := pc.Start(ctx, req)
		if err != nil {
			return 0, err
		}
		defer st.Close()
		for st.Receive() {
			switch e := st.Msg().GetEvent().GetEvent().(type) {
			case *process.ProcessEvent_Start:
				if !wait {
					// It runs on when the stream closes.
					return 0, nil
				}
			case *process.ProcessEvent_End:
				return e.End.GetExitCode(), nil
			}
		}
		if err := st.Err(); err != nil {
			return 0, err
		}
		return 0, errors.New("the process stream ended without its exit")
	}
	if _, err := run(ctx, start, false); err != nil {
		// The node's or agent's words are not the caller's business.
		log.G(ctx).Warn("e2b: run a template's start command", log.SandboxID(id), log.Err(err))
		return errdefs.New(errdefs.ErrUnavailable, "the template's start command could not be started in the sandbox; try again")
	}
	if ready == "" {
		return nil
	}
	timeout := g.cfg.ReadyTimeout
	if timeout <= 0 {
		timeout = DefaultReadyTimeout
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last int32
	for {
		code, err := run(rctx, ready, true)
		if err == nil && code == 0 {
			return nil
		}
		if err == nil {
			last = code
		}
		select {
		case <-rctx.Done():
			return errdefs.New(errdefs.ErrDeadlineExceeded, "the template's ready command %q did not succeed within %s (last exit code %d)", ready, timeout, last)
		case <-time.After(readyPoll):
		}
	}
}
