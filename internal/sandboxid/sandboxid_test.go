package sandboxid

import (
	"errors"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func TestNewIsValidAndOwnedByNode(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		id := New("n001")
		if len(id) != Len || !strings.HasPrefix(id, "n001") {
			t.Fatalf("New = %q: want %d characters starting with the node ID", id, Len)
		}
		if strings.Trim(id, alphabet) != "" {
			t.Fatalf("New = %q has characters outside [a-z0-9]", id)
		}
		node, err := Node("sandbox_id", id)
		if err != nil || node != "n001" {
			t.Fatalf("Node(%q) = %q, %v", id, node, err)
		}
		if seen[id] {
			t.Fatalf("New returned %q twice", id)
		}
		seen[id] = true
	}
}

func TestNodeRejectsMalformedIDs(t *testing.T) {
	for _, id := range []string{
		"",
		"n001",                    // a node ID, not a sandbox ID
		"n001abcdefghijklmno",     // 19
		"n001abcdefghijklmnopq",   // 21
		"N001ABCDEFGHIJKLMNOP",    // upper case
		"n001abcdefghijklmno-",    // not [a-z0-9]
		"n001abcdefghijklmn/.",    // path characters
		"../../../../etc/passwdx", // 23, and a path
	} {
		node, err := Node("sandbox_id", id)
		if err == nil {
			t.Fatalf("Node(%q) = %q, want an error", id, node)
		}
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != "sandbox_id" || !errdefs.IsInvalidArgument(err) {
			t.Fatalf("Node(%q) error = %v, want an invalid sandbox_id", id, err)
		}
		if !strings.Contains(fe.Msg, "list sandboxes") {
			t.Fatalf("message %q does not say how to fix it", fe.Msg)
		}
	}
}

func TestValidNode(t *testing.T) {
	for _, n := range []string{"n001", "abcd", "0000", "z9z9"} {
		if err := ValidNode(n); err != nil {
			t.Fatalf("ValidNode(%q) = %v", n, err)
		}
	}
	for _, n := range []string{"", "n01", "n0001", "N001", "n-01", "n_01"} {
		err := ValidNode(n)
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != "node_id" {
			t.Fatalf("ValidNode(%q) = %v, want an invalid node_id", n, err)
		}
	}
}
