package errdefs

import (
	"errors"
	"fmt"

	"connectrpc.com/connect"
)

// DiedMetadataKey is the answer metadata (a gRPC trailer, a Connect error
// header) that marks a call into a sandbox that died: its value is the
// reason, e.g. "killed by signal 9". SDKs raise their sandbox-died error on
// it instead of reading the message.
const DiedMetadataKey = "Opendsec-Sandbox-Died"

// DiedError is the error of a call into a sandbox that died: its init ended
// without a stop (a crash, a kill from outside, the OOM killer). It is in
// the failed-precondition category.
type DiedError struct {
	SandboxID string
	Reason    string
}

func (e *DiedError) Error() string {
	return fmt.Sprintf("sandbox %s died: %s; create a new one", e.SandboxID, e.Reason)
}

// Unwrap returns the category: a DiedError is an ErrFailedPrecondition.
func (e *DiedError) Unwrap() error { return ErrFailedPrecondition }

// SandboxDied returns the DiedError of sandbox id with the backend's reason.
func SandboxDied(id, reason string) error {
	if reason == "" {
		reason = "its init ended"
	}
	return &DiedError{SandboxID: id, Reason: reason}
}

// diedMeta marks ce when err is (or wraps) a DiedError, or came from an
// answer so marked.
func diedMeta(ce *connect.Error, err error) *connect.Error {
	var de *DiedError
	if errors.As(err, &de) && ce.Meta().Get(DiedMetadataKey) == "" {
		ce.Meta().Set(DiedMetadataKey, de.Reason)
	}
	return ce
}

// diedFrom is the DiedError of a remote answer marked with DiedMetadataKey.
func diedFrom(ce *connect.Error) (*DiedError, bool) {
	reason := ce.Meta().Get(DiedMetadataKey)
	if reason == "" {
		return nil, false
	}
	return &DiedError{Reason: reason}, true
}
