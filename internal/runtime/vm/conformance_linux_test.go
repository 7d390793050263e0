package vm

import (
	"context"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestConformance runs the backend conformance suite (the one the container
// and gvisor backends pass) against real guests under TCG: the guest
// kernel and initramfs of scripts/build-guest-assets.sh, the busybox root
// filesystem as an EROFS layer, 1 vCPU and 256 MiB per VM.
func TestConformance(t *testing.T) {
	rootOnly(t)
	runtimetest.Suite(t, conformanceFactory(t), runtimetest.Options{Exec: true, Kill: killQEMU, Concurrency: 4})
}

// conformanceFactory returns the suite's factory. Every instance is one
// node (same NodeID, memory dir and cgroup parent), as before and after a
// restart. A new instance made within a test stands for the node after a
// restart: the instances made before it in that test let go of their QMP
// and agent connections, as the killed node's process would have (QEMU's
// QMP monitor and the agent's chardev serve one client at a time).
func conformanceFactory(t *testing.T) runtimetest.Factory {
	dir, why := guestAssets()
	if dir == "" {
		skipOrFail(t, why)
	}
	rootfs := guestRootfs(t)
	var mu sync.Mutex
	made := map[*testing.T][]*Runtime{}
	return func(t *testing.T) (runtime.Runtime, runtime.Spec) {
		rt, err := New(context.Background(), Config{AssetsDir: dir, Accel: "tcg", NodeID: "conf", BootTimeoutSec: int(guestBootTimeout / time.Second)})
		if err != nil {
			t.Fatal(err)
		}
		r := rt.(*Runtime)
		mu.Lock()
		for _, old := range made[t] {
			old.letGo()
		}
		made[t] = append(made[t], r)
		mu.Unlock()
		return r, runtime.Spec{Rootfs: rootfs, Resources: runtime.Resources{CPU: 1, MemoryMB: 256, PidsLimit: 128, DiskMB: 64}}
	}
}

// letGo closes every QMP and agent connection r holds, as the process of
// a node killed with -9 would: a new instance can then Recover its VMs.
func (r *Runtime) letGo() {
	for _, sb := range r.sbs.All() {
		sb.mu.Lock()
		if sb.qmp != nil {
			_ = sb.qmp.Close()
			sb.qmp = nil
		}
		sb.mu.Unlock()
		sb.closeAgent()
	}
}

// killQEMU ends a VM from outside, as `kill -9` of its QEMU process.
func killQEMU(t testing.TB, rt runtime.Runtime, id string) {
	t.Helper()
	st, err := rt.Status(context.Background(), id)
	if err != nil || st.Pid <= 0 {
		t.Fatalf("status of %s: %+v %v", id, st, err)
	}
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 %d: %v", st.Pid, err)
	}
}
