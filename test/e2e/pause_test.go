//go:build linux

package e2e

import (
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

const counterLoop = "(i=0; while :; do i=$((i+1)); echo $i > /c.tmp && mv /c.tmp /c; sleep 0.02; done) >/dev/null 2>&1 </dev/null &"

func (s *system) counter(t *testing.T, id string) int {
	t.Helper()
	r := s.shell(t, id, "cat /c 2>/dev/null || echo 0")
	n, err := strconv.Atoi(strings.TrimSpace(r.stdout))
	if err != nil {
		t.Fatalf("counter of %s: %q", id, r.stdout)
	}
	return n
}

func (s *system) counterAtLeast(t *testing.T, id string, n int) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c := s.counter(t, id); c >= n {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("counter of %s did not reach %d in 10 s", id, n)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
}

func (s *system) state(t *testing.T, id string) opendsecv1.SandboxState {
	t.Helper()
	r, err := s.Sandboxes().GetSandbox(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: id}))
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	return r.Msg.GetSandbox().GetState()
}

// TestPauseSurvivesNodeKill: a paused sandbox stays paused across a kill -9
// of the whole system, resumes where it stopped, and a stop of a paused
// sandbox leaves nothing behind.
func TestPauseSurvivesNodeKill(t *testing.T) {
	s := newSystem(t)
	s.Start()
	sb := s.create(t, &opendsecv1.SandboxSpec{TimeoutSeconds: 3})
	s.shell(t, sb.Id, counterLoop)
	before := s.counterAtLeast(t, sb.Id, 1)
	p, err := s.Sandboxes().PauseSandbox(t.Context(), connect.NewRequest(&opendsecv1.PauseSandboxRequest{Id: sb.Id}))
	if err != nil {
		t.Fatal(err)
	}
	if p.Msg.GetSandbox().GetState() != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("pause answered state %s", p.Msg.GetSandbox().GetState())
	}
	// (An exec now would resume it: TestAutoResumeOnCalls.) Metrics do not.
	m, err := s.Sandboxes().GetSandboxMetrics(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxMetricsRequest{Id: sb.Id}))
	if err != nil {
		t.Fatal(err)
	}
	if mm := m.Msg.GetMetrics(); mm.GetMemUsedBytes() <= 0 || mm.GetPids() < 2 || mm.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("metrics of a paused sandbox: %v", mm)
	}

	s.Kill9()
	s.Start()
	// Its 3 s lifetime passes while it is paused (and the node is down);
	// the lifetime clock is stopped, so it is still there, still paused.
	time.Sleep(3 * time.Second)
	if st := s.state(t, sb.Id); st != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("after kill -9 and restart: state %s, want paused", st)
	}
	if _, err := s.Sandboxes().ResumeSandbox(t.Context(), connect.NewRequest(&opendsecv1.ResumeSandboxRequest{Id: sb.Id, TimeoutSeconds: 60})); err != nil {
		t.Fatal(err)
	}
	after := s.counter(t, sb.Id)
	if after-before > 25 {
		t.Fatalf("counter went %d -> %d across the pause: it ran while paused", before, after)
	}
	s.counterAtLeast(t, sb.Id, after+5)

	if _, err := s.Sandboxes().PauseSandbox(t.Context(), connect.NewRequest(&opendsecv1.PauseSandboxRequest{Id: sb.Id})); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: sb.Id})); err != nil {
		t.Fatalf("stop paused: %v", err)
	}
	if left := s.leftoversAfterStop(t, sb.Id); len(left) > 0 {
		t.Fatalf("stopped paused sandbox left behind:\n%s", strings.Join(left, "\n"))
	}
}

