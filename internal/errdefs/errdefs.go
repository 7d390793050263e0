// Package errdefs defines the error categories every OpenDsec component uses.
// Errors are wrapped with %w as they travel up and are mapped to Connect/gRPC
// and HTTP codes only at the server edge, once (Interceptor on every Connect
// handler, ToHTTP for HTTP answers), and back to categories in clients
// (FromConnect). A caller is told only the public message (PublicMessage);
// the internal detail goes to the server's log.
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
// by the category's name. causes are the errors its message wrapped with %w:
// errors.Is and errors.As see them, but its own category comes first (Code
// and HTTPStatus take the outermost category). public marks a message that
// came from a remote component's answer (FromConnect): it is already fit to
// show.
type categorized struct {
	cat    error
	msg    string
	causes []error
	public bool
}

func (e *categorized) Error() string { return e.msg }
func (e *categorized) Unwrap() []error {
	return append([]error{e.cat}, e.causes...)
}

// New returns an error of category cat with a formatted message, e.g.
// errdefs.New(errdefs.ErrNotFound, "sandbox %q not found", id). As with
// fmt.Errorf, %w keeps an error as the cause (errors.Is/As see it); %v only
// copies its text.
func New(cat error, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	e := &categorized{cat: cat, msg: err.Error()}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		e.causes = []error{u.Unwrap()}
	case interface{ Unwrap() []error }:
		e.causes = u.Unwrap()
	}
	return e
}

// publicError gives err a message for callers that leaves out the internal
// detail (host paths, backend output) that err's own text has.
type publicError struct {
	msg string
	err error
}

func (e *publicError) Error() string { return e.err.Error() }
func (e *publicError) Unwrap() error { return e.err }

// WithPublic returns err with a public message: callers are answered with
// msg, while err's full text (Error) is what the server logs. err keeps its
// category and stays visible to errors.Is/As, e.g.
// errdefs.WithPublic(fmt.Errorf("mount %s: %w", dir, err), "the sandbox's root could not be mounted").
func WithPublic(err error, format string, args ...any) error {
	if err == nil {
		return nil
	}
	return &publicError{msg: fmt.Sprintf(format, args...), err: err}
}

// IsNotFound reports whether err is in the not-found category.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }

// IsInvalidArgument reports whether err is in the invalid-argument category.
func IsInvalidArgument(err error) bool { return errors.Is(err, ErrInvalidArgument) }
