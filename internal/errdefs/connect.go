package errdefs

import (
	"context"
	"errors"
	"net/http"

	"connectrpc.com/connect"
)

var table = []struct {
	cat  error
	code connect.Code
	http int
}{
	{ErrInvalidArgument, connect.CodeInvalidArgument, http.StatusBadRequest},
	{ErrNotFound, connect.CodeNotFound, http.StatusNotFound},
	{ErrAlreadyExists, connect.CodeAlreadyExists, http.StatusConflict},
	{ErrFailedPrecondition, connect.CodeFailedPrecondition, http.StatusBadRequest},
	{ErrResourceExhausted, connect.CodeResourceExhausted, http.StatusTooManyRequests},
	{ErrUnavailable, connect.CodeUnavailable, http.StatusServiceUnavailable},
	{ErrDeadlineExceeded, connect.CodeDeadlineExceeded, http.StatusGatewayTimeout},
	{ErrUnauthenticated, connect.CodeUnauthenticated, http.StatusUnauthorized},
	{ErrPermissionDenied, connect.CodePermissionDenied, http.StatusForbidden},
	{ErrUnimplemented, connect.CodeUnimplemented, http.StatusNotImplemented},
	{ErrCanceled, connect.CodeCanceled, 499},
	{ErrInternal, connect.CodeInternal, http.StatusInternalServerError},
	{context.DeadlineExceeded, connect.CodeDeadlineExceeded, http.StatusGatewayTimeout},
	{context.Canceled, connect.CodeCanceled, 499},
}

// Code returns the Connect code for err's category (CodeUnknown if none).
func Code(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	for _, r := range table {
		if errors.Is(err, r.cat) {
			return r.code
		}
	}
	return connect.CodeUnknown
}

// HTTPStatus returns the HTTP status for err's category (500 if none).
func HTTPStatus(err error) int {
	c := Code(err)
	for _, r := range table {
		if r.code == c {
			return r.http
		}
	}
	return http.StatusInternalServerError
}

// ToConnect converts err for a Connect/gRPC server response. The message is
// the error text, which is written to be shown to callers.
func ToConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	return connect.NewError(Code(err), err)
}

// FromConnect turns a Connect error from a remote component back into a
// categorized error with the remote message, so it can be re-served as is.
func FromConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	for _, r := range table {
		if r.code == ce.Code() {
			return &categorized{cat: r.cat, msg: ce.Message()}
		}
	}
	return &categorized{cat: ErrInternal, msg: ce.Message()}
}
