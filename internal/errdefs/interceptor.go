package errdefs

import (
	"context"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/internal/log"
)

// Interceptor maps every error a Connect handler returns once, at the
// server edge: ToConnect (the category's code and the public message), and
// the internal detail, when the answer leaves it out, to the request's log.
// Handlers return plain categorized errors; one that is already a
// *connect.Error passes through (its detail is still logged).
func Interceptor() connect.Interceptor { return interceptor{} }

type interceptor struct{}

func (interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		if err != nil {
			return resp, answer(ctx, req.Spec().Procedure, err)
		}
		return resp, nil
	}
}

func (interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if err := next(ctx, conn); err != nil {
			return answer(ctx, conn.Spec().Procedure, err)
		}
		return nil
	}
}

func answer(ctx context.Context, procedure string, err error) error {
	ce := ToConnect(err)
	if detail, hidden := Detail(ce); hidden {
		log.G(ctx).Warn("request failed", "procedure", procedure, "answer", PublicMessage(ce), "err", detail)
	}
	return ce
}
