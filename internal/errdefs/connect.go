package errdefs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/http"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/internal/log"
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
// The outermost category wins: New(ErrUnavailable, "...: %w", notFound) is
// unavailable.
func Code(err error) connect.Code {
	code, _ := codeOf(err)
	return code
}

// codeOf walks err's chain depth first, outermost first, and returns the
// code of the first category it meets.
func codeOf(err error) (connect.Code, bool) {
	if err == nil {
		return connect.CodeUnknown, false
	}
	switch e := err.(type) {
	case *connect.Error:
		return e.Code(), true
	case *categorized:
		return codeOf(e.cat)
	case *FieldError:
		return connect.CodeInvalidArgument, true
	}
	for _, r := range table {
		if err == r.cat {
			return r.code, true
		}
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return codeOf(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if c, ok := codeOf(e); ok {
				return c, true
			}
		}
	}
	return connect.CodeUnknown, false
}

// HTTPStatus returns the HTTP status for err's category (500 if none).
func HTTPStatus(err error) int { return statusOf(Code(err)) }

func statusOf(c connect.Code) int {
	for _, r := range table {
		if r.code == c {
			return r.http
		}
	}
	return http.StatusInternalServerError
}

// PublicMessage is what a caller is told about err. It is the outermost
// public message in err's chain (WithPublic, or an answer from a remote
// component); else, for an error without a category or an internal one, a
// generic text with a reference (the detail can hold host paths and backend
// output, and goes to the server's log with the same reference); else
// err's text, which categorized errors write for callers.
func PublicMessage(err error) string {
	msg, _ := public(err)
	return msg
}

// public returns PublicMessage(err) and whether it differs from err's own
// text (so the detail is worth logging).
func public(err error) (string, bool) {
	if err == nil {
		return "", false
	}
	if msg, ok := publicIn(err); ok {
		return msg, msg != err.Error()
	}
	switch Code(err) {
	case connect.CodeUnknown, connect.CodeInternal:
		return "internal error (ref " + newRef() + "); the server's log has the detail", true
	}
	return err.Error(), false
}

func publicIn(err error) (string, bool) {
	switch e := err.(type) {
	case *publicError:
		return e.msg, true
	case *categorized:
		if e.public {
			return e.msg, true
		}
	case *connect.Error:
		// An answer from another component: already public.
		return e.Message(), true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		if inner := u.Unwrap(); inner != nil {
			return publicIn(inner)
		}
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if msg, ok := publicIn(e); ok {
				return msg, true
			}
		}
	}
	return "", false
}

func newRef() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	return hex.EncodeToString(b)
}

// edgeError is what a server answers: its text is the public message, and
// it wraps the whole error for the server's log and errors.Is/As.
type edgeError struct {
	msg string
	err error
}

func (e *edgeError) Error() string { return e.msg }
func (e *edgeError) Unwrap() error { return e.err }

// Detail returns the internal text of an error a server answered with (the
// whole error's text, for its log) and whether it differs from the public
// message the caller got.
func Detail(err error) (string, bool) {
	var ee *edgeError
	if errors.As(err, &ee) {
		return ee.err.Error(), ee.err.Error() != ee.msg
	}
	return "", false
}

// ToConnect converts err for a Connect/gRPC server response: its category's
// code and its public message (PublicMessage). The internal detail stays
// inside (errors.Unwrap, Detail) for the server's log; it is not sent.
// A *connect.Error is returned as is (it already is an answer); one
// wrapped in more context gets that context in its message.
func ToConnect(err error) error {
	if err == nil {
		return nil
	}
	if ce, ok := err.(*connect.Error); ok {
		return ce
	}
	msg, _ := public(err)
	return networkOffMeta(diedMeta(connect.NewError(Code(err), &edgeError{msg: msg, err: err}), err), err)
}

// ToHTTP converts err for an HTTP answer, as the Interceptor does for
// Connect: its status and public message; the internal detail, when the
// message leaves it out, goes to ctx's log.
func ToHTTP(ctx context.Context, err error) (status int, msg string) {
	if err == nil {
		return http.StatusOK, ""
	}
	msg, hidden := public(err)
	if hidden {
		log.G(ctx).Warn("request failed", "answer", msg, "err", err.Error())
	}
	return HTTPStatus(err), msg
}

// FromConnect turns a Connect error from a remote component back into a
// categorized error with the remote message, so it can be re-served as is.
// The Connect error stays its cause (errors.As finds it).
func FromConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	causes := []error{ce}
	if de, ok := diedFrom(ce); ok {
		causes = append(causes, de)
	}
	if ne, ok := networkOffFrom(ce); ok {
		causes = append(causes, ne)
	}
	for _, r := range table {
		if r.code == ce.Code() {
			return &categorized{cat: r.cat, msg: ce.Message(), causes: causes, public: true}
		}
	}
	return &categorized{cat: ErrInternal, msg: ce.Message(), causes: causes, public: true}
}

// CodeCategory returns the category of a Connect code (ErrInternal for a
// code no category has).
func CodeCategory(c connect.Code) error {
	for _, r := range table {
		if r.code == c {
			return r.cat
		}
	}
	return ErrInternal
}
