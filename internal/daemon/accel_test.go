package daemon

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
)

// TestAccelCommand: `opendsec accel` prints the detector's decision as
// text and as JSON, the same decision both times (the second from the
// per-boot cache).
func TestAccelCommand(t *testing.T) {
	dir := t.TempDir()
	cfgPath := dir + "/config.json"
	if err := os.WriteFile(cfgPath, []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) string {
		t.Helper()
		root := NewRootCommand()
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetArgs(append([]string{"--data-dir", dir, "--config", cfgPath, "accel", "--cache-dir", dir}, args...))
		if err := root.ExecuteContext(t.Context()); err != nil {
			t.Fatalf("opendsec accel %v: %v", args, err)
		}
		return out.String()
	}
	var r kvmprobe.Result
	if err := json.Unmarshal([]byte(run("--json")), &r); err != nil {
		t.Fatal(err)
	}
	if (r.Accel != kvmprobe.AccelKVM && r.Accel != kvmprobe.AccelTCG) || r.Reason == "" || r.BootID == "" {
		t.Fatalf("accel --json: %+v", r)
	}
	text := run()
	for _, want := range []string{"accel:  " + string(r.Accel) + "\n", "kind:   " + string(r.Kind) + "\n", "reason: " + r.Reason + "\n"} {
		if !strings.Contains(text, want) {
			t.Fatalf("accel text %q lacks %q", text, want)
		}
	}
	// The default config's node.default_backend is auto: without hardware
	// KVM that is container, because of the probe's reason.
	if !r.HardwareKVM() {
		if want := "default backend: container (microvm needs hardware KVM: " + r.Reason + ")\n"; !strings.Contains(text, want) {
			t.Fatalf("accel text %q lacks %q", text, want)
		}
	} else if !strings.Contains(text, "default backend: ") {
		t.Fatalf("accel text %q names no default backend", text)
	}
}
