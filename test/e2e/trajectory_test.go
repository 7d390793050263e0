//go:build linux

package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/test/harness"
)

type trainerStep struct {
	Step     int    `json:"step"`
	Stdout   string `json:"stdout"`
	Exit     int    `json:"exit"`
	Replayed bool   `json:"replayed"`
	Seq      uint64 `json:"seq"`
}

// trainer runs test/e2e/trajtrainer against the system. With killAfter >
// 0 it kills the trainer with SIGKILL as soon as it has printed that many
// steps, and returns the steps it printed.
func trainer(t *testing.T, s *system, bin, id string, killAfter, stopAfter int) []trainerStep {
	t.Helper()
	cmd := exec.Command(bin, "-endpoint", s.Endpoint(), "-token", s.Token(), "-sandbox", id, "-stop-after", strconv.Itoa(stopAfter))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var steps []trainerStep
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		var st trainerStep
		if err := json.Unmarshal(sc.Bytes(), &st); err != nil {
			t.Fatalf("trainer line %q: %v", sc.Text(), err)
		}
		steps = append(steps, st)
		if killAfter > 0 && len(steps) == killAfter {
			cmd.Process.Signal(syscall.SIGKILL) // the trainer is preempted mid-rollout
			break
		}
	}
	err = cmd.Wait()
	if killAfter == 0 && err != nil {
		t.Fatalf("trainer: %v\n%s", err, stderr.String())
	}
	return steps
}

// TestTrajectoryRolloutExactlyOnce is issue 15's acceptance: a 20-step
// rollout whose steps 5 and 15 append to a file; the trainer is killed -9
// mid-rollout, a new one runs the rollout again with the same call IDs,
// then the whole system (apiserver and node) is killed -9 in the middle of
// a third run. In the end the file has exactly one line per append, every
// call before a kill comes back replayed with its recorded output, and the
// log holds 20 calls, one per call ID.
func TestTrajectoryRolloutExactlyOnce(t *testing.T) {
	s := newSystem(t)
	s.Start()
	bin := harness.BuildPackage(t, "./test/e2e/trajtrainer", "trajtrainer")
	sb := s.Create(t, nil)

	first := trainer(t, s, bin, sb.Id, 8, 0)
	if len(first) != 8 {
		t.Fatalf("first trainer printed %d steps before its kill", len(first))
	}
	// A second trainer stops after 12 steps; then apiserver and node die.
	second := trainer(t, s, bin, sb.Id, 0, 12)
	for i, st := range second {
		if i < len(first) {
			if !st.Replayed || st.Stdout != first[i].Stdout || st.Seq != first[i].Seq {
				t.Fatalf("step %d after the trainer's kill: %+v; want the recorded %+v, replayed", i, st, first[i])
			}
		}
	}
	if second[5].Stdout != "1\n" {
		t.Fatalf("append step output %q; want 1", second[5].Stdout)
	}
	s.Kill9()
	s.Start()

	third := trainer(t, s, bin, sb.Id, 0, 0)
	if len(third) != 20 {
		t.Fatalf("third trainer finished %d steps", len(third))
	}
	ran := 0
	for i, st := range third {
		if i < 12 {
			if !st.Replayed || st.Stdout != second[i].Stdout {
				t.Fatalf("step %d after the system's kill: %+v; want the recorded %+v, replayed", i, st, second[i])
			}
			continue
		}
		if st.Replayed {
			t.Fatalf("step %d replayed, but no trainer ran it before", i)
		}
		ran++
	}
	if ran != 8 || third[15].Stdout != "2\n" {
		t.Fatalf("%d steps ran in the third trainer (want 8); step 15 printed %q (want 2)", ran, third[15].Stdout)
	}
	if r := s.Shell(t, sb.Id, "cat /tmp/appends"); r.Stdout != "append-5\nappend-15\n" {
		t.Fatalf("file after the rollouts: %q; want one line per append", r.Stdout)
	}

	// The log: 20 calls with the rollout's IDs (+ the cat above), in order.
	stream, err := s.Processes().GetTrajectory(t.Context(), connect.NewRequest(&opendsecv1.GetTrajectoryRequest{SandboxId: sb.Id}))
	if err != nil {
		t.Fatal(err)
	}
	var entries []*opendsecv1.TrajectoryEntry
	for stream.Receive() {
		entries = append(entries, stream.Msg())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if len(entries) != 21 || entries[0].SandboxId != sb.Id {
		t.Fatalf("log has %d entries; want 21 (20 steps and the cat)", len(entries))
	}
	for i, e := range entries[:20] {
		if e.CallId != fmt.Sprintf("r1/%d", i) || e.Seq != uint64(i+1) || e.State != "done" || e.ExitCode != 0 {
			t.Fatalf("log entry %d: %+v", i, e)
		}
	}
	if string(entries[15].Stdout) != "2\n" || entries[15].Command[2] != "echo append-15 >> /tmp/appends; wc -l < /tmp/appends" {
		t.Fatalf("log entry 15: %q %q", entries[15].Stdout, entries[15].Command)
	}
}

// TestTrajectoryBadCallIDs: a call ID reused with another command is
// refused naming both; a 10 KB call ID is refused naming the field and
// limit; neither runs anything.
func TestTrajectoryBadCallIDs(t *testing.T) {
	s := newSystem(t)
	s.Start()
	sb := s.Create(t, nil)
	ctx := t.Context()
	sh := func(line string) []string { return []string{"/bin/sh", "-c", line} }
	if _, err := s.Exec(ctx, &opendsecv1.ExecStart{SandboxId: sb.Id, Command: sh("echo a >> /tmp/f"), CallId: "k"}); err != nil {
		t.Fatal(err)
	}
	_, err := s.Exec(ctx, &opendsecv1.ExecStart{SandboxId: sb.Id, Command: sh("echo b >> /tmp/f"), CallId: "k"})
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "echo a >> /tmp/f") || !strings.Contains(err.Error(), "echo b >> /tmp/f") {
		t.Fatalf("reused call ID: %v; want failed_precondition naming both commands", err)
	}
	_, err = s.Exec(ctx, &opendsecv1.ExecStart{SandboxId: sb.Id, Command: sh("echo c >> /tmp/f"), CallId: strings.Repeat("x", 10<<10)})
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "call_id") || !strings.Contains(err.Error(), "256") {
		t.Fatalf("10 KB call ID: %v; want invalid_argument naming call_id and its limit", err)
	}
	if r := s.Shell(t, sb.Id, "cat /tmp/f"); r.Stdout != "a\n" {
		t.Fatalf("file %q; the refused calls must not run", r.Stdout)
	}
}

