package opendsec_test

import (
	"testing"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestPauseResumeMetrics(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	ctx := t.Context()
	var job []string
	for range 3 {
		sb, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox", TaskId: "job", AutoPause: true})
		if err != nil {
			t.Fatal(err)
		}
		if !sb.GetSpec().GetAutoPause() {
			t.Fatalf("auto_pause not sent")
		}
		job = append(job, sb.GetId())
	}
	sb, err := c.PauseSandbox(ctx, job[0])
	if err != nil || sb.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("pause: %v %v", sb.GetState(), err)
	}
	m, err := c.SandboxMetrics(ctx, job[0])
	if err != nil || m.GetMemTotalBytes() != 512<<20 || m.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("metrics: %v %v", m, err)
	}
	sb, err = c.ResumeSandbox(ctx, job[0], 0)
	if err != nil || sb.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("resume: %v %v", sb.GetState(), err)
	}
	out, err := c.PauseSandboxes(ctx, opendsec.Selector{TaskID: "job"})
	if err != nil || len(out.Sandboxes) != 3 || len(out.Failures) != 0 {
		t.Fatalf("batch pause: %+v %v", out, err)
	}
	out, err = c.ResumeSandboxes(ctx, opendsec.Selector{IDs: job[:2]}, 0)
	if err != nil || len(out.Sandboxes) != 2 {
		t.Fatalf("batch resume: %+v %v", out, err)
	}
	if _, err := c.PauseSandboxes(ctx, opendsec.Selector{}); !opendsec.IsInvalidArgument(err) {
		t.Fatalf("empty selector: %v", err)
	}
	if _, err := c.ResumeSandbox(ctx, job[0], -1); !opendsec.IsInvalidArgument(err) {
		t.Fatalf("negative timeout: %v", err)
	}
	if _, err := c.PauseSandbox(ctx, "nosuch"); !opendsec.IsNotFound(err) {
		t.Fatalf("unknown sandbox: %v", err)
	}
	sb, freed, err := c.PauseSandboxReclaim(ctx, job[2])
	if err != nil || sb.GetState() != opendsecv1.SandboxState_SANDBOX_STATE_PAUSED || freed != 1<<20-64<<10 {
		t.Fatalf("pause with reclaim: %v %d %v", sb.GetState(), freed, err)
	}
	if _, _, err := c.PauseSandboxReclaim(ctx, ""); !opendsec.IsInvalidArgument(err) {
		t.Fatalf("empty id: %v", err)
	}
}

func TestPauseTaskReclaim(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	ctx := t.Context()
	for range 2 {
		if _, err := c.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: "root/busybox", TaskId: "job"}); err != nil {
			t.Fatal(err)
		}
	}
	out, err := c.PauseTask(ctx, "job", opendsec.PauseTaskOptions{Reclaim: true})
	if err != nil || len(out.Sandboxes) != 2 || len(out.Reclaimed) != 2 || out.BytesFreed != 2*(1<<20-64<<10) {
		t.Fatalf("pause task with reclaim: %+v %v", out, err)
	}
	out, err = c.ResumeTask(ctx, "job", nil)
	if err != nil || len(out.Sandboxes) != 2 || out.Sandboxes[0].GetState() != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("resume task: %+v %v", out, err)
	}
	if _, err := c.PauseTask(ctx, "nosuch", opendsec.PauseTaskOptions{Reclaim: true}); !opendsec.IsNotFound(err) {
		t.Fatalf("unknown task: %v, want not found", err)
	}
	if _, err := c.PauseTask(ctx, "", opendsec.PauseTaskOptions{}); !opendsec.IsInvalidArgument(err) {
		t.Fatalf("empty task: %v, want invalid argument", err)
	}
}
