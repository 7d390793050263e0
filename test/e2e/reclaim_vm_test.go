//go:build linux

package e2e

import (
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/test/harness"
)

// TestVMPauseTaskReclaim is issue 13's acceptance for task pause with
// reclaim on the vm backend, through the API: a VM holding a random value
// and a counter in memory is paused with reclaim; its QEMU exits and the
// memory freed is reported; resume_task restores it with the value and the
// counter counting on. A second reclaim, then an exec (the node's
// auto-resume) restores it too.
func TestVMPauseTaskReclaim(t *testing.T) {
	s, _ := newVMSystem(t)
	helloServer(t, s)
	s.Start()
	pauseTaskReclaimKeepsHolder(t, s, "vm", "root/busybox", 64<<20, func(id string) int { return len(qemuOf(id)) })
}

// TestGvisorPauseTaskReclaim is the same on the gvisor backend (`runsc
// checkpoint` to disk, `runsc restore`), on the node's network.
func TestGvisorPauseTaskReclaim(t *testing.T) {
	s := newGvisorSystem(t)
	helloServer(t, s)
	s.Start()
	pauseTaskReclaimKeepsHolder(t, s, "gvisor", "root/busybox", 16<<20, nil)
}

// helloServer answers "hello" on the test internet's helloAddr.
func helloServer(t *testing.T, s *system) {
	inet := harness.MakeInternet(t, s.NodeNS())
	l := harness.ListenIn(t, inet, helloAddr)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("hello\n"))
			_ = c.Close()
		}
	}()
}

const helloAddr = harness.InetIP + ":8080"

// pauseTaskReclaimKeepsHolder runs the reclaim acceptance on one backend;
// procs, when set, counts the sandbox's host processes (0 once reclaimed).
// The sandbox reaches the test internet's server before and after.
func pauseTaskReclaimKeepsHolder(t *testing.T, s *system, backend, image string, minFreed int64, procs func(id string) int) {
	c := s.Client(t)
	task := "rcl-" + backend
	sb := s.create(t, &opendsecv1.SandboxSpec{Backend: backend, Image: image, TaskId: task, Cpu: 1, MemoryMb: proto.Int64(256),
		Network: &opendsecv1.NetworkPolicy{Allow: []*opendsecv1.NetworkRule{{Cidr: harness.InetIP, Protocol: "tcp", Ports: "8080"}}}})
	id := sb.GetId()
	reach := func(when string) {
		t.Helper()
		r := s.Shell(t, id, "nc -w 10 "+harness.InetIP+" 8080 </dev/null")
		if r.Exit.GetExitCode() != 0 || r.Stdout != "hello\n" {
			t.Fatalf("%s %s: the allowed server: %+v", id, when, r)
		}
	}
	reach("before the reclaim")
	if r := s.Shell(t, id, holderLoop); r.Exit.GetExitCode() != 0 {
		t.Fatalf("start the holder: %+v", r)
	}
	v0, n0 := s.held(t, id, true)
	t0 := time.Now()
	out, err := c.PauseTask(t.Context(), task, opendsec.PauseTaskOptions{Reclaim: true})
	took := time.Since(t0)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Reclaimed) != 1 || len(out.Failures) != 0 {
		t.Fatalf("pause_task with reclaim: %d reclaimed, failures %v", len(out.Reclaimed), out.Failures)
	}
	r := out.Reclaimed[0]
	if r.GetBytesFreed() < minFreed || r.GetNote() != "" || out.BytesFreed != r.GetBytesFreed() {
		t.Fatalf("reclaim of %s: %+v (total %d); want at least %d MiB freed and no note", id, r, out.BytesFreed, minFreed>>20)
	}
	t.Logf("%s: pause_task with reclaim freed %.1f MiB (of %.1f) in %s", backend, float64(r.GetBytesFreed())/(1<<20), float64(r.GetBytesBefore())/(1<<20), took.Round(time.Millisecond))
	if st := s.state(t, id); st != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("%s after the reclaim: %s, want paused", id, st)
	}
	if procs != nil {
		if n := procs(id); n != 0 {
			t.Fatalf("%d host processes of %s after the reclaim, want none", n, id)
		}
	}
	t0 = time.Now()
	if rr, err := c.ResumeTask(t.Context(), task, nil); err != nil || len(rr.Sandboxes) != 1 {
		t.Fatalf("resume_task: %+v %v", rr, err)
	}
	t.Logf("%s: resume_task of the reclaimed sandbox: %s", backend, time.Since(t0).Round(time.Millisecond))
	if v, n := s.held(t, id, true); v != v0 || n <= n0 {
		t.Fatalf("holder after the restore: %s %d, want %s counting on from %d", v, n, v0, n0)
	}
	reach("after the restore")
	// Reclaimed again; an exec resumes it (auto-resume) and finds it intact.
	if _, err := c.PauseTask(t.Context(), task, opendsec.PauseTaskOptions{Reclaim: true}); err != nil {
		t.Fatal(err)
	}
	_, n1 := s.held(t, id, false)
	if v, n := s.held(t, id, true); v != v0 || n < n1 {
		t.Fatalf("holder after an auto-resume of the reclaimed sandbox: %s %d, want %s from %d", v, n, v0, n1)
	}
	if st := s.state(t, id); st != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("%s after the auto-resume: %s", id, st)
	}
}
