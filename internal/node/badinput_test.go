package node

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// nothingLeft fails t when the node holds a sandbox, a sandbox dir or an
// image hold.
func nothingLeft(t *testing.T, f *fixture, n *Node) {
	t.Helper()
	if _, _, c := n.Usage(); c != 0 {
		t.Fatalf("%d sandboxes after bad input", c)
	}
	if ents, _ := os.ReadDir(filepath.Join(f.cfg.StateDir, "sandboxes")); len(ents) != 0 {
		t.Fatalf("sandbox dirs left behind: %v", ents)
	}
	if h := f.cfg.Images.(images).held(); h != 0 {
		t.Fatalf("%d image holds left behind", h)
	}
}

func wantFieldErr(t *testing.T, what string, err error, field, mention string) {
	t.Helper()
	var fe *errdefs.FieldError
	if !errors.As(err, &fe) || fe.Field != field || !strings.Contains(err.Error(), mention) {
		t.Errorf("%s: got %v, want invalid_argument naming %s and %q", what, err, field, mention)
	}
}

// TestSecurityBadInputRequestID: a request_id over the limit is refused
// naming it, before the sandbox table sees it (a 100 KB key was
// "internal: record sandbox: key too large"); a batch item's key (the
// public limit plus "-<index>") is accepted.
func TestSecurityBadInputRequestID(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	_, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), RequestID: strings.Repeat("r", 100<<10), Spec: specRecord{Image: "x"}})
	wantFieldErr(t, "100 KB request_id", err, "request_id", "at most 144")
	_, err = n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), RequestID: "a\x00b", Spec: specRecord{Image: "x"}})
	wantFieldErr(t, "request_id with NUL", err, "request_id", "control character")
	nothingLeft(t, f, n)
	rid := strings.Repeat("r", sandboxspec.MaxRequestIDLen) + "-32767"
	if _, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), RequestID: rid, Spec: specRecord{Image: "x"}}); err != nil {
		t.Fatalf("batch item key of %d bytes: %v", len(rid), err)
	}
}
