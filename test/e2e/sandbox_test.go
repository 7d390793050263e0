//go:build linux

package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// create makes a busybox sandbox and fails the test on error.
func (s *system) create(t *testing.T, spec *opendsecv1.SandboxSpec) *opendsecv1.Sandbox {
	t.Helper()
	return s.Create(t, spec)
}

type execResult struct {
	stdout, stderr string
	exit           *opendsecv1.ExecExit
}

// exec runs cmd in the sandbox and collects its output (harness Exec).
func (s *system) exec(ctx context.Context, id string, cmd ...string) (execResult, error) {
	r, err := s.Exec(ctx, &opendsecv1.ExecStart{SandboxId: id, Command: cmd})
	return execResult{stdout: r.Stdout, stderr: r.Stderr, exit: r.Exit}, err
}

func (s *system) shell(t *testing.T, id, line string) execResult {
	t.Helper()
	r, err := s.exec(t.Context(), id, "/bin/sh", "-c", line)
	if err != nil {
		t.Fatalf("exec %q in %s: %v", line, id, err)
	}
	return r
}

// leftovers lists what the host still holds for sandbox id: mounts, cgroup
// dirs, processes and files.
func (s *system) leftovers(id string) []string {
	var out []string
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, id) {
				out = append(out, "mount: "+l)
			}
		}
	}
	// Under the node's cgroup parent, /opendsec-<node id> by default.
	cg, _ := filepath.Glob("/sys/fs/cgroup/*/opendsec*/" + id)
	cg2, _ := filepath.Glob("/sys/fs/cgroup/opendsec*/" + id)
	for _, d := range append(cg, cg2...) {
		out = append(out, "cgroup: "+d)
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cgroup")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && strings.Contains(string(b), id) {
			// A zombie holds nothing but its pid until the host's init
			// (not ours to control) reaps it.
			st, _ := os.ReadFile(filepath.Join(filepath.Dir(p), "status"))
			if strings.Contains(string(st), "\nState:\tZ") {
				continue
			}
			out = append(out, "process: "+p+" "+firstLine(st))
		}
	}
	if _, err := os.Stat(filepath.Join(s.DataDir(), "node", "sandboxes", id)); err == nil {
		out = append(out, "files: "+filepath.Join(s.DataDir(), "node", "sandboxes", id))
	}
	return out
}

// waitTeardowns waits (up to 30 s) until the node has no stopped sandbox
// whose teardown still runs in the background (its
// opendsec_node_teardowns_pending gauge is 0), so a look at the host's
// mounts, netns, cgroups or image holds sees only live sandboxes. A node
// that does not answer (stopped, killed) has nothing pending to wait for.
func (s *system) waitTeardowns(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		v, ok := s.tryNodeMetric("opendsec_node_teardowns_pending")
		if !ok || v == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the node still has %v sandbox teardowns pending after 30 s", v)
		}
		time.Sleep(20 * time.Millisecond) // polling the node's background teardown
	}
}

