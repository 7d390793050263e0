package opendsec

import (
	"errors"
	"fmt"
	"testing"

	"connectrpc.com/connect"
)

// TestSecuritySandboxDiedError: an answer marked with the sandbox-died
// metadata is an *Error with DiedReason, matched by ErrSandboxDied.
func TestSecuritySandboxDiedError(t *testing.T) {
	ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox x died: killed by signal 9; create a new one"))
	ce.Meta().Set(diedMetadataKey, "killed by signal 9")
	err := fmt.Errorf("exec: %w", convertError(ce))
	if !errors.Is(err, ErrSandboxDied) || !IsFailedPrecondition(err) {
		t.Fatalf("%v: not ErrSandboxDied / failed_precondition", err)
	}
	if reason, ok := SandboxDied(err); !ok || reason != "killed by signal 9" {
		t.Fatalf("SandboxDied = %q, %v", reason, ok)
	}
	var e *Error
	if !errors.As(err, &e) || e.DiedReason != "killed by signal 9" {
		t.Fatalf("errors.As: %#v", e)
	}
	plain := convertError(connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox x is paused")))
	if errors.Is(plain, ErrSandboxDied) {
		t.Fatalf("%v matches ErrSandboxDied", plain)
	}
	if _, ok := SandboxDied(plain); ok {
		t.Fatalf("%v: SandboxDied ok", plain)
	}
}
