package sched

import (
	"errors"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestStartIdle starts a child under SCHED_IDLE; the node's own threads
// keep their policy (the thread that forked it is gone).
func TestStartIdle(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := StartIdle(cmd); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	if p, err := Policy(cmd.Process.Pid); err != nil || p != unix.SCHED_IDLE {
		t.Fatalf("child policy %d, %v; want SCHED_IDLE (%d)", p, err, unix.SCHED_IDLE)
	}
	// The forking thread's policy is back (root) or the thread is gone
	// with its goroutine (a moment after Start returned).
	deadline := time.Now().Add(5 * time.Second)
	for {
		idle := idleThreads(t, os.Getpid())
		if idle == 0 {
			break
		}
		if os.Geteuid() == 0 || time.Now().After(deadline) {
			t.Fatalf("%d of this process's threads are still SCHED_IDLE", idle)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func idleThreads(t *testing.T, pid int) int {
	t.Helper()
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range tasks {
		tid, _ := strconv.Atoi(e.Name())
		if p, err := Policy(tid); err == nil && p == unix.SCHED_IDLE {
			n++
		}
	}
	return n
}

// TestSetIdle moves a running child's threads to SCHED_IDLE.
func TestSetIdle(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	if p, _ := Policy(cmd.Process.Pid); p == unix.SCHED_IDLE {
		t.Fatal("child is SCHED_IDLE before SetIdle")
	}
	if err := SetIdle(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	if n := idleThreads(t, cmd.Process.Pid); n != 1 {
		t.Fatalf("%d SCHED_IDLE threads in the child, want 1", n)
	}
}

// TestCookieOnChild gives a child a core-scheduling cookie and reads it
// back; only on a kernel with CONFIG_SCHED_CORE (SMT need not be on).
func TestCookieOnChild(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("PR_SCHED_CORE_CREATE on another process needs root (CAP_SYS_PTRACE over it)")
	}
	if err := KernelCoreSched(); err != nil {
		if errors.Is(err, unix.EINVAL) {
			t.Skipf("this kernel has no core scheduling (CONFIG_SCHED_CORE): PR_SCHED_CORE_GET: %v", err)
		}
		t.Fatalf("PR_SCHED_CORE_GET on this process: %v", err)
	}
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	before, err := Cookie(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := CreateCookie(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	after, err := Cookie(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	own, _ := Cookie(os.Getpid())
	if after == 0 || after == before || after == own {
		t.Fatalf("child's cookie %#x (before %#x, ours %#x): want a new one of its own", after, before, own)
	}
}

// TestStartWithCookie: a command started with Cookie has a cookie of its
// own from its first instruction (its first thread's, read before it could
// make one itself), and this process keeps none on its threads.
func TestStartWithCookie(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("core scheduling cookies are read across processes as root (CAP_SYS_PTRACE)")
	}
	if err := KernelCoreSched(); err != nil {
		if errors.Is(err, unix.EINVAL) {
			t.Skipf("this kernel has no core scheduling (CONFIG_SCHED_CORE): PR_SCHED_CORE_GET: %v", err)
		}
		t.Fatalf("PR_SCHED_CORE_GET on this process: %v", err)
	}
	var cookies []uint64
	for range 2 {
		cmd := exec.Command("sleep", "30")
		if err := Start(cmd, StartOptions{Cookie: true}); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
		c, err := Cookie(cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		cookies = append(cookies, c)
	}
	own, _ := Cookie(unix.Gettid())
	if cookies[0] == 0 || cookies[1] == 0 || cookies[0] == cookies[1] || own != 0 {
		t.Fatalf("children's cookies %#x, this thread's %#x: want two new ones, none here", cookies, own)
	}
}
