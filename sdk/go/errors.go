package opendsec

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"
)

// Code is an error category, the same codes gRPC and Connect use.
type Code = connect.Code

// The codes OpenDsec returns.
const (
	CodeCanceled           = connect.CodeCanceled
	CodeUnknown            = connect.CodeUnknown
	CodeInvalidArgument    = connect.CodeInvalidArgument
	CodeDeadlineExceeded   = connect.CodeDeadlineExceeded
	CodeNotFound           = connect.CodeNotFound
	CodeAlreadyExists      = connect.CodeAlreadyExists
	CodePermissionDenied   = connect.CodePermissionDenied
	CodeResourceExhausted  = connect.CodeResourceExhausted
	CodeFailedPrecondition = connect.CodeFailedPrecondition
	CodeUnimplemented      = connect.CodeUnimplemented
	CodeInternal           = connect.CodeInternal
	CodeUnavailable        = connect.CodeUnavailable
	CodeUnauthenticated    = connect.CodeUnauthenticated
)

// Error is an error reported by the OpenDsec API (or found by this client
// before sending, for bad arguments). Message is written for people and, for
// invalid arguments, names the field and the fix.
type Error struct {
	Code    Code
	Message string
	// DiedReason is set when the call went into a sandbox that died (its
	// init ended without a stop: a crash, a kill from outside, the OOM
	// killer): the reason, e.g. "killed by signal 9". Code is then
	// CodeFailedPrecondition, and errors.Is(err, ErrSandboxDied) holds.
	DiedReason string
	cause      error
}

// ErrSandboxDied matches (errors.Is) an error of a call into a sandbox that
// died; Error.DiedReason (or SandboxDied) says why. The sandbox is gone:
// create a new one.
var ErrSandboxDied = errors.New("sandbox died")

// diedMetadataKey is the answer metadata that marks a sandbox that died
// (the server's errdefs.DiedMetadataKey).
const diedMetadataKey = "Opendsec-Sandbox-Died"

// Is reports whether target is ErrSandboxDied and e says the sandbox died.
func (e *Error) Is(target error) bool { return target == ErrSandboxDied && e.DiedReason != "" }

// SandboxDied returns why the sandbox of a failed call died, and whether it did.
func SandboxDied(err error) (reason string, ok bool) {
	var e *Error
	if errors.As(err, &e) && e.DiedReason != "" {
		return e.DiedReason, true
	}
	return "", false
}

// Error returns "<code>: <message>".
func (e *Error) Error() string {
	if e.Message == "" {
		return e.Code.String()
	}
	return e.Code.String() + ": " + e.Message
}

// Unwrap returns the underlying transport error, if any, so errors.Is works
// with context.Canceled and context.DeadlineExceeded.
func (e *Error) Unwrap() error { return e.cause }

// invalid returns a client-side invalid-argument error naming field.
func invalid(field, format string, args ...any) *Error {
	return &Error{Code: CodeInvalidArgument, Message: field + ": " + fmt.Sprintf(format, args...)}
}

// convertError turns a Connect error into an *Error; other errors pass as is.
func convertError(err error) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return &Error{Code: ce.Code(), Message: ce.Message(), DiedReason: ce.Meta().Get(diedMetadataKey), cause: err}
	}
	switch {
	case errors.Is(err, context.Canceled):
		return &Error{Code: CodeCanceled, Message: err.Error(), cause: err}
	case errors.Is(err, context.DeadlineExceeded):
		return &Error{Code: CodeDeadlineExceeded, Message: err.Error(), cause: err}
	}
	return err
}

// CodeOf returns err's code: the Code of an *Error in its chain, else
// CodeUnknown. It returns 0 for a nil error.
func CodeOf(err error) Code {
	if err == nil {
		return 0
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	return CodeUnknown
}

// IsNotFound reports whether err says the sandbox, file or process does not exist.
func IsNotFound(err error) bool { return CodeOf(err) == CodeNotFound }

// IsInvalidArgument reports whether err says an argument was bad.
func IsInvalidArgument(err error) bool { return CodeOf(err) == CodeInvalidArgument }

// IsAlreadyExists reports whether err says the thing to create exists.
func IsAlreadyExists(err error) bool { return CodeOf(err) == CodeAlreadyExists }

// IsUnauthenticated reports whether err says the token is missing, unknown or expired.
func IsUnauthenticated(err error) bool { return CodeOf(err) == CodeUnauthenticated }

// IsPermissionDenied reports whether err says the token may not do this.
func IsPermissionDenied(err error) bool { return CodeOf(err) == CodePermissionDenied }

// IsResourceExhausted reports whether err says a quota or capacity was exceeded.
func IsResourceExhausted(err error) bool { return CodeOf(err) == CodeResourceExhausted }

// IsUnavailable reports whether err says the server (or a node) could not be reached.
func IsUnavailable(err error) bool { return CodeOf(err) == CodeUnavailable }

// IsDeadlineExceeded reports whether err says a deadline passed.
func IsDeadlineExceeded(err error) bool { return CodeOf(err) == CodeDeadlineExceeded }

// IsFailedPrecondition reports whether err says the sandbox is in the wrong
// state for the call (e.g. stopped).
func IsFailedPrecondition(err error) bool { return CodeOf(err) == CodeFailedPrecondition }
