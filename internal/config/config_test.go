package config

import (
	"strings"
	"testing"

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
