package errdefs

import (
	"errors"

	"connectrpc.com/connect"
)

// NetworkOffMetadataKey is the answer metadata (a gRPC trailer, a Connect
// error header) that marks a create refused because the node's network
// policy is turned off (node.network.enabled): its value is the node's ID.
// Callers that asked for a network only by default (the E2B gateway) read
// it instead of the message.
const NetworkOffMetadataKey = "Opendsec-Network-Off"

// NetworkOffError is the refusal of a sandbox network policy by a node whose
// network policy is turned off. It is an invalid-argument error naming the
// field "network".
type NetworkOffError struct {
	Node string
}

func (e *NetworkOffError) Error() string { return e.Unwrap().Error() }

// Unwrap returns the error as a FieldError of "network" (its category).
func (e *NetworkOffError) Unwrap() error {
	return Invalid("network", "node %s has network policy turned off (node.network.enabled), so its sandboxes have no network; leave network unset", e.Node)
}

// NetworkOff returns the NetworkOffError of node.
func NetworkOff(node string) error { return &NetworkOffError{Node: node} }

// IsNetworkOff reports whether err is (or wraps, or is a remote answer
// marked as) a NetworkOffError.
func IsNetworkOff(err error) bool {
	var ne *NetworkOffError
	return errors.As(err, &ne)
}

// networkOffMeta marks ce when err is (or wraps) a NetworkOffError.
func networkOffMeta(ce *connect.Error, err error) *connect.Error {
	var ne *NetworkOffError
	if errors.As(err, &ne) && ce.Meta().Get(NetworkOffMetadataKey) == "" {
		ce.Meta().Set(NetworkOffMetadataKey, cmpOr(ne.Node, "unknown"))
	}
	return ce
}

// networkOffFrom is the NetworkOffError of a remote answer marked with
// NetworkOffMetadataKey.
func networkOffFrom(ce *connect.Error) (*NetworkOffError, bool) {
	node := ce.Meta().Get(NetworkOffMetadataKey)
	if node == "" {
		return nil, false
	}
	return &NetworkOffError{Node: node}, true
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
