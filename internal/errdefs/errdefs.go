// Package errdefs defines the error categories every OpenDsec component uses.
// Errors are wrapped with %w as they travel up and are mapped to Connect/gRPC
// and HTTP codes only at the server edge (ToConnect, HTTPStatus), and back to
// categories in clients (FromConnect).
package errdefs

import (
	"errors"
	"fmt"
)

// The categories. Wrap them, never compare error strings.
var (
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrUnavailable        = errors.New("unavailable")
	ErrDeadlineExceeded   = errors.New("deadline exceeded")
	ErrUnauthenticated    = errors.New("unauthenticated")
	ErrPermissionDenied   = errors.New("permission denied")
	ErrUnimplemented      = errors.New("unimplemented")
	ErrInternal           = errors.New("internal")
	ErrCanceled           = errors.New("canceled")
)

// FieldError is an invalid-argument error that names the offending field and
// says how to fix it. Its Error() is the public message.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }

// Is reports that a FieldError is an ErrInvalidArgument.
func (e *FieldError) Is(target error) bool { return target == ErrInvalidArgument }

// Invalid returns a FieldError for field with a formatted message, e.g.
// Invalid("memory_mb", "must be between 1 and %d; ask for less", max).
func Invalid(field, format string, args ...any) error {
	return &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

// categorized is an error with a category and a message that is not prefixed
// by the category's name.
type categorized struct {
	cat error
	msg string
}

func (e *categorized) Error() string { return e.msg }
func (e *categorized) Unwrap() error { return e.cat }

// New returns an error of category cat with a formatted message, e.g.
// errdefs.New(errdefs.ErrNotFound, "sandbox %q not found", id).
func New(cat error, format string, args ...any) error {
	return &categorized{cat: cat, msg: fmt.Sprintf(format, args...)}
}

// IsNotFound reports whether err is in the not-found category.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }

// IsInvalidArgument reports whether err is in the invalid-argument category.
func IsInvalidArgument(err error) bool { return errors.Is(err, ErrInvalidArgument) }
