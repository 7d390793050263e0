// Package sandboxid makes and parses sandbox IDs. An ID is [a-z0-9] only (E2B
// hosts are <port>-<id>.<domain>) and starts with the 4-character ID of the
// node that owns it, so any apiserver routes a call without a lookup.
package sandboxid

import (
	"crypto/rand"
	"fmt"
	"regexp"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// NodeIDLen is the fixed length of a node ID.
const NodeIDLen = 4

// Len is the length of a sandbox ID.
const Len = NodeIDLen + 16

const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

var (
	nodeRe = regexp.MustCompile(`^[a-z0-9]{4}$`)
	idRe   = regexp.MustCompile(`^[a-z0-9]{20}$`)
)

// ValidNode reports an error unless node is a valid node ID.
func ValidNode(node string) error {
	if !nodeRe.MatchString(node) {
		return errdefs.Invalid("node_id", "%q must be exactly 4 characters of [a-z0-9], e.g. \"n001\"", node)
	}
	return nil
}

// New returns a fresh sandbox ID owned by node.
func New(node string) string {
	b := make([]byte, Len-NodeIDLen)
	if _, err := rand.Read(b); err != nil {
		panic(fmt.Sprintf("crypto/rand: %v", err))
	}
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return node + string(b)
}

// Node returns the node that owns id, or an invalid-argument error naming
// field when id is malformed.
func Node(field, id string) (string, error) {
	if !idRe.MatchString(id) {
		return "", errdefs.Invalid(field, "%q is not a sandbox ID (20 characters of [a-z0-9]); list sandboxes to find the ID", id)
	}
	return id[:NodeIDLen], nil
}

// Snapshot returns the node ID in a snapshot ID (made with New like a
// sandbox ID, so it routes the same way), or an invalid-argument error
// naming field.
func Snapshot(field, id string) (string, error) {
	if id == "" {
		return "", errdefs.Invalid(field, "is empty; give a snapshot ID (list them with `opendsecctl snapshot list`)")
	}
	if !idRe.MatchString(id) {
		return "", errdefs.Invalid(field, "%q is not a snapshot ID (20 characters of [a-z0-9]); list snapshots with `opendsecctl snapshot list`", id)
	}
	return id[:NodeIDLen], nil
}