// TestTrajectoryLogOfStoppedSandbox: `opendsecctl sandbox log` reads a
// sandbox's log after the sandbox is stopped (kept for
// node.trajectory.retention_sec), one JSON line per call in order, with
// the call IDs, exit codes and output; --no-output leaves the output out.
func TestTrajectoryLogOfStoppedSandbox(t *testing.T) {
	s := newSystem(t)
	s.Start()
	sb := s.Create(t, nil)
	ctx := t.Context()
	for i, line := range []string{"echo first", "echo second >&2; exit 3"} {
		if _, err := s.Exec(ctx, &opendsecv1.ExecStart{SandboxId: sb.Id, Command: []string{"/bin/sh", "-c", line}, CallId: fmt.Sprintf("r/%d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Sandboxes().StopSandbox(ctx, connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: sb.Id})); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := s.ctl(t, "sandbox", "log", sb.Id)
	if code != 0 {
		t.Fatalf("opendsecctl sandbox log of a stopped sandbox: exit %d: %s", code, errOut)
	}
	var calls []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		if _, ok := m["call_id"]; ok {
			calls = append(calls, m)
		}
	}
	if len(calls) != 2 || calls[0]["call_id"] != "r/0" || calls[1]["call_id"] != "r/1" || calls[1]["exit_code"] != float64(3) {
		t.Fatalf("calls in the stopped sandbox's log: %v; want r/0 then r/1\n%s", calls, out)
	}
	if calls[0]["stdout"] != "Zmlyc3QK" { // "first\n", base64 in protojson
		t.Fatalf("the log has no output of r/0:\n%s", out)
	}
	noOut, _, code := s.ctl(t, "sandbox", "log", "--no-output", sb.Id)
	if code != 0 || strings.Contains(noOut, "Zmlyc3QK") || strings.Count(noOut, `"call_id"`) != 2 {
		t.Fatalf("sandbox log --no-output: exit %d\n%s", code, noOut)
	}
}

// TestTrajectoryReplayGo: the Go client's Replay re-runs a log in a fresh
// sandbox of the same image: a deterministic rollout reports no
// differences; one with a call that reads a random value names that call
// (and only it) as the first difference, on stdout.
func TestTrajectoryReplayGo(t *testing.T) {
	s := newSystem(t)
	s.Start()
	c := s.Client(t)
	ctx := t.Context()
	rollout := func(lines ...string) []*opendsec.TrajectoryEntry {
		t.Helper()
		sb := s.Create(t, nil)
		for i, l := range lines {
			if _, err := c.RunShell(ctx, sb.Id, l, opendsec.WithCallID(fmt.Sprintf("rep/%d", i))); err != nil {
				t.Fatal(err)
			}
		}
		log, err := c.Trajectory(ctx, sb.Id, true)
		if err != nil {
			t.Fatal(err)
		}
		return log
	}
	spec := &opendsecv1.SandboxSpec{Image: "root/busybox"}
	det := rollout("echo 42 > /tmp/x", "cat /tmp/x; echo err >&2", "sh -c 'exit 3'")
	rep, err := c.Replay(ctx, det, opendsec.ReplayOptions{Spec: spec})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Calls != 3 || len(rep.Differences) != 0 {
		t.Fatalf("replay of a deterministic log: %+v; want 3 calls, no differences", rep)
	}
	random := rollout("echo same", "cat /proc/sys/kernel/random/uuid", "echo same again")
	rep, err = c.Replay(ctx, random, opendsec.ReplayOptions{Spec: spec})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Differences) != 1 || rep.Differences[0].CallID != "rep/1" || rep.Differences[0].Field != "stdout" {
		t.Fatalf("replay of a log with a random read: %+v; want exactly rep/1 on stdout", rep.Differences)
	}
	if _, err := c.GetSandbox(ctx, rep.SandboxID); err == nil {
		t.Fatalf("replay sandbox %s still there after Replay without Keep", rep.SandboxID)
	}
	if _, err := c.Replay(ctx, det, opendsec.ReplayOptions{}); err == nil || !strings.Contains(err.Error(), "spec") {
		t.Fatalf("replay without a spec: %v; want an error naming spec", err)
	}
}
