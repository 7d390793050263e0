package container

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/testutil"
)

// newFactory returns a Factory whose runtimes share one runc state root, so
// a second instance sees the first one's sandboxes (a node restart).
func newFactory(t *testing.T) runtimetest.Factory {
	return newFactoryWith(t, nil)
}

// newFactoryWith is newFactory with mod applied to every runtime's Config
// (e.g. another init binary or agent idle exit).
func newFactoryWith(t *testing.T, mod func(*Config)) runtimetest.Factory {
	testutil.RequiresRoot(t)
	root := t.TempDir()
	layer := testutil.BusyboxRootfs(t)
	agent := testutil.AgentBinary(t)
	return func(t *testing.T) (runtime.Runtime, runtime.Spec) {
		cfg := Config{StateRoot: filepath.Join(root, "runc"), CgroupParent: "/opendsec-test", AgentPath: agent, OCIRuntime: testOCIRuntime(t)}
		if mod != nil {
			mod(&cfg)
		}
		rt, err := New(cfg)
		if err != nil {
			t.Fatalf("new container runtime: %v", err)
		}
		return rt, runtime.Spec{
			Rootfs: runtime.Rootfs{Image: "test/busybox", Layers: []runtime.Layer{{Format: runtime.LayerDir, Path: layer}}},
			// Every sandbox of the package tests has a writable-layer quota
			// (the image mechanism here): diff, stats and recover run on it.
			Resources: runtime.Resources{CPU: 1, MemoryMB: 128, PidsLimit: 128, DiskMB: 64},
		}
	}
}

// killInit ends a sandbox's init from outside, as `kill -9` of its host pid.
func killInit(t testing.TB, rt runtime.Runtime, id string) {
	t.Helper()
	st, err := rt.Status(context.Background(), id)
	if err != nil {
		t.Fatalf("status of %s: %v", id, err)
	}
	if st.Pid <= 0 {
		t.Fatalf("sandbox %s has no init pid (state %s)", id, st.State)
	}
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 %d: %v", st.Pid, err)
	}
}

// TestConformance runs the backend contract under each OCI runtime.
func TestConformance(t *testing.T) {
	for _, kind := range ociRuntimes {
		t.Run(kind, func(t *testing.T) {
			requireOCIRuntime(t, kind)
			f := newFactoryWith(t, func(c *Config) { c.OCIRuntime = kind })
			rt, _ := f(t)
			if got := rt.(*Runtime).oci.kind; got != kind {
				t.Fatalf("runtime runs containers with %s, want %s", got, kind)
			}
			runtimetest.Suite(t, f, runtimetest.Options{Exec: true, Kill: killInit})
		})
	}
}

