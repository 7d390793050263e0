//go:build linux

package e2e

import (
	"bytes"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/testutil"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/test/harness"
)

// memhogLine starts memhog (uploaded to /memhog) with 20 MiB of written
// random memory, counting into /count.
const memhogLine = "chmod +x /memhog && (/memhog -mib 20 -pattern random >/dev/null 2>&1 </dev/null &)"

func (s *system) count(t *testing.T, id string) int {
	t.Helper()
	r := s.shell(t, id, "cat /count 2>/dev/null || echo 0")
	n, err := strconv.Atoi(strings.TrimSpace(r.stdout))
	if err != nil {
		t.Fatalf("count of %s: %q", id, r.stdout)
	}
	return n
}

func (s *system) countAtLeast(t *testing.T, id string, n int) int {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		if c := s.count(t, id); c >= n {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("count of %s did not reach %d in 15 s", id, n)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
}

// TestPauseTaskReclaim: a task of 10 sandboxes, each holding 20 MiB of
// written memory, paused with reclaim in one call: every sandbox reports
// most of its memory freed and the total is their sum; resume_task brings
// them back with their processes counting on from where they were and
// their memory intact. The test makes zram swap when the host has none.
func TestPauseTaskReclaim(t *testing.T) {
	testutil.EnsureSwap(t, 1<<30)
	s := newSystem(t)
	s.Start()
	c := s.Client(t)
	bin, err := os.ReadFile(harness.BuildPackage(t, "./internal/testutil/memhog", "memhog"))
	if err != nil {
		t.Fatal(err)
	}
	const n = 10
	ids := make([]string, n)
	var wg sync.WaitGroup
	for i := range ids {
		wg.Go(func() {
			sb, err := c.CreateSandbox(t.Context(), &opendsecv1.SandboxSpec{Image: "root/busybox", TaskId: "rl-job"})
			if err != nil {
				t.Errorf("create: %v", err)
				return
			}
			ids[i] = sb.GetId()
			if _, err := c.WriteFile(t.Context(), sb.GetId(), "/memhog", bytes.NewReader(bin), int64(len(bin))); err != nil {
				t.Errorf("upload memhog: %v", err)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	other := s.create(t, &opendsecv1.SandboxSpec{TaskId: "another-job"})
	for _, id := range ids {
		s.shell(t, id, memhogLine)
	}
	for _, id := range ids {
		s.countAtLeast(t, id, 1)
	}
	at := map[string]int{}
	for _, id := range ids {
		at[id] = s.count(t, id) // it moves on a little until the freeze
	}

	t0 := time.Now()
	out, err := c.PauseTask(t.Context(), "rl-job", opendsec.PauseTaskOptions{Reclaim: true})
	took := time.Since(t0)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Sandboxes) != n || len(out.Failures) != 0 || len(out.Reclaimed) != n {
		t.Fatalf("pause_task: %d paused, %d reclaimed, failures %v", len(out.Sandboxes), len(out.Reclaimed), out.Failures)
	}
	var sum int64
	for _, r := range out.Reclaimed {
		if r.GetBytesFreed() < 16<<20 || r.GetBytesBefore()-r.GetBytesAfter() != r.GetBytesFreed() || r.GetNote() != "" {
			t.Fatalf("reclaim of %s: %+v; want at least 16 of its 20 MiB freed", r.GetSandboxId(), r)
		}
		sum += r.GetBytesFreed()
	}
	if out.BytesFreed != sum {
		t.Fatalf("bytes_freed %d, want the sum %d", out.BytesFreed, sum)
	}
	t.Logf("pause_task with reclaim of %d sandboxes: %.1f MiB freed in %s", n, float64(sum)/(1<<20), took.Round(time.Millisecond))
	if st := s.state(t, other.Id); st != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("sandbox of another task is %s", st)
	}
	rr, err := c.ResumeTask(t.Context(), "rl-job", nil)
	if err != nil || len(rr.Sandboxes) != n {
		t.Fatalf("resume_task: %+v %v", rr, err)
	}
	for _, id := range ids {
		// The same process counts on from where it was: not from 1.
		c1 := s.count(t, id)
		if c1 < at[id] {
			t.Fatalf("%s counted %d before the pause and %d after the resume: it started over", id, at[id], c1)
		}
		s.countAtLeast(t, id, c1+3)
		r := s.shell(t, id, "touch /verify; for i in $(seq 500); do [ -f /verify.out ] && break; sleep 0.02; done; cat /verify.out")
		if !strings.HasPrefix(r.stdout, "ok ") {
			t.Fatalf("memory of %s after the resume: %q", id, r.stdout)
		}
	}
	if _, err := c.PauseTask(t.Context(), "no-such-job", opendsec.PauseTaskOptions{Reclaim: true}); !opendsec.IsNotFound(err) || !strings.Contains(err.Error(), "no-such-job") {
		t.Fatalf("pause_task of an unknown task: %v, want not found naming it", err)
	}
}
