package node

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/container"
	"github.com/kernflux/opendsec/internal/runtime/runtimefake"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/testutil"
)

// fsCounting is the container backend with its filesystem resumes counted
// and, when gate is set, held until it is closed.
type fsCounting struct {
	*container.Runtime
	resumes atomic.Int32
	gate    chan struct{}
}

func (c *fsCounting) ResumeFilesystem(ctx context.Context, id string) error {
	c.resumes.Add(1)
	if c.gate != nil {
		<-c.gate
	}
	return c.Runtime.ResumeFilesystem(ctx, id)
}

func mustRun(t *testing.T, rt runtime.Runtime, id, script string) runtimetest.Result {
	t.Helper()
	r, err := runtimetest.Run(t.Context(), rt, id, "", "/bin/sh", "-c", script)
	if err != nil {
		t.Fatalf("exec %q in %s: %v", script, id, err)
	}
	return r
}

// isZombie reports whether a /proc/<pid>/stat line is a zombie's (it runs
// no more; its parent has not reaped it yet).
func isZombie(stat []byte) bool {
	i := strings.LastIndexByte(string(stat), ')')
	return i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}

func reserved(n *Node) (float64, int64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.reservedCPU, n.reservedMem
}

// TestFilesystemPause: a filesystem-only pause on the container backend
// ends every process and removes the cgroups while the files stay, gives
// the reservation back, survives a node restart, and concurrent calls into
// it start it again once, on the same files, with none of the old
// processes.
func TestFilesystemPause(t *testing.T) {
	f := newFixture(t)
	n1, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := f.create(t, n1, specRecord{MemoryMB: 256, TimeoutSec: 600})
	mustRun(t, f.rt, rec.ID, "echo kept > /root/file && sleep 1000 >/dev/null 2>&1 </dev/null &")
	if r := mustRun(t, f.rt, rec.ID, "pidof sleep"); r.ExitCode != 0 {
		t.Fatalf("the background sleep is not running before the pause: %+v", r)
	}
	st, err := f.rt.Status(t.Context(), rec.ID)
	if err != nil || st.Pid <= 0 {
		t.Fatalf("status before pause: %+v %v", st, err)
	}
	cpu0, mem0 := reserved(n1)

	paused, err := n1.PauseFilesystem(t.Context(), rec.ID)
	if err != nil {
		t.Fatalf("filesystem pause: %v", err)
	}
	if paused.State != statePaused || !paused.PausedFilesystem {
		t.Fatalf("record after the pause: state %s, paused_filesystem %v", paused.State, paused.PausedFilesystem)
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", st.Pid)); err == nil && !isZombie(b) {
		t.Fatalf("init (pid %d) still runs after a filesystem pause: %s", st.Pid, b)
	}
	if dirs := f.rt.CgroupDirs(rec.ID); len(dirs) != 0 {
		t.Fatalf("cgroups left while paused keeping only files: %v", dirs)
	}
	bst, err := f.rt.Status(t.Context(), rec.ID)
	if err != nil || bst.State != runtime.StatePaused || !bst.FilesystemPaused {
		t.Fatalf("backend status while paused: %+v %v, want paused, filesystem only", bst, err)
	}
	if cpu, mem := reserved(n1); mem != mem0-256 || cpu != cpu0-rec.Spec.CPU {
		t.Fatalf("reservation while paused: %g CPU %d MiB, want %g and %d", cpu, mem, cpu0-rec.Spec.CPU, mem0-256)
	}
	if _, err := n1.PauseFilesystem(t.Context(), rec.ID); err != nil {
		t.Fatalf("second filesystem pause (idempotent): %v", err)
	}
	if _, err := n1.Pause(t.Context(), rec.ID); err != nil {
		t.Fatalf("memory pause of a filesystem-paused sandbox (a no-op): %v", err)
	}
	n1.Close()

	// A node restart keeps it paused, its reservation released.
	rt2, err := container.New(container.Config{AgentPath: testutil.AgentBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	be := &fsCounting{Runtime: rt2, gate: make(chan struct{})}
	f.rt = rt2
	f.cfg.Backends = map[string]runtime.Runtime{"container": be}
	n2 := f.open(t)
	got, gsb, err := n2.Get(t.Context(), rec.ID)
	if err != nil || got.State != statePaused || !got.PausedFilesystem {
		t.Fatalf("after a node restart: %+v %v, want paused keeping files", got, err)
	}
	if !n2.toProto(gsb).GetPausedFilesystem() {
		t.Fatalf("the sandbox message after the restart does not say paused_filesystem")
	}
	if _, mem := reserved(n2); mem != 0 {
		t.Fatalf("memory reserved after the restart: %d MiB, want 0 (the only sandbox is paused keeping files)", mem)
	}
	if dirs := rt2.CgroupDirs(rec.ID); len(dirs) != 0 {
		t.Fatalf("cgroups after the restart: %v", dirs)
	}

	// Concurrent calls resume it once.
	srv := httptest.NewServer(n2.AgentProxy())
	defer srv.Close()
	const callers = 8
	codes := make([]int, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() { codes[i], _ = agentGet(t, srv, rec.ID, "health") })
	}
	sb, _ := n2.get(rec.ID)
	waitResumeWaiters(t, n2, sb, callers, func() { close(be.gate); wg.Wait() })
	close(be.gate)
	wg.Wait()
	for i, c := range codes {
		if c != http.StatusNoContent {
			t.Fatalf("call %d into the filesystem-paused sandbox: %d, want 204", i, c)
		}
	}
	if n := be.resumes.Load(); n != 1 {
		t.Fatalf("backend filesystem resumes: %d, want 1", n)
	}
	if n := autoResumes(n2); n != 1 {
		t.Fatalf("opendsec_node_auto_resumes_total = %v, want 1", n)
	}
	got, _, _ = n2.Get(t.Context(), rec.ID)
	if got.State != stateRunning || got.PausedFilesystem || got.ID != rec.ID {
		t.Fatalf("after the resume: %+v", got)
	}
	if _, mem := reserved(n2); mem != 256 {
		t.Fatalf("memory reserved after the resume: %d MiB, want 256", mem)
	}
	if r := mustRun(t, rt2, rec.ID, "cat /root/file"); r.Stdout != "kept\n" {
		t.Fatalf("file written before the pause: %+v", r)
	}
	if r := mustRun(t, rt2, rec.ID, "pidof sleep"); r.ExitCode == 0 {
		t.Fatalf("a process from before the pause runs after the resume (memory was not to be kept): %q", r.Stdout)
	}
	if dirs := rt2.CgroupDirs(rec.ID); len(dirs) == 0 {
		t.Fatalf("no cgroup for the resumed sandbox")
	}
	// Its next run is watched like any: an init killed from outside is a
	// death, not a pause.
	st2, err := rt2.Status(t.Context(), rec.ID)
	if err != nil || st2.Pid <= 0 || st2.Pid == st.Pid {
		t.Fatalf("status after resume: %+v %v, want a new init", st2, err)
	}
	if err := syscall.Kill(st2.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitGone(t, n2, rec.ID, 10*time.Second)
}

// TestFilesystemPauseAdmissionAndTimeout: a resume that no longer fits the
// node fails and leaves the sandbox paused; an on_timeout
// "pause_filesystem" sandbox is so paused by its timeout; an explicit
// resume restarts it.
func TestFilesystemPauseAdmissionAndTimeout(t *testing.T) {
	f := newFixture(t)
	clk := &testClock{}
	f.cfg.Clock = clk.now
	n := f.open(t)
	rec := f.create(t, n, specRecord{MemoryMB: 512, TimeoutSec: 60, OnTimeout: sandboxspec.OnTimeoutPauseFilesystem})
	mustRun(t, f.rt, rec.ID, "echo v1 > /data")
	clk.advance(61 * time.Second)
	waitState(t, n, rec.ID, statePaused)
	if got, _, err := n.Get(t.Context(), rec.ID); err != nil || !got.PausedFilesystem {
		t.Fatalf("on_timeout pause_filesystem: %+v %v, want paused keeping files", got, err)
	}
	if dirs := f.rt.CgroupDirs(rec.ID); len(dirs) != 0 {
		t.Fatalf("cgroups left after the timeout's filesystem pause: %v", dirs)
	}
	// A fork of it copies its files; the source stays paused.
	out, err := n.Fork(t.Context(), ForkRequest{SourceID: rec.ID, Count: 1, TimeoutSec: 600}) // past the test clock's jump
	if err != nil {
		t.Fatalf("fork of a filesystem-paused sandbox: %v", err)
	}
	if r := mustRun(t, f.rt, out.Forks[0].Sandbox.id, "cat /data"); r.Stdout != "v1\n" {
		t.Fatalf("file in the fork: %+v", r)
	}
	if err := n.Stop(t.Context(), out.Forks[0].Sandbox.id, "test"); err != nil {
		t.Fatal(err)
	}
	if got, _, _ := n.Get(t.Context(), rec.ID); got.State != statePaused || !got.PausedFilesystem {
		t.Fatalf("source after the fork: %+v, want still paused keeping files", got)
	}
	// Fill the node's memory meanwhile: the resume must refuse.
	n.mu.Lock()
	fill := n.memQuota() - n.reservedMem
	n.reservedMem += fill
	n.mu.Unlock()
	_, err = n.Resume(t.Context(), rec.ID, 0)
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "stays paused") {
		t.Fatalf("resume without room: %v, want resource exhausted saying it stays paused", err)
	}
	if got, _, _ := n.Get(t.Context(), rec.ID); got.State != statePaused || !got.PausedFilesystem {
		t.Fatalf("after a refused resume: %+v, want still paused keeping files", got)
	}
	n.mu.Lock()
	n.reservedMem -= fill
	n.mu.Unlock()
	resumed, err := n.Resume(t.Context(), rec.ID, 0)
	if err != nil {
		t.Fatalf("resume: %v", err)
	}
	if left := resumed.ExpiresAt.Sub(clk.now()); left < 59*time.Second || left > 60*time.Second {
		t.Fatalf("lifetime after resuming a timed-out sandbox: %s, want a fresh 60s", left)
	}
	if r := mustRun(t, f.rt, rec.ID, "cat /data"); r.Stdout != "v1\n" {
		t.Fatalf("file after the resume: %+v", r)
	}
	// The watcher of its first run waits on into this one: a kill from
	// outside is a death.
	st, err := f.rt.Status(t.Context(), rec.ID)
	if err != nil || st.Pid <= 0 {
		t.Fatalf("status after the resume: %+v %v", st, err)
	}
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitGone(t, n, rec.ID, 10*time.Second)
	if _, ok := n.deadSandbox(rec.ID); !ok {
		t.Fatalf("the resumed run's end was not taken for a death")
	}
}

// TestFilesystemPauseRefusedWithoutBackend: a backend without
// runtime.FilesystemPauser refuses both the pause and the on_timeout,
// naming what to do, and the sandbox is left running.
func TestFilesystemPauseRefusedWithoutBackend(t *testing.T) {
	f := newFakeFixture(t)
	n := f.open(t)
	rec := f.create(t, n, specRecord{})
	_, err := n.PauseFilesystem(t.Context(), rec.ID)
	if !errors.Is(err, errdefs.ErrUnimplemented) || !strings.Contains(err.Error(), "container backend") {
		t.Fatalf("filesystem pause on the fake backend: %v, want unimplemented naming the container backend", err)
	}
	if got := stateOf(t, n, rec.ID); got != stateRunning {
		t.Fatalf("state after a refused filesystem pause: %s", got)
	}
	_, err = n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "root/busybox", OnTimeout: sandboxspec.OnTimeoutPauseFilesystem}})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "on_timeout") {
		t.Fatalf("create with on_timeout pause_filesystem on the fake backend: %v, want invalid on_timeout", err)
	}
}