// TestInitDetached checks that the sandbox's init is not our child, so it
// survives the node process being killed.
func TestInitDetached(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	spec, _ := runtimetest.StartSandbox(t, rt, tmpl)
	st, err := rt.Status(t.Context(), spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	ppid := parentPid(t, st.Pid)
	if ppid == os.Getpid() {
		t.Fatalf("init %d is a child of the node process", st.Pid)
	}
	// The container sits in its own cgroup under the parent.
	c := rt.(*Runtime)
	if dirs := c.CgroupDirs(spec.ID); len(dirs) == 0 {
		t.Fatalf("no cgroup dirs for %s", spec.ID)
	}
	if err := rt.Delete(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	if dirs := c.CgroupDirs(spec.ID); len(dirs) != 0 {
		t.Fatalf("cgroup dirs left after delete: %v", dirs)
	}
}

// TestCreateFailureUndoes makes Create fail after it has mounted and written
// things (config.json not writable), or after its tmpfs mounts but before
// the root (the layer mounter fails), and checks nothing is left.
func TestCreateFailureUndoes(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	erofs := filepath.Join(t.TempDir(), "layer.erofs")
	if err := os.WriteFile(erofs, []byte("not really erofs"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := map[string]func(*runtime.Spec){
		// config.json cannot be written (testHookConfigWrite): fails
		// after both mounts are made.
		"config": func(s *runtime.Spec) {
			id := s.ID
			testHookConfigWrite = func(got string) error {
				if got == id {
					return errors.New("test: config.json not writable")
				}
				return nil
			}
			t.Cleanup(func() { testHookConfigWrite = nil })
		},
		// The image store cannot mount the layer: fails after the tmpfs
		// mounts, before the overlay root.
		"mounter": func(s *runtime.Spec) {
			s.Rootfs.Layers = []runtime.Layer{{Format: runtime.LayerEROFS, Path: erofs}}
			s.Rootfs.Mounter = failingMounter{}
		},
	}
	for name, mutate := range cases {
		t.Run(name, func(t *testing.T) {
			spec := runtimetest.Prepare(t, rt, tmpl)
			mutate(&spec)
			if _, err := rt.Create(t.Context(), spec); err == nil {
				t.Fatalf("create succeeded")
			} else {
				t.Logf("create: %v", err)
			}
			if _, err := os.Stat(filepath.Join(c.cfg.StateRoot, spec.ID)); err == nil {
				t.Errorf("runc state left for %s", spec.ID)
			}
			if _, err := os.Stat(c.intentPath(spec.ID)); err == nil {
				t.Errorf("intent record left for %s", spec.ID)
			}
			if dirs := c.CgroupDirs(spec.ID); len(dirs) != 0 {
				t.Errorf("cgroups left: %v", dirs)
			}
			runtimetest.AssertNoLeftovers(t, spec.StateDir, 0)
			if _, err := rt.Status(t.Context(), spec.ID); err == nil {
				t.Errorf("failed sandbox is still known")
			}
		})
	}
}

// TestStartFailureLeavesNothing: runc run fails in the container's init
// (opendsec-init lost its exec bit after Create). Start reports it, runc keeps no
// record, the sandbox stays created, and Delete removes everything.
func TestStartFailureLeavesNothing(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "opendsec-init")
	if err := os.WriteFile(bad, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	f := newFactoryWith(t, func(c *Config) { c.InitPath = bad })
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	spec := runtimetest.Prepare(t, rt, tmpl)
	ctx := t.Context()
	if _, err := rt.Create(ctx, spec); err != nil {
		t.Fatalf("create: %v", err)
	}
	if err := os.Chmod(bad, 0o644); err != nil {
		t.Fatal(err)
	}
	err := rt.Start(ctx, spec.ID)
	if err == nil {
		t.Fatalf("start of a sandbox whose init is not a program succeeded")
	}
	t.Logf("start: %v", err)
	if _, err := os.Stat(filepath.Join(c.cfg.StateRoot, spec.ID)); err == nil {
		t.Errorf("runc state left for %s after a failed start", spec.ID)
	}
	if st, err := rt.Status(ctx, spec.ID); err != nil || st.State != runtime.StateCreated {
		t.Errorf("status after a failed start = %+v, %v; want created", st, err)
	}
	if err := rt.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	runtimetest.AssertNoLeftovers(t, spec.StateDir, 0)
	if dirs := c.CgroupDirs(spec.ID); len(dirs) != 0 {
		t.Errorf("cgroups left: %v", dirs)
	}
}

// TestRecoverCreated: a node restart between Create and Start. The fresh
// runtime recovers the prepared sandbox as created and can start it.
func TestRecoverCreated(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	ctx := t.Context()
	spec := runtimetest.Prepare(t, rt, tmpl)
	h, err := rt.Create(ctx, spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	rt2, _ := f(t)
	if err := rt2.Recover(ctx, h); err != nil {
		t.Fatalf("recover created sandbox: %v", err)
	}
	t.Cleanup(func() { rt2.Delete(context.Background(), spec.ID) })
	if st, err := rt2.Status(ctx, spec.ID); err != nil || st.State != runtime.StateCreated {
		t.Fatalf("status after recover = %+v, %v; want created", st, err)
	}
	if err := rt2.Start(ctx, spec.ID); err != nil {
		t.Fatalf("start recovered sandbox: %v", err)
	}
	if err := runtimetest.WaitAgent(ctx, rt2, spec.ID, 20*time.Second); err != nil {
		t.Fatal(err)
	}
	st, err := rt2.Status(ctx, spec.ID)
	if err != nil || st.State != runtime.StateRunning || st.Pid <= 0 {
		t.Fatalf("status after start = %+v, %v; want running with a pid", st, err)
	}
	if err := rt2.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	runtimetest.AssertNoLeftovers(t, spec.StateDir, st.Pid)
}

// TestDeleteAfterCrashBeforeRuncCreate: the node crashed after mounting the
// sandbox's root but before `runc create`; a fresh runtime's Delete by ID
// still removes the mounts and files (found through Create's intent record).
func TestDeleteAfterCrashBeforeRuncCreate(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	spec := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	// Make it look as if runc never ran: drop runc's record only.
	if out, err := exec.Command(c.oci.path, "--root", c.cfg.StateRoot, "delete", "--force", spec.ID).CombinedOutput(); err != nil {
		t.Fatalf("runc delete: %v: %s", err, out)
	}
	if len(runtimetest.MountsUnder(t, spec.StateDir)) == 0 {
		t.Fatalf("test setup: no mounts under the state dir")
	}
	rt2, _ := f(t)
	if err := rt2.Delete(t.Context(), spec.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	runtimetest.AssertNoLeftovers(t, spec.StateDir, 0)
	if dirs := c.CgroupDirs(spec.ID); len(dirs) != 0 {
		t.Fatalf("cgroups left: %v", dirs)
	}
	if _, err := os.Stat(c.intentPath(spec.ID)); err == nil {
		t.Fatalf("intent record left")
	}
}

// TestLaunchUsesExecFifo: a prestarted container has runc's exec fifo,
// which Launch reads itself instead of running `runc start`; afterwards the
// fifo is gone and runc itself reports the container running.
func TestLaunchUsesExecFifo(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	c := rt.(*Runtime)
	spec := runtimetest.Prepare(t, rt, tmpl)
	if _, err := rt.Create(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	if err := c.Prestart(t.Context(), spec.ID); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(c.cfg.StateRoot, spec.ID, execFifo)
	if st, err := os.Lstat(fifo); err != nil || st.Mode()&os.ModeNamedPipe == 0 {
		t.Fatalf("prestarted container has no exec fifo at %s (%v): Launch would fall back to runc start", fifo, err)
	}
	if err := c.Launch(t.Context(), spec.ID, []string{"X=1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(fifo); !os.IsNotExist(err) {
		t.Fatalf("exec fifo still there after Launch: %v", err)
	}
	s, err := c.runcState(t.Context(), c.cfg.StateRoot, spec.ID)
	if err != nil || s.Status != "running" {
		t.Fatalf("runc state after Launch: %+v, %v", s, err)
	}
	if err := runtimetest.WaitAgent(t.Context(), rt, spec.ID, 20*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := rt.Stop(t.Context(), spec.ID, runtimetest.StopOptions()); err != nil {
		t.Fatal(err)
	}
}

// failingMounter is an image store that cannot mount anything.
type failingMounter struct{}

func (failingMounter) MountLayers(context.Context, string, []runtime.Layer) ([]string, error) {
	return nil, errors.New("injected mount failure")
}
