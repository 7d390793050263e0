//go:build linux

package e2e

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

// TestBatchRetryAfterKill9: a batch of 60 with a request_id; `opendsec up`
// (the apiserver, and the node with it) gets SIGKILL after the stream
// delivered 20 results; after a restart the same request again returns 60
// sandboxes, each index the sandbox it had before when it had one, and
// exactly 60 exist, distinct, all running.
func TestBatchRetryAfterKill9(t *testing.T) {
	const n, killAfter = 60, 20
	sys := &system{harness.NewWith(t, harness.Options{Config: func(cfg map[string]any) {
		harness.Set(cfg, "node.max_sandboxes", 200)
		harness.Set(cfg, "node.memory_overcommit", 4)
	}})}
	sys.Start()
	rid := fmt.Sprintf("e2e-kill9-%d", time.Now().UnixNano())
	req := &opendsecv1.BatchCreateSandboxesRequest{
		Spec:  &opendsecv1.SandboxSpec{Image: "root/busybox", Cpu: 0.1, MemoryMb: proto.Int64(64), TimeoutSeconds: 600, Labels: map[string]string{"batch": rid}},
		Count: n, RequestId: rid,
	}
	first := map[int32]string{}
	st, err := sys.Sandboxes().BatchCreateSandboxes(t.Context(), connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	for st.Receive() {
		if m := st.Msg(); m.GetSandbox() != nil {
			first[m.GetIndex()] = m.GetSandbox().GetId()
		}
		if len(first) == killAfter {
			sys.Kill9()
			break
		}
	}
	st.Close()
	if len(first) != killAfter {
		t.Fatalf("the batch delivered %d sandboxes before ending (%v); want %d, then the kill", len(first), st.Err(), killAfter)
	}
	sys.Start()

	st, err = sys.Sandboxes().BatchCreateSandboxes(t.Context(), connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	second := map[int32]string{}
	for st.Receive() {
		m := st.Msg()
		if m.GetSandbox() == nil {
			t.Errorf("retried item %d: %s: %s", m.GetIndex(), m.GetErrorCode(), m.GetErrorMessage())
			continue
		}
		second[m.GetIndex()] = m.GetSandbox().GetId()
	}
	if err := st.Err(); err != nil {
		t.Fatalf("retried batch: %v", err)
	}
	if len(second) != n {
		t.Fatalf("retried batch made %d sandboxes; want %d", len(second), n)
	}
	for i, id := range first {
		if second[i] != id {
			t.Errorf("item %d: retry returned %s; want %s, delivered before the kill", i, second[i], id)
		}
	}
	l, err := sys.Sandboxes().ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{Labels: map[string]string{"batch": rid}}))
	if err != nil {
		t.Fatal(err)
	}
	var listed, want []string
	for _, sb := range l.Msg.GetSandboxes() {
		if sb.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
			t.Errorf("sandbox %s is %s; want running", sb.GetId(), sb.GetState())
		}
		listed = append(listed, sb.GetId())
	}
	for _, id := range second {
		want = append(want, id)
	}
	slices.Sort(listed)
	slices.Sort(want)
	if !slices.Equal(listed, want) {
		t.Fatalf("after the retry %d sandboxes exist (%v); want exactly the batch's %d (%v)", len(listed), listed, n, want)
	}
	// One delivered before the kill and one made after it both run commands.
	var before string
	for _, id := range first {
		before = id
		break
	}
	for _, id := range []string{before, second[n-1]} {
		if got := sys.Shell(t, id, "echo ok"); got.Stdout != "ok\n" {
			t.Fatalf("sandbox %s: %+v", id, got)
		}
	}
}
