//go:build linux

package security

import (
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

// TestSecurityDiskQuota (issue 11, finding 3): a sandbox that fills its
// disk and its inodes stops at its writable-layer quota (disk_mb), and
// another sandbox's create still succeeds and writes. A create without
// disk_mb gets the node's default; one above the node's maximum is refused
// naming disk_mb; metrics report use against the quota.
func TestSecurityDiskQuota(t *testing.T) {
	s := harness.New(t)
	s.Start()
	const mb = 64
	full := s.Create(t, &opendsecv1.SandboxSpec{DiskMb: mb})
	if got := full.GetSpec().GetDiskMb(); got != mb {
		t.Fatalf("sandbox disk_mb %d, want %d", got, mb)
	}
	id := full.GetId()

	r := s.Shell(t, id, "dd if=/dev/zero of=/big bs=1M count=200 2>&1; echo rc=$?")
	if strings.Contains(r.Stdout, "rc=0") || !strings.Contains(r.Stdout, "No space left") {
		t.Fatalf("dd of 200 MiB into a %d MiB quota: %s", mb, r.Stdout)
	}
	m, err := s.Sandboxes().GetSandboxMetrics(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxMetricsRequest{Id: id}))
	if err != nil {
		t.Fatal(err)
	}
	if used, total := m.Msg.GetMetrics().GetDiskUsedBytes(), m.Msg.GetMetrics().GetDiskTotalBytes(); total > mb<<20 || total < (mb-4)<<20 || used < (mb-8)<<20 {
		t.Errorf("metrics: disk used %d of %d bytes after filling a %d MiB quota", used, total, mb)
	}
	// Inodes: the shell's own redirection makes the files (no fork each).
	r = s.Shell(t, id, "rm -f /big; mkdir /f; i=0; while true 2>/dev/null >/f/$i; do i=$((i+1)); [ $i -ge 20000 ] && break; done; echo $i")
	n, err := strconv.Atoi(strings.TrimSpace(r.Stdout))
	if err != nil || n >= mb<<20/(16<<10) || n < 1000 {
		t.Fatalf("made %q empty files in a %d MiB layer (inode quota %d)", r.Stdout, mb, mb<<20/(16<<10))
	}

	other := s.Create(t, nil)
	if got := other.GetSpec().GetDiskMb(); got != 5120 {
		t.Errorf("a create without disk_mb got %d MiB, want the node default 5120", got)
	}
	if r := s.Shell(t, other.GetId(), "echo ok > /x && cat /x && touch /y"); r.Stdout != "ok\n" || r.Exit.GetExitCode() != 0 {
		t.Fatalf("second sandbox after the first filled its disk: %+v", r)
	}
	_, err = s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{
		Spec: &opendsecv1.SandboxSpec{Image: "root/busybox", DiskMb: 1 << 20}}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "disk_mb") || !strings.Contains(err.Error(), "51200") {
		t.Fatalf("create with disk_mb above the node's maximum: %v, want invalid_argument naming disk_mb and 51200", err)
	}
}