// leftoversAfterStop checks what a stopped sandbox leaves: no process at
// once (StopSandbox returns once it is dead), and nothing at all once the
// node's background teardown has run (polled for up to 10 s). It returns
// what is still there then.
func (s *system) leftoversAfterStop(t *testing.T, id string) []string {
	t.Helper()
	for _, l := range s.leftovers(id) {
		if strings.HasPrefix(l, "process: ") {
			t.Errorf("sandbox %s still has a process when its stop returned: %s", id, l)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		left := s.leftovers(id)
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(20 * time.Millisecond) // polling the node's background teardown
	}
}

// TestKillNineRecovery is the acceptance test: ten sandboxes survive the
// node being killed with SIGKILL, answer after it restarts, and stopping them
// leaves nothing behind.
func TestKillNineRecovery(t *testing.T) {
	s := newSystem(t)
	s.Start()
	const n = 10
	ids := make([]string, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{
				Spec: &opendsecv1.SandboxSpec{Image: "root/busybox", Labels: map[string]string{"test": "kill9"}},
			}))
			if err != nil {
				errs <- err
				return
			}
			ids[i] = r.Msg.Sandbox.Id
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("create: %v", err)
	}
	for _, id := range ids {
		// State written before the crash must survive it.
		s.shell(t, id, "echo "+id+" > /tmp/marker")
	}

	s.Kill9()
	s.Start()

	for _, id := range ids {
		r := s.shell(t, id, "cat /tmp/marker; echo $((6*7))")
		if want := id + "\n42\n"; r.stdout != want || r.exit.ExitCode != 0 {
			t.Fatalf("after restart, sandbox %s answered %q (exit %d), want %q", id, r.stdout, r.exit.ExitCode, want)
		}
	}
	l, err := s.Sandboxes().ListSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ListSandboxesRequest{Labels: map[string]string{"test": "kill9"}}))
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Msg.Sandboxes) != n {
		t.Fatalf("after restart list shows %d sandboxes, want %d", len(l.Msg.Sandboxes), n)
	}
	for _, id := range ids {
		if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id})); err != nil {
			t.Fatalf("stop %s: %v", id, err)
		}
		if left := s.leftoversAfterStop(t, id); len(left) > 0 {
			t.Errorf("sandbox %s left behind:\n%s", id, strings.Join(left, "\n"))
		}
		_, err := s.Sandboxes().GetSandbox(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: id}))
		if connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("get after stop: %v, want not found", err)
		}
	}
}

// TestCleanShutdownLeavesSandboxesRunning checks SIGTERM keeps sandboxes and
// --stop-sandboxes removes them.
func TestCleanShutdownLeavesSandboxesRunning(t *testing.T) {
	s := newSystem(t)
	s.Start()
	sb := s.create(t, nil)
	if err := s.Stop(); err != nil {
		t.Fatalf("SIGTERM shutdown: %v", err)
	}
	s.Start("--stop-sandboxes")
	if r := s.shell(t, sb.Id, "echo alive"); r.stdout != "alive\n" {
		t.Fatalf("sandbox after clean restart: %q", r.stdout)
	}
	if err := s.Stop(); err != nil {
		t.Fatalf("SIGTERM shutdown: %v", err)
	}
	if left := s.leftovers(sb.Id); len(left) > 0 {
		t.Errorf("--stop-sandboxes left behind:\n%s", strings.Join(left, "\n"))
	}
}

func firstLine(b []byte) string {
	l, _, _ := strings.Cut(string(b), "\n")
	return l
}

// execTimeout runs cmd with a process lifetime of secs seconds.
func (s *system) execTimeout(ctx context.Context, id string, secs int64, cmd ...string) (execResult, error) {
	st := s.Processes().Exec(ctx)
	if err := st.Send(&opendsecv1.ExecRequest{Msg: &opendsecv1.ExecRequest_Start{Start: &opendsecv1.ExecStart{SandboxId: id, Command: cmd, TimeoutSeconds: secs}}}); err != nil {
		return execResult{}, err
	}
	st.CloseRequest()
	var r execResult
	var out strings.Builder
	defer func() { r.stdout = out.String() }()
	for {
		m, err := st.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			r.stdout = out.String()
			return r, err
		}
		if e := m.GetExit(); e != nil {
			r.exit = e
		}
		out.Write(m.GetStdout())
	}
	r.stdout = out.String()
	return r, nil
}

// TestExecTimeoutUnderCallerDeadline checks a process lifetime shorter than
// the caller's own deadline kills the process and ends the stream with
// timed_out (the caller's deadline must not replace the lifetime).
func TestExecTimeoutUnderCallerDeadline(t *testing.T) {
	s := newSystem(t)
	s.Start()
	sb := s.create(t, nil)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	start := time.Now()
	r, err := s.execTimeout(ctx, sb.Id, 2, "sleep", "300")
	if err != nil {
		t.Fatalf("exec with timeout: %v", err)
	}
	if r.exit == nil || !r.exit.TimedOut || r.exit.ExitCode != -1 {
		t.Fatalf("exit %v, want timed_out with exit code -1", r.exit)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("2 s lifetime took %s to end", d)
	}
}