// TestBatchPauseTask: the preemption case. Ten sandboxes of one task are
// paused with one call and resumed with another; a sandbox of another task
// is untouched. It also measures pause and resume latency.
func TestBatchPauseTask(t *testing.T) {
	s := newSystem(t)
	s.Start()
	const n = 10
	ids := make([]string, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			r, err := s.Sandboxes().CreateSandbox(t.Context(), connect.NewRequest(&opendsecv1.CreateSandboxRequest{
				Spec: &opendsecv1.SandboxSpec{Image: "root/busybox", TaskId: "job-7", Labels: map[string]string{"run": "a"}},
			}))
			if err != nil {
				t.Errorf("create: %v", err)
				return
			}
			ids[i] = r.Msg.Sandbox.Id
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	other := s.create(t, &opendsecv1.SandboxSpec{TaskId: "job-8"})

	t0 := time.Now()
	r, err := s.Sandboxes().PauseSandboxes(t.Context(), connect.NewRequest(&opendsecv1.PauseSandboxesRequest{Selector: &opendsecv1.SandboxSelector{TaskId: "job-7"}}))
	batchPause := time.Since(t0)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Msg.GetFailures()) != 0 || len(r.Msg.GetSandboxes()) != n {
		t.Fatalf("batch pause: %d paused, failures %v", len(r.Msg.GetSandboxes()), r.Msg.GetFailures())
	}
	for _, id := range ids {
		if st := s.state(t, id); st != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
			t.Fatalf("%s is %s after the batch pause", id, st)
		}
	}
	if st := s.state(t, other.Id); st != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("sandbox of another task is %s", st)
	}
	t0 = time.Now()
	rr, err := s.Sandboxes().ResumeSandboxes(t.Context(), connect.NewRequest(&opendsecv1.ResumeSandboxesRequest{Selector: &opendsecv1.SandboxSelector{Labels: map[string]string{"run": "a"}}}))
	batchResume := time.Since(t0)
	if err != nil || len(rr.Msg.GetSandboxes()) != n {
		t.Fatalf("batch resume: %v %v", rr, err)
	}
	for _, id := range ids {
		if r := s.shell(t, id, "echo ok"); r.stdout != "ok\n" {
			t.Fatalf("after resume %s answered %q", id, r.stdout)
		}
	}
	t.Logf("batch of %d: pause %s, resume %s (client-measured, through the apiserver)", n, batchPause.Round(time.Microsecond), batchResume.Round(time.Microsecond))

	// Latency of one pause and one resume, p50 over 20.
	var pauses, resumes []time.Duration
	for range 20 {
		t0 := time.Now()
		if _, err := s.Sandboxes().PauseSandbox(t.Context(), connect.NewRequest(&opendsecv1.PauseSandboxRequest{Id: ids[0]})); err != nil {
			t.Fatal(err)
		}
		pauses = append(pauses, time.Since(t0))
		t0 = time.Now()
		if _, err := s.Sandboxes().ResumeSandbox(t.Context(), connect.NewRequest(&opendsecv1.ResumeSandboxRequest{Id: ids[0]})); err != nil {
			t.Fatal(err)
		}
		resumes = append(resumes, time.Since(t0))
	}
	slices.Sort(pauses)
	slices.Sort(resumes)
	t.Logf("single sandbox over 20: pause p50 %s p95 %s, resume p50 %s p95 %s", pauses[10].Round(time.Microsecond), pauses[18].Round(time.Microsecond),
		resumes[10].Round(time.Microsecond), resumes[18].Round(time.Microsecond))
}

// TestAutoPauseOnTimeout: a sandbox created with auto_pause is paused, not
// stopped, when its lifetime ends, and keeps its files.
func TestAutoPauseOnTimeout(t *testing.T) {
	s := newSystem(t)
	s.Start()
	sb := s.create(t, &opendsecv1.SandboxSpec{TimeoutSeconds: 1, AutoPause: true})
	s.shell(t, sb.Id, "echo kept > /f")
	deadline := time.Now().Add(15 * time.Second)
	for s.state(t, sb.Id) != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		if time.Now().After(deadline) {
			t.Fatalf("auto_pause sandbox not paused 15 s after its 1 s lifetime")
		}
		time.Sleep(50 * time.Millisecond) // polling a condition with a deadline
	}
	if _, err := s.Sandboxes().ResumeSandbox(t.Context(), connect.NewRequest(&opendsecv1.ResumeSandboxRequest{Id: sb.Id, TimeoutSeconds: 60})); err != nil {
		t.Fatal(err)
	}
	if r := s.shell(t, sb.Id, "cat /f"); r.stdout != "kept\n" {
		t.Fatalf("after auto-pause and resume: %q", r.stdout)
	}
}
