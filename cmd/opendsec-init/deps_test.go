package main

import (
	"os/exec"
	"strings"
	"testing"
)

// allowedDeps is everything opendsec-init may link besides the runtime's
// own internal packages: it must stay tiny, because it is all an idle
// sandbox runs. Adding to this list needs a measurement of init's RSS
// (bench/run.sh, idle rows).
var allowedDeps = map[string]bool{
	"unsafe": true, "math/bits": true, "errors": true, "sync/atomic": true, "sync": true,
	"io": true, "iter": true, "unicode": true, "unicode/utf8": true, "bytes": true,
	"math": true, "strconv": true, "reflect": true, "cmp": true, "slices": true,
	"encoding/binary": true, "sort": true, "strings": true, "syscall": true, "time": true,
	"path": true, "path/filepath": true, "io/fs": true, "os": true, "context": true, "os/signal": true,
	"golang.org/x/sys/unix":                            true,
	"github.com/kernflux/opendsec/internal/seccompbpf": true,
	"github.com/kernflux/opendsec/cmd/opendsec-init":   true,
}

func TestDepsStayTiny(t *testing.T) {
	cmd := exec.Command("go", "list", "-deps", ".")
	cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0", "GOOS=linux")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var bad []string
	for _, p := range strings.Fields(string(out)) {
		if strings.HasPrefix(p, "internal/") || strings.HasPrefix(p, "runtime") || strings.HasPrefix(p, "vendor/") {
			continue
		}
		if !allowedDeps[p] {
			bad = append(bad, p)
		}
	}
	if len(bad) > 0 {
		t.Fatalf("opendsec-init links packages outside its allow-list: %v (keep net, fmt, net/http, protobuf and internal/agent out of it)", bad)
	}
}