// A node killed between a filesystem pause's kill and its record: recovery
// takes the pause from the backend, releases the reservation, and a call
// into it starts it again.
func TestRecoverReconcilesFilesystemPause(t *testing.T) {
	f := newFixture(t)
	n1, err := New(t.Context(), f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := f.create(t, n1, specRecord{MemoryMB: 128})
	mustRun(t, f.rt, rec.ID, "echo x > /x")
	n1.Close() // as if killed: it sees nothing of what follows
	if err := f.rt.PauseFilesystem(t.Context(), rec.ID); err != nil {
		t.Fatal(err)
	}
	rt2, err := container.New(container.Config{AgentPath: testutil.AgentBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	f.rt = rt2
	f.cfg.Backends = map[string]runtime.Runtime{"container": rt2}
	n2 := f.open(t)
	got, _, err := n2.Get(t.Context(), rec.ID)
	if err != nil || got.State != statePaused || !got.PausedFilesystem {
		t.Fatalf("after restart: %+v %v, want paused keeping files (the backend is)", got, err)
	}
	if _, mem := reserved(n2); mem != 0 {
		t.Fatalf("memory reserved after the restart: %d MiB, want 0", mem)
	}
	srv := httptest.NewServer(n2.AgentProxy())
	defer srv.Close()
	if code, body := agentGet(t, srv, rec.ID, "files?path=/x"); code != http.StatusOK || body != "x\n" {
		t.Fatalf("file read into the filesystem-paused sandbox: %d %q", code, body)
	}
	if got, _, _ := n2.Get(t.Context(), rec.ID); got.State != stateRunning {
		t.Fatalf("state after the call: %s, want running", got.State)
	}
}

// fsFake is the fake backend with filesystem-only pauses, for the node's
// logic around them: a pause fails with pauseErr or does nothing else (the
// fake's sandbox keeps running); a resume fails with resumeErr or does
// nothing. waits counts the calls of Wait.
type fsFake struct {
	*runtimefake.Runtime
	pauseErr, resumeErr error
	waits               atomic.Int32
}

func (f *fsFake) PauseFilesystem(context.Context, string) error  { return f.pauseErr }
func (f *fsFake) ResumeFilesystem(context.Context, string) error { return f.resumeErr }

func (f *fsFake) Wait(ctx context.Context, id string) (runtime.ExitStatus, error) {
	f.waits.Add(1)
	return f.Runtime.Wait(ctx, id)
}

func newFSFakeFixture(t *testing.T, be *fsFake) *fixture {
	f := newFakeFixture(t)
	be.Runtime = f.fake
	f.cfg.Backends = map[string]runtime.Runtime{runtimefake.Name: be}
	return f
}

// Failed filesystem pauses leave the sandbox with its one watcher (no
// goroutine blocked in Wait per failure), which still sees its death.
func TestFilesystemPauseFailuresKeepOneWatcher(t *testing.T) {
	be := &fsFake{pauseErr: errors.New("injected pause failure")}
	f := newFSFakeFixture(t, be)
	n := f.open(t)
	rec := f.create(t, n, specRecord{TimeoutSec: 600})
	for i := range 5 {
		if _, err := n.PauseFilesystem(t.Context(), rec.ID); err == nil || !strings.Contains(err.Error(), "injected") {
			t.Fatalf("filesystem pause %d: %v, want the injected failure", i, err)
		}
	}
	if got := stateOf(t, n, rec.ID); got != stateRunning {
		t.Fatalf("state after failed filesystem pauses: %s", got)
	}
	if err := f.fake.Kill(rec.ID, "killed by signal 9"); err != nil {
		t.Fatal(err)
	}
	waitGone(t, n, rec.ID, 10*time.Second)
	if _, ok := n.deadSandbox(rec.ID); !ok {
		t.Fatalf("the end after failed filesystem pauses was not taken for a death")
	}
	// The watcher's first Wait, and one more after it saw that pauses had
	// begun (which returns at once: init had ended).
	if w := be.waits.Load(); w > 2 {
		t.Fatalf("Wait called %d times for one sandbox after 5 failed filesystem pauses, want at most 2 (one watcher)", w)
	}
}

// A filesystem pause whose record write fails is undone; when its undo's
// resume fails too, the sandbox stays paused keeping its files and
// reserves no CPU or memory.
func TestFilesystemPauseUndoFailureReleases(t *testing.T) {
	be := &fsFake{resumeErr: errors.New("injected resume failure")}
	f := newFSFakeFixture(t, be)
	n := f.open(t)
	rec := f.create(t, n, specRecord{MemoryMB: 256, TimeoutSec: 600})
	cpu0, mem0 := reserved(n)
	restore := breakTable(t, n)
	if _, err := n.PauseFilesystem(t.Context(), rec.ID); err == nil {
		t.Fatal("filesystem pause with a broken table succeeded")
	}
	restore()
	sb, err := n.get(rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	n.mu.Lock()
	st, fs := sb.rec.State, sb.rec.PausedFilesystem
	n.mu.Unlock()
	if st != statePaused || !fs {
		t.Fatalf("record after a failed undo: %s, paused_filesystem %v; want paused keeping files, as the backend is", st, fs)
	}
	if cpu, mem := reserved(n); mem != mem0-256 || cpu != cpu0-rec.Spec.CPU {
		t.Fatalf("reservation of a sandbox left paused keeping files: %g CPU %d MiB, want %g and %d", cpu, mem, cpu0-rec.Spec.CPU, mem0-256)
	}
}
