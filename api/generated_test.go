package api

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestGeneratedCodeIsFresh regenerates every protobuf output into a temp dir
// and fails if it differs from the committed code.
func TestGeneratedCodeIsFresh(t *testing.T) {
	for _, tool := range []string{"protoc", "protoc-gen-go", "protoc-gen-connect-go"} {
		if _, err := exec.LookPath(tool); err != nil {
			gobin := filepath.Join(os.Getenv("HOME"), "go", "bin", tool)
			if _, err2 := os.Stat(gobin); err2 == nil {
				continue
			}
			if os.Getenv("CI") != "" {
				t.Fatalf("%s not found: run scripts/install-deps.sh --dev", tool)
			}
			t.Skipf("%s not found (run scripts/install-deps.sh --dev); CI runs this check", tool)
		}
	}
	tmp := t.TempDir()
	cmd := exec.CommandContext(t.Context(), "bash", "../scripts/gen-proto.sh")
	cmd.Env = append(os.Environ(), "OUT_GO="+filepath.Join(tmp, "go"), "OUT_PY="+filepath.Join(tmp, "py"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("gen-proto.sh: %v\n%s", err, out)
	}
	diff := exec.CommandContext(t.Context(), "diff", "-r", "gen", filepath.Join(tmp, "go"))
	var b bytes.Buffer
	diff.Stdout, diff.Stderr = &b, &b
	if err := diff.Run(); err != nil {
		t.Fatalf("api/gen is stale; run `make generate` and commit:\n%s", b.String())
	}
	diff = exec.CommandContext(t.Context(), "diff", "-r", "-x", "__pycache__", "../sdk/python/src/opendsec/_gen", filepath.Join(tmp, "py"))
	b.Reset()
	diff.Stdout, diff.Stderr = &b, &b
	if err := diff.Run(); err != nil {
		t.Fatalf("sdk/python/src/opendsec/_gen is stale; run `make generate` and commit:\n%s", b.String())
	}
}
