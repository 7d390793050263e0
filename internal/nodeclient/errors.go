package nodeclient

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

// MapError turns the error of a call to a node or to an agent through it
// (what names the call, e.g. "stop sandbox") into a categorized error
// carrying the remote message: a Connect error keeps its code's category,
// an error already categorized (a ResponseError, say) stays as it is, and
// anything else (the node could not be reached) is unavailable. When ctx
// ended, its cause is returned instead.
func MapError(ctx context.Context, what string, err error) error {
	if err == nil {
		return nil
	}
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		if ce.Code() == connect.CodeUnavailable || ce.Code() == connect.CodeUnknown {
			log.G(ctx).Debug("remote call failed", slog.String("call", what), log.Err(err))
		}
		return errdefs.FromConnect(err)
	}
	if errdefs.Code(err) != connect.CodeUnknown {
		return err
	}
	return errdefs.New(errdefs.ErrUnavailable, "%s: %s", what, err)
}

// ResponseError is a non-success HTTP answer of a node or of an agent
// through it. Its category is the connect code the node named (its JSON
// "status"), else the one of the HTTP status.
type ResponseError struct {
	// StatusCode is the HTTP status of the answer.
	StatusCode int
	// Message is the remote message (JSON "message", else the body's
	// text, else what failed and the status).
	Message string
	cat     error
	died    *errdefs.DiedError // the node said the sandbox died
}

func (e *ResponseError) Error() string { return e.Message }

// Unwrap returns the category (an errdefs.Err... value) and, when the
// node said the sandbox died, an *errdefs.DiedError.
func (e *ResponseError) Unwrap() []error {
	if e.died != nil {
		return []error{e.cat, e.died}
	}
	return []error{e.cat}
}

// MapResponse reads a non-success answer (resp's body, at most 64 KiB; the
// caller still closes it) into a *ResponseError. what names the call for an
// answer without a message. The node answers {"code", "message", "status"}
// (status: the connect code name, which tells categories that share an
// HTTP status apart); envd answers {"code", "message"}; anything else is
// taken as text.
func MapResponse(resp *http.Response, what string) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var body struct {
		Message string `json:"message"`
		Status  string `json:"status"`
		Died    string `json:"died"`
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
	e := &ResponseError{StatusCode: resp.StatusCode, Message: msg, cat: statusCategory(resp.StatusCode)}
	var code connect.Code
	if body.Status != "" && code.UnmarshalText([]byte(body.Status)) == nil {
		e.cat = codeCategory(code)
	}
	if body.Died != "" {
		e.died = &errdefs.DiedError{Reason: body.Died}
	}
	return e
}

// statusCategory is the category of an HTTP status.
func statusCategory(status int) error {
	switch status {
	case http.StatusBadRequest:
		return errdefs.ErrInvalidArgument
	case http.StatusUnauthorized:
		return errdefs.ErrUnauthenticated
	case http.StatusForbidden:
		return errdefs.ErrPermissionDenied
	case http.StatusNotFound:
		return errdefs.ErrNotFound
	case http.StatusConflict:
		return errdefs.ErrAlreadyExists
	case http.StatusRequestEntityTooLarge, http.StatusTooManyRequests, http.StatusInsufficientStorage:
		return errdefs.ErrResourceExhausted
	case http.StatusBadGateway, http.StatusServiceUnavailable:
		return errdefs.ErrUnavailable
	case http.StatusGatewayTimeout:
		return errdefs.ErrDeadlineExceeded
	case http.StatusNotImplemented:
		return errdefs.ErrUnimplemented
	default:
		return errdefs.ErrInternal
	}
}

// codeCategory is the category of a connect code.
func codeCategory(code connect.Code) error {
	return errdefs.CodeCategory(code)
}

// AgentError is MapError for calls to sandbox sandboxID's agent through
// this node, which answers some failures in ways a Connect client cannot
// read: a sandbox it does not have is a 404, which the client reports as
// "unimplemented: HTTP status 404"; and a streaming client drops the body
// of a 400, so a paused sandbox arrives without its reason (then the node
// is asked for the sandbox's state). A sandbox that died is an
// *errdefs.DiedError with the node's reason: from the node's answer, or,
// for a failure that may be its death (a stream cut), from its state.
func (c *Client) AgentError(ctx context.Context, sandboxID, what string, err error) error {
	if connect.CodeOf(err) == connect.CodeUnimplemented && strings.Contains(err.Error(), "404") {
		return errdefs.New(errdefs.ErrNotFound, "sandbox %s not found", sandboxID)
	}
	var de *errdefs.DiedError
	if errors.As(err, &de) {
		return MapError(ctx, what, err)
	}
	// The node's answer for a sandbox that died carries the reason in a
	// header, which a Connect client keeps in the error's metadata.
	var ce *connect.Error
	if errors.As(err, &ce) {
		if reason := ce.Meta().Get(errdefs.DiedMetadataKey); reason != "" {
			return errdefs.SandboxDied(sandboxID, reason)
		}
	}
	code := connect.CodeOf(err)
	status400 := (code == connect.CodeInternal || code == connect.CodeUnknown || code == connect.CodeInvalidArgument) &&
		(strings.Contains(err.Error(), "HTTP status 400") || strings.Contains(err.Error(), "400 Bad Request"))
	// A call that failed as one into a dead sandbox does (the node's 400,
	// or a stream cut when its init died) asks the node whether it died.
	if (status400 || code == connect.CodeUnavailable || code == connect.CodeUnknown || code == connect.CodeFailedPrecondition) && ctx.Err() == nil {
		resp, gerr := c.node.GetSandbox(ctx, connect.NewRequest(&nodev1.GetSandboxRequest{SandboxId: sandboxID}))
		if gerr == nil {
			switch sb := resp.Msg.GetSandbox(); sb.GetState() {
			case nodev1.SandboxState_SANDBOX_STATE_PAUSED:
				if status400 {
					return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is paused; resume it first", sandboxID)
				}
			case nodev1.SandboxState_SANDBOX_STATE_FAILED:
				if reason, ok := strings.CutPrefix(sb.GetReason(), "died: "); ok {
					return errdefs.SandboxDied(sandboxID, reason)
				}
			}
		}
	}
	return MapError(ctx, what, err)
}
