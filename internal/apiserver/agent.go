package apiserver

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/filesystem/filesystemconnect"
	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// agent reaches one sandbox's agent through its node's proxy.
type agent struct {
	id   string
	node *nodeConn
	base string // <node>/agent/<id>
	proc processconnect.ProcessClient
	fs   filesystemconnect.FilesystemClient
}

func (s *Server) agentFor(id string) (*agent, error) {
	n, err := s.nodeFor("sandbox_id", id)
	if err != nil {
		return nil, err
	}
	base := n.address + "/agent/" + id
	return &agent{
		id:   id,
		node: n,
		base: base,
		proc: processconnect.NewProcessClient(s.hc, base),
		fs:   filesystemconnect.NewFilesystemClient(s.hc, base),
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

// httpErr turns a non-success answer of the agent or the node's proxy
// (JSON {"code", "message"} or plain text) into a categorized error with
// the remote message.
func httpErr(resp *http.Response, what string) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var body struct {
		Message string `json:"message"`
		// Status is the node's connect code name for the category.
		Status string `json:"status"`
	}
	msg := ""
	if json.Unmarshal(b, &body) == nil && body.Message != "" {
		msg = body.Message
	} else {
		msg = strings.TrimSpace(string(b))
	}
	if msg == "" {
		msg = what + ": " + resp.Status
	}
	var code connect.Code
	if body.Status != "" && code.UnmarshalText([]byte(body.Status)) == nil {
		return errdefs.FromConnect(connect.NewError(code, errors.New(msg)))
	}
	var cat error
	switch resp.StatusCode {
	case http.StatusBadRequest:
		cat = errdefs.ErrInvalidArgument
	case http.StatusUnauthorized:
		cat = errdefs.ErrUnauthenticated
	case http.StatusForbidden:
		cat = errdefs.ErrPermissionDenied
	case http.StatusNotFound:
		cat = errdefs.ErrNotFound
	case http.StatusConflict:
		cat = errdefs.ErrAlreadyExists
	case http.StatusRequestEntityTooLarge, http.StatusTooManyRequests, http.StatusInsufficientStorage:
		cat = errdefs.ErrResourceExhausted
	case http.StatusBadGateway, http.StatusServiceUnavailable:
		cat = errdefs.ErrUnavailable
	case http.StatusGatewayTimeout:
		cat = errdefs.ErrDeadlineExceeded
	case http.StatusNotImplemented:
		cat = errdefs.ErrUnimplemented
	default:
		cat = errdefs.ErrInternal
	}
	return errdefs.New(cat, "%s", msg)
}

// ctxErr returns ctx's cause when ctx ended, else err.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}

// agentErr is remoteErr for calls to a sandbox's agent. The node's proxy
// answers 404 for a sandbox it does not have, which a Connect client sees
// as "unimplemented: HTTP status 404".
func (a *agent) agentErr(ctx context.Context, what string, err error) error {
	if connect.CodeOf(err) == connect.CodeUnimplemented && strings.Contains(err.Error(), "404") {
		return errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", a.id)
	}
	// A streaming Connect client drops the body of a non-200 answer, so a
	// proxy refusal (400) arrives without its reason. The one the node gives
	// is a paused sandbox; ask the node (only on this error path).
	if c := connect.CodeOf(err); (c == connect.CodeInternal || c == connect.CodeUnknown || c == connect.CodeInvalidArgument) &&
		strings.Contains(err.Error(), "HTTP status 400") && a.node != nil && ctx.Err() == nil {
		resp, gerr := a.node.client.GetSandbox(ctx, connect.NewRequest(&nodev1.GetSandboxRequest{SandboxId: a.id}))
		if gerr == nil && resp.Msg.GetSandbox().GetState() == v1.SandboxState_SANDBOX_STATE_PAUSED {
			return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is paused; resume it first", a.id)
		}
	}
	return remoteErr(ctx, what, err)
}
