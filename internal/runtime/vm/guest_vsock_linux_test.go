package vm

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
)

// TestGuestAgentVsock boots a VM whose agent channel is vhost-vsock (the
// guest init serves the agent on AF_VSOCK port 1024), runs a command
// through AgentConn (Start returned only once /health answered over
// vsock), then forks it: the clone has a CID of its own and its agent
// answers on it. It needs /dev/vhost-vsock; where the host has none it
// skips with the reason.
func TestGuestAgentVsock(t *testing.T) {
	rootOnly(t)
	if ok, why := vhostVsock(vhostVsockPath); !ok {
		t.Skip(why)
	}
	dir, why := guestAssets()
	if dir == "" {
		skipOrFail(t, why)
	}
	rt, err := New(context.Background(), Config{AssetsDir: dir, Accel: "tcg", MemoryMB: 256, NodeID: "test", BootTimeoutSec: int(guestBootTimeout / time.Second), AgentChannel: ChannelVsock})
	if err != nil {
		t.Fatal(err)
	}
	r := rt.(*Runtime)
	ctx, cancel := context.WithTimeout(context.Background(), guestBootTimeout+3*time.Minute)
	defer cancel()
	ns, err := newTapNetNS("odvmvsock" + strconv.Itoa(os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ns.close)
	id := "guest-vsock"
	spec := runtime.Spec{ID: id, StateDir: filepath.Join(t.TempDir(), "sb"), Rootfs: guestRootfs(t), Resources: guestRes(16), Network: ns.attachment()}
	if _, err := r.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Delete(context.Background(), id) })
	start := time.Now()
	if err := r.Start(ctx, id); err != nil {
		t.Fatal(err)
	}
	t.Logf("vsock: exec to agent ready %s", time.Since(start))
	if h := guestRun(t, r, id, "echo hi; hostname"); h != "hi\n"+id {
		t.Fatalf("echo hi; hostname over vsock: %q; want %q", h, "hi\n"+id)
	}
	console, err := os.ReadFile(filepath.Join(spec.StateDir, "console.log"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(console, []byte("opendsec: agent ready (vsock)")) {
		t.Fatalf("console.log lacks the vsock ready line:\n%s", console)
	}
	src, _ := r.get(id)
	specs := forkSpecs(t, "vsockfork", 1)
	if _, err := r.Fork(ctx, id, specs); err != nil {
		t.Fatalf("fork: %v", err)
	}
	t.Cleanup(func() { _ = r.Delete(context.Background(), specs[0].ID) })
	if err := r.Start(ctx, specs[0].ID); err != nil {
		t.Fatalf("start fork: %v", err)
	}
	clone, _ := r.get(specs[0].ID)
	if clone.st.AgentCID == 0 || clone.st.AgentCID == src.st.AgentCID {
		t.Fatalf("clone cid %d, source %d: want one of its own", clone.st.AgentCID, src.st.AgentCID)
	}
	if h := guestRun(t, r, specs[0].ID, "hostname"); h != specs[0].Guest.Hostname {
		t.Fatalf("clone over vsock: hostname %q; want %q", h, specs[0].Guest.Hostname)
	}
	if h := guestRun(t, r, id, "hostname"); h != id {
		t.Fatalf("source over vsock after the fork: hostname %q; want %q", h, id)
	}
}