// TestConcurrentCreatesAndExecs runs creates, execs and stops from several
// callers at once: every exec must return its whole output (a regression
// test for streams cut short between components under concurrency).
func TestConcurrentCreatesAndExecs(t *testing.T) {
	s := newSystem(t)
	s.Start()
	var wg sync.WaitGroup
	errs := make(chan error, 200)
	for range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 3 {
				r, err := s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{Spec: &opendsecv1.SandboxSpec{Image: "root/busybox"}}))
				if err != nil {
					errs <- fmt.Errorf("create: %w", err)
					return
				}
				id := r.Msg.Sandbox.Id
				for i := range 15 {
					res, err := s.exec(t.Context(), id, "/bin/sh", "-c", fmt.Sprintf("echo %s-%d", id, i))
					if err != nil {
						errs <- fmt.Errorf("exec %d in %s: %w", i, id, err)
					} else if want := fmt.Sprintf("%s-%d\n", id, i); res.stdout != want {
						errs <- fmt.Errorf("exec %d in %s printed %q, want %q", i, id, res.stdout, want)
					}
				}
				if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: id})); err != nil {
					errs <- fmt.Errorf("stop %s: %w", id, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestKilledInitReportedAtOnce: `kill -9` of a sandbox's init from the host
// is seen at once (the backend's Wait): within a second GetSandbox answers
// FAILED with the reason, everything of the sandbox is gone, and later it
// is not found by exec — not "running" until its timeout.
func TestKilledInitReportedAtOnce(t *testing.T) {
	s := newSystem(t)
	s.Start()
	r, err := s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{
		Spec: &opendsecv1.SandboxSpec{Image: "root/busybox", TimeoutSeconds: 3600},
	}))
	if err != nil {
		t.Fatal(err)
	}
	id := r.Msg.Sandbox.Id
	s.shell(t, id, "true")
	// The node's default runc root carries its node ID; the OCI runtime
	// that made the container keeps its state there (crun: status, runc:
	// state.json), and its `state` answers.
	root := "/run/opendsec/" + id[:4] + "/runc"
	oci := "runc"
	if _, err := os.Stat(filepath.Join(root, id, "status")); err == nil {
		oci = "crun"
	}
	out, err := exec.Command(oci, "--root", root, "state", id).Output()
	if err != nil {
		t.Fatalf("runc state %s: %v", id, err)
	}
	var st struct {
		Pid int `json:"pid"`
	}
	if err := json.Unmarshal(out, &st); err != nil || st.Pid <= 0 {
		t.Fatalf("runc state %s: %s, %v", id, out, err)
	}
	killed := time.Now()
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var got *opendsecv1.Sandbox
	for time.Since(killed) < 10*time.Second {
		g, err := s.Sandboxes().GetSandbox(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: id}))
		if err != nil {
			t.Fatalf("get after the kill: %v", err)
		}
		if g.Msg.Sandbox.State == opendsecv1.SandboxState_SANDBOX_STATE_FAILED {
			got = g.Msg.Sandbox
			break
		}
		time.Sleep(10 * time.Millisecond) // polling the API for the node's view
	}
	if got == nil {
		t.Fatal("sandbox not reported failed within 10 s of kill -9 of its init")
	}
	if d := time.Since(killed); d > time.Second {
		t.Errorf("reported failed %s after the kill; want within a second", d)
	}
	if !strings.Contains(got.Reason, "died") {
		t.Errorf("reason %q does not say it died", got.Reason)
	}
	// The cleanup follows the report.
	for deadline := time.Now().Add(10 * time.Second); ; {
		left := s.leftovers(id)
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dead sandbox left behind 10 s after the kill:\n%s", strings.Join(left, "\n"))
		}
		time.Sleep(50 * time.Millisecond) // polling the node's cleanup
	}
}
