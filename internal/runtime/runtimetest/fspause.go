package runtimetest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// testFilesystemPause: a filesystem-only pause ends the sandbox (Wait
// callers of the time see it, saying so), keeps its files, survives a
// Recover by a second instance, and ResumeFilesystem starts it again on
// them with the launch env a prestarted sandbox had, its next end seen by
// a Wait called while it was paused; Stop and Delete work while paused.
func testFilesystemPause(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	fp, ok := rt.(runtime.FilesystemPauser)
	if !ok {
		t.Skipf("backend %s cannot pause keeping only files (no runtime.FilesystemPauser)", rt.Info().Name)
	}
	if !rt.Info().Capabilities.FilesystemPause {
		t.Fatalf("backend implements FilesystemPauser but Capabilities.FilesystemPause is false")
	}
	ctx := t.Context()
	spec := Prepare(t, rt, tmpl)
	h, err := rt.Create(ctx, spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if ps, ok := rt.(runtime.Prestarter); ok {
		if err := ps.Prestart(ctx, spec.ID); err != nil {
			t.Fatalf("prestart: %v", err)
		}
		if err := ps.Launch(ctx, spec.ID, []string{"FROM_LAUNCH=yes"}); err != nil {
			t.Fatalf("launch: %v", err)
		}
	} else if err := rt.Start(ctx, spec.ID); err != nil {
		t.Fatalf("start: %v", err)
	}
	if err := WaitAgent(ctx, rt, spec.ID, agentTimeout); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(ctx, rt, spec.ID, "/kept", []byte("files stay")); err != nil {
		t.Fatal(err)
	}
	ended := make(chan runtime.ExitStatus, 1)
	go func() {
		st, _ := rt.Wait(context.WithoutCancel(ctx), spec.ID)
		ended <- st
	}()
	if err := fp.PauseFilesystem(ctx, spec.ID); err != nil {
		t.Fatalf("filesystem pause: %v", err)
	}
	select {
	case st := <-ended:
		if !strings.Contains(st.Reason, "files") {
			t.Fatalf("Wait after a filesystem pause: reason %q, want it to say the files were kept", st.Reason)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a Wait from before the filesystem pause did not return in 10 s")
	}
	st := mustState(t, rt, spec.ID, runtime.StatePaused)
	if !st.FilesystemPaused {
		t.Fatalf("status after the filesystem pause: %+v, want FilesystemPaused", st)
	}
	hctx, cancel := context.WithTimeout(ctx, time.Second)
	if code, err := Health(hctx, rt, spec.ID); err == nil {
		t.Fatalf("agent of a filesystem-paused sandbox answered %d", code)
	}
	cancel()
	if err := fp.PauseFilesystem(ctx, spec.ID); err != nil {
		t.Fatalf("second filesystem pause (idempotent): %v", err)
	}

	// A second instance (the node restarted) finds it paused so.
	rt2, _ := f(t)
	if err := rt2.Recover(ctx, h); err != nil {
		t.Fatalf("recover a filesystem-paused sandbox: %v", err)
	}
	if st := mustState(t, rt2, spec.ID, runtime.StatePaused); !st.FilesystemPaused {
		t.Fatalf("status after recover: %+v, want FilesystemPaused", st)
	}
	next := make(chan error, 1)
	go func() {
		_, err := rt2.Wait(context.WithoutCancel(ctx), spec.ID)
		next <- err
	}()
	if err := rt2.(runtime.FilesystemPauser).ResumeFilesystem(ctx, spec.ID); err != nil {
		t.Fatalf("resume filesystem after recover: %v", err)
	}
	mustState(t, rt2, spec.ID, runtime.StateRunning)
	mustAlive(t, rt2, spec.ID, o)
	if b, err := ReadFile(ctx, rt2, spec.ID, "/kept"); err != nil || string(b) != "files stay" {
		t.Fatalf("file after the resume: %q %v", b, err)
	}
	if _, ok := rt.(runtime.Prestarter); ok && o.Exec {
		res, err := Run(ctx, rt2, spec.ID, "", "/bin/sh", "-c", `echo "$FROM_LAUNCH"`)
		if err != nil || res.Stdout != "yes\n" {
			t.Fatalf("launch env after the resume: %+v %v, want it kept", res, err)
		}
	}
	select {
	case err := <-next:
		t.Fatalf("a Wait called while paused returned while the resumed sandbox runs: %v", err)
	default:
	}
	o.Kill(t, rt2, spec.ID)
	select {
	case err := <-next:
		if err != nil {
			t.Fatalf("Wait for the resumed sandbox: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a Wait called while paused did not see the resumed sandbox end in 10 s")
	}

	// Stop and Delete of a filesystem-paused sandbox.
	spec2, _ := StartSandbox(t, rt2, tmpl)
	if err := rt2.(runtime.FilesystemPauser).PauseFilesystem(ctx, spec2.ID); err != nil {
		t.Fatal(err)
	}
	if err := rt2.Stop(ctx, spec2.ID, StopOptions()); err != nil {
		t.Fatalf("stop a filesystem-paused sandbox: %v", err)
	}
	if err := rt2.Delete(ctx, spec2.ID); err != nil {
		t.Fatalf("delete a filesystem-paused sandbox: %v", err)
	}
	mustNotFound(t, rt2, spec2.ID)
	AssertNoLeftovers(t, spec2.StateDir, 0)
	if err := rt2.(runtime.FilesystemPauser).ResumeFilesystem(ctx, spec2.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("resume a deleted sandbox: %v, want not found", err)
	}
}
