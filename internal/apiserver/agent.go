package apiserver

import (
	"context"
	"encoding/base64"
	"net/http"

	"github.com/kernflux/opendsec/api/gen/filesystem/filesystemconnect"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/nodeclient"
)

// agent reaches one sandbox's agent through its node's proxy.
type agent struct {
	id   string
	node *nodeclient.Client
	proc processconnect.ProcessClient
	fs   filesystemconnect.FilesystemClient
}

func (s *Server) agentFor(ctx context.Context, id string) (*agent, error) {
	n, err := s.nodeFor(ctx, "sandbox_id", id)
	if err != nil {
		return nil, err
	}
	base := n.AgentURL(id, "").String()
	return &agent{
		id:   id,
		node: n,
		proc: processconnect.NewProcessClient(n.HTTPClient(), base),
		fs:   filesystemconnect.NewFilesystemClient(n.HTTPClient(), base),
	}, nil
}

// setUser selects the user the agent acts as (envd: Basic auth with the
// user name and an empty password). The node token then travels in
// auth.TokenHeader.
func setUser(h http.Header, user string) {
	if user != "" {
		h.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	}
}

// ctxErr returns ctx's cause when ctx ended, else err.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}

// agentErr maps the error of a call to the sandbox's agent
// (nodeclient.Client.AgentError).
func (a *agent) agentErr(ctx context.Context, what string, err error) error {
	return a.node.AgentError(ctx, a.id, what, err)
}
