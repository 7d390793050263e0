package node

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// TestNewNeedsInit: a node whose opendsec-init is missing (not next to the
// agent, or at an explicit init_path) refuses to start, naming the field
// and how to fix it.
func TestNewNeedsInit(t *testing.T) {
	dir := t.TempDir()
	agent := filepath.Join(dir, "opendsec-agent")
	if err := os.WriteFile(agent, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, initPath := range []string{"", filepath.Join(dir, "elsewhere", "opendsec-init")} {
		_, err := New(t.Context(), Config{
			ID:             "t001",
			StateDir:       filepath.Join(dir, "state"),
			AgentPath:      agent,
			InitPath:       initPath,
			Backends:       map[string]runtime.Runtime{"fake": nil},
			DefaultBackend: "fake",
			Images:         images{mu: new(sync.Mutex), holds: map[string]bool{}},
		})
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != "node.init_path" || !strings.Contains(err.Error(), "make agent") {
			t.Errorf("init_path %q: err = %v; want a node.init_path error saying to run `make agent`", initPath, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "state")); err == nil {
		t.Error("a refused start made the state dir")
	}
}
