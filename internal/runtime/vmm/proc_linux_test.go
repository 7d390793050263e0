package vmm

import (
	"context"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// startSleep starts a child the test can tell apart by its arguments: a
// shell blocked in its builtin read of a pipe nobody writes, so it forks
// no child of its own (a forked child has the same command line until it
// execs, and Find would see two).
func startSleep(t *testing.T) (*exec.Cmd, string) {
	t.Helper()
	mark := "vmm-test-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano(), 10)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", "-c", "read x", mark)
	cmd.Stdin = r
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	_ = r.Close()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = w.Close()
	})
	// Start returns once the exec began (its close-on-exec pipe closed),
	// before the kernel set up the new program's arguments: until then
	// /proc/<pid>/cmdline reads empty (seen once in CI).
	for deadline := time.Now().Add(10 * time.Second); !slices.Contains(Cmdline(cmd.Process.Pid), mark); {
		if time.Now().After(deadline) {
			t.Fatalf("the command line of %d never showed %s: %q", cmd.Process.Pid, mark, Cmdline(cmd.Process.Pid))
		}
		time.Sleep(time.Millisecond) // a poll of the condition above
	}
	return cmd, mark
}

// TestProcIdentity: a process is found by its command line, checked by
// pid and start time (a wrong start time is another process), and not
// found once it has exited.
func TestProcIdentity(t *testing.T) {
	cmd, mark := startSleep(t)
	pid := cmd.Process.Pid
	match := func(args []string) bool { return slices.Contains(args, mark) }
	stime := StartTime(pid)
	if stime == 0 {
		t.Fatalf("StartTime(%d) = 0 for a running process", pid)
	}
	if args := Cmdline(pid); len(args) != 4 || args[0] != "sh" || args[3] != mark {
		t.Fatalf("Cmdline(%d) = %q; want sh -c 'read x' %s", pid, args, mark)
	}
	if got := Find(match); !slices.Equal(got, []int{pid}) {
		t.Fatalf("Find: %v; want [%d]", got, pid)
	}
	if !Is(pid, stime, match) || !Is(pid, 0, match) {
		t.Fatal("Is: the running process with its start time (or none) is not recognised")
	}
	if Is(pid, stime+1, match) {
		t.Fatal("Is: a start time other than the process's is accepted (a reused pid would be)")
	}
	if Is(pid, stime, func([]string) bool { return false }) || Is(0, 0, match) {
		t.Fatal("Is: accepts a process its match refuses, or pid 0")
	}

	if err := KillAndWait(context.Background(), pid, 10*time.Second); err != nil {
		t.Fatalf("KillAndWait: %v", err)
	}
	_ = cmd.Wait() // reaped: the pid is free
	if got := Find(match); len(got) != 0 || Is(pid, stime, match) {
		t.Fatalf("after the kill: Find %v, Is %v; want it gone", got, Is(pid, stime, match))
	}
	if err := KillAndWait(context.Background(), pid, time.Second); err != nil {
		t.Fatalf("KillAndWait of a process that is gone: %v; want nil", err)
	}
	if err := Kill(0); err != nil {
		t.Fatalf("Kill(0): %v; want nil (no process, never the process group)", err)
	}
}

// TestWaitExit returns once the process of the pidfd has exited (before
// it is reaped), and Kill ends it.
func TestWaitExit(t *testing.T) {
	cmd, _ := startSleep(t)
	fd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Close(fd) }()
	done := make(chan struct{})
	go func() { WaitExit(fd); close(done) }()
	select {
	case <-done:
		t.Fatal("WaitExit returned while the process runs")
	case <-time.After(100 * time.Millisecond):
	}
	if err := Kill(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("WaitExit did not return 10 s after the process was killed")
	}
	if err := cmd.Wait(); err == nil {
		t.Fatal("the killed process exited 0")
	}
}
