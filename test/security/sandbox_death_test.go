//go:build linux

package security

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/test/harness"
)

// TestSecuritySandboxDeath (issue 11, finding 5): after a kill -9 of a
// sandbox's init from the host, the sandbox is reported failed with a
// reason, and a call into it fails failed_precondition marked with that
// reason (the SDKs' sandbox-died error), not not_found or unavailable.
func TestSecuritySandboxDeath(t *testing.T) {
	s := harness.New(t)
	s.Start()
	sb := s.Create(t, nil)
	if r := s.Shell(t, sb.GetId(), "echo ok"); r.Stdout != "ok\n" {
		t.Fatalf("echo: %+v", r)
	}
	if err := unix.Kill(initPid(t, sb.GetId()), unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var got *opendsecv1.Sandbox
	for deadline := time.Now().Add(30 * time.Second); ; {
		r, err := s.Sandboxes().GetSandbox(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: sb.GetId()}))
		if err != nil {
			t.Fatalf("get after the kill: %v", err)
		}
		if got = r.Msg.GetSandbox(); got.GetState() == opendsecv1.SandboxState_SANDBOX_STATE_FAILED {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox still %s 30 s after its init was killed", got.GetState())
		}
		time.Sleep(50 * time.Millisecond) // polling the state, bounded by the deadline
	}
	reason, ok := strings.CutPrefix(got.GetReason(), "died: ")
	if !ok || reason == "" {
		t.Fatalf("reason %q, want died: <why>", got.GetReason())
	}
	_, err := s.Exec(t.Context(), &opendsecv1.ExecStart{SandboxId: sb.GetId(), Command: []string{"true"}})
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeFailedPrecondition || ce.Meta().Get(errdefs.DiedMetadataKey) != reason ||
		!strings.Contains(ce.Message(), sb.GetId()+" died: "+reason) {
		t.Fatalf("exec into the dead sandbox: %v; want failed_precondition saying it died, marked %s: %s", err, errdefs.DiedMetadataKey, reason)
	}
}

// initPid is the host pid of a sandbox's init: in its cgroup, pid 1 of its
// pid namespace.
func initPid(t *testing.T, id string) int {
	t.Helper()
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		cg, err1 := os.ReadFile(filepath.Join(d, "cgroup"))
		st, err2 := os.ReadFile(filepath.Join(d, "status"))
		if err1 != nil || err2 != nil || !strings.Contains(string(cg), id) {
			continue
		}
		for _, line := range strings.Split(string(st), "\n") {
			if f := strings.Fields(line); len(f) > 2 && f[0] == "NSpid:" && f[len(f)-1] == "1" {
				pid, _ := strconv.Atoi(filepath.Base(d))
				return pid
			}
		}
	}
	t.Fatalf("no init process of sandbox %s on this host", id)
	return 0
}
