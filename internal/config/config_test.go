package config

import (
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

func TestImportDirDefaultAndValidation(t *testing.T) {
	c := Default("/var/lib/opendsec")
	if err := c.Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	if c.Node.ImportDir != "/var/lib/opendsec/import" {
		t.Fatalf("node.import_dir default = %q, want /var/lib/opendsec/import", c.Node.ImportDir)
	}
	for _, bad := range []string{"", "import", "/"} {
		c.Node.ImportDir = bad
		err := c.Validate()
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), "node.import_dir:") {
			t.Fatalf("node.import_dir %q: %v, want an invalid node.import_dir error", bad, err)
		}
	}
}

func TestMaxPaused(t *testing.T) {
	c := Default("/var/lib/opendsec")
	if d, err := c.Node.MaxPausedDuration(); err != nil || d != 24*time.Hour {
		t.Fatalf("node.max_paused default = %s (%v), want 24h", d, err)
	}
	c.Node.MaxPaused = "0"
	if d, err := c.Node.MaxPausedDuration(); err != nil || d != 0 {
		t.Fatalf("node.max_paused \"0\" = %s (%v), want 0 (forever)", d, err)
	}
	for _, bad := range []string{"24", "-1h", "a day"} {
		c.Node.MaxPaused = bad
		err := c.Validate()
		if !errdefs.IsInvalidArgument(err) || !strings.HasPrefix(err.Error(), "node.max_paused:") {
			t.Fatalf("node.max_paused %q: %v, want an invalid node.max_paused error", bad, err)
		}
	}
}
