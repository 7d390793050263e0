package runtimetest

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Factory returns a backend and a Spec template (rootfs layers, resources,
// guest settings). Every Runtime a Factory returns within one top-level
// Suite run must share node state (like the same node before and after a
// restart), so a second instance can Recover sandboxes made by the first.
// Suite fills ID and StateDir.
type Factory func(t *testing.T) (runtime.Runtime, runtime.Spec)

// Options says what the suite may rely on beyond the contract.
type Options struct {
	// Exec: the sandbox runs the real opendsec-agent with a shell in its
	// image, so the suite also checks processes (echo, env, a counter that
	// must not advance while paused). Without it the suite observes the
	// sandbox through the agent's /health and /files only.
	Exec bool
	// Kill ends a running sandbox's init from outside the backend, as a
	// crash or `kill -9` would (for the container backend: SIGKILL to
	// init's host pid). Required.
	Kill func(t testing.TB, rt runtime.Runtime, id string)
	// Concurrency is how many sandboxes the Concurrent case creates and
	// starts at once (0: 10); a backend whose sandboxes are heavy (VMs
	// under TCG) sets fewer, at least 2.
	Concurrency int
}

// agentTimeout bounds how long a started sandbox may take to answer /health.
const agentTimeout = 20 * time.Second

// Suite runs the conformance tests against the backend f builds.
func Suite(t *testing.T, f Factory, o Options) {
	if o.Kill == nil {
		t.Fatal("runtimetest.Options.Kill is required")
	}
	if o.Concurrency == 1 || o.Concurrency < 0 {
		t.Fatalf("runtimetest.Options.Concurrency %d: the Concurrent case needs at least 2 (0 means 10)", o.Concurrency)
	}
	t.Run("Capabilities", func(t *testing.T) { testCapabilities(t, f) })
	t.Run("Lifecycle", func(t *testing.T) { testLifecycle(t, f, o) })
	t.Run("Files", func(t *testing.T) { testFiles(t, f, o) })
	t.Run("PTY", func(t *testing.T) { testPTY(t, f, o) })
	t.Run("Wait", func(t *testing.T) { testWait(t, f, o) })
	t.Run("Options", func(t *testing.T) { testOptions(t, f) })
	t.Run("DeleteIdempotent", func(t *testing.T) { testDeleteIdempotent(t, f) })
	t.Run("StopCreated", func(t *testing.T) { testStopCreated(t, f) })
	t.Run("DeleteRunning", func(t *testing.T) { testDeleteRunning(t, f) })
	t.Run("BadSpecLeavesNothing", func(t *testing.T) { testBadSpec(t, f) })
	t.Run("DuplicateID", func(t *testing.T) { testDuplicate(t, f) })
	t.Run("Recover", func(t *testing.T) { testRecover(t, f, o) })
	t.Run("DeleteWithoutRecover", func(t *testing.T) { testDeleteWithoutRecover(t, f) })
	t.Run("LongStateDir", func(t *testing.T) { testLongStateDir(t, f, o) })
	t.Run("Concurrent", func(t *testing.T) { testConcurrent(t, f, o, cmp.Or(o.Concurrency, 10)) })
	t.Run("Pause", func(t *testing.T) { testPause(t, f, o) })
	t.Run("PauseRecover", func(t *testing.T) { testPauseRecover(t, f, o) })
	t.Run("FilesystemPause", func(t *testing.T) { testFilesystemPause(t, f, o) })
	t.Run("Stats", func(t *testing.T) { testStats(t, f, o) })
	t.Run("Prestart", func(t *testing.T) { testPrestart(t, f, o) })
	t.Run("Snapshot", func(t *testing.T) { testSnapshot(t, f) })
	t.Run("Fork", func(t *testing.T) { testFork(t, f) })
	t.Run("RootfsDiff", func(t *testing.T) { testRootfsDiff(t, f) })
}

// testPrestart: a prestarted sandbox runs nothing (its agent does not
// answer) until Launch, which gives its agent the launch env on top of the
// image's; a prestarted sandbox that is never launched stops and deletes
// without leftovers.
func testPrestart(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	ps, ok := rt.(runtime.Prestarter)
	if !ok {
		t.Skipf("backend %s cannot prestart sandboxes (no runtime.Prestarter)", rt.Info().Name)
	}
	ctx := t.Context()
	tmpl.Guest.Env = append(tmpl.Guest.Env, "FROM_IMAGE=img", "OVERRIDDEN=image")
	spec := Prepare(t, rt, tmpl)
	if _, err := rt.Create(ctx, spec); err != nil {
		t.Fatalf("create: %v", err)
	}
	if err := ps.Prestart(ctx, spec.ID); err != nil {
		t.Fatalf("prestart: %v", err)
	}
	st := mustState(t, rt, spec.ID, runtime.StateCreated)
	// Nothing runs: a health request waits in the socket's backlog.
	hctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	code, err := Health(hctx, rt, spec.ID)
	cancel()
	if err == nil {
		t.Fatalf("agent of a prestarted, never launched sandbox answered %d", code)
	}
	if err := ps.Launch(ctx, spec.ID, []string{"FROM_LAUNCH=yes", "OVERRIDDEN=launch"}); err != nil {
		t.Fatalf("launch: %v", err)
	}
	if err := WaitAgent(ctx, rt, spec.ID, agentTimeout); err != nil {
		t.Fatal(err)
	}
	mustState(t, rt, spec.ID, runtime.StateRunning)
	if o.Exec {
		res, err := Run(ctx, rt, spec.ID, "", "/bin/sh", "-c", `echo "$FROM_IMAGE,$FROM_LAUNCH,$OVERRIDDEN"`)
		if err != nil {
			t.Fatal(err)
		}
		if res.Stdout != "img,yes,launch\n" {
			t.Fatalf("env after launch: %q; want the guest env with the launch env on top", res.Stdout)
		}
	}
	if err := ps.Launch(ctx, spec.ID, nil); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("second launch: %v; want a failed precondition", err)
	}
	if err := rt.Stop(ctx, spec.ID, StopOptions()); err != nil {
		t.Fatal(err)
	}
	if err := rt.Delete(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	AssertNoLeftovers(t, spec.StateDir, st.Pid)

	// Never launched.
	spec2 := Prepare(t, rt, tmpl)
	if _, err := rt.Create(ctx, spec2); err != nil {
		t.Fatalf("create: %v", err)
	}
	if err := ps.Prestart(ctx, spec2.ID); err != nil {
		t.Fatalf("prestart: %v", err)
	}
	st2 := mustState(t, rt, spec2.ID, runtime.StateCreated)
	if st2.Pid <= 0 {
		t.Fatalf("prestarted sandbox reports pid %d", st2.Pid)
	}
	if err := rt.Stop(ctx, spec2.ID, StopOptions()); err != nil {
		t.Fatal(err)
	}
	if err := rt.Delete(ctx, spec2.ID); err != nil {
		t.Fatal(err)
	}
	mustNotFound(t, rt, spec2.ID)
	AssertNoLeftovers(t, spec2.StateDir, st2.Pid)
}

// NewID returns a fresh sandbox ID ([a-z0-9]).
func NewID(prefix string) string {
	b := make([]byte, 6)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// Prepare fills spec's ID and StateDir (a fresh directory) and registers a
// cleanup that deletes the sandbox.
func Prepare(t testing.TB, rt runtime.Runtime, spec runtime.Spec) runtime.Spec {
	t.Helper()
	spec.ID = NewID("rt")
	spec.StateDir = filepath.Join(t.TempDir(), spec.ID)
	if err := os.Mkdir(spec.StateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// t.Context() is already canceled when cleanups run.
		if err := rt.Delete(context.Background(), spec.ID); err != nil {
			t.Errorf("cleanup: delete %s: %v", spec.ID, err)
		}
	})
	return spec
}

// StartSandbox creates and starts a sandbox from spec and waits for its
// agent; the sandbox is deleted when the test ends.
func StartSandbox(t testing.TB, rt runtime.Runtime, spec runtime.Spec) (runtime.Spec, runtime.Handle) {
	t.Helper()
	spec = Prepare(t, rt, spec)
	ctx := t.Context()
	h, err := rt.Create(ctx, spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if err := rt.Start(ctx, spec.ID); err != nil {
		t.Fatalf("start: %v", err)
	}
	if err := WaitAgent(ctx, rt, spec.ID, agentTimeout); err != nil {
		t.Fatal(err)
	}
	return spec, h
}

func mustState(t testing.TB, rt runtime.Runtime, id string, want runtime.State) runtime.Status {
	t.Helper()
	st, err := rt.Status(t.Context(), id)
	if err != nil {
		t.Fatalf("status %s: %v", id, err)
	}
	if st.State != want {
		t.Fatalf("status %s = %s, want %s", id, st.State, want)
	}
	return st
}

func mustNotFound(t testing.TB, rt runtime.Runtime, id string) {
	t.Helper()
	_, err := rt.Status(t.Context(), id)
	if !errdefs.IsNotFound(err) {
		t.Fatalf("status of %s after delete: err = %v, want not found", id, err)
	}
}

// mustAlive checks that the sandbox's agent answers and, with Exec, runs a
// process.
func mustAlive(t testing.TB, rt runtime.Runtime, id string, o Options) {
	t.Helper()
	code, err := Health(t.Context(), rt, id)
	if err != nil || code != http.StatusNoContent {
		t.Fatalf("GET /health of %s = %d, %v; want 204", id, code, err)
	}
	if !o.Exec {
		return
	}
	res, err := Run(t.Context(), rt, id, "", "echo", "hi")
	if err != nil {
		t.Fatalf("run echo hi in %s: %v", id, err)
	}
	if res.Stdout != "hi\n" || res.ExitCode != 0 {
		t.Fatalf("echo hi in %s: stdout %q exit %d stderr %q", id, res.Stdout, res.ExitCode, res.Stderr)
	}
}

// AssertNoLeftovers checks that nothing the sandbox made is left: no mount
// under stateDir, no process with pid (when > 0) and no files in stateDir.
func AssertNoLeftovers(t testing.TB, stateDir string, pid int) {
	t.Helper()
	if m := MountsUnder(t, stateDir); len(m) > 0 {
		t.Errorf("mounts left under %s: %v", stateDir, m)
	}
	if pid > 0 {
		// Init was reparented away from us; a dead one may stay a zombie
		// until the host's PID 1 reaps it, which holds nothing but the pid.
		deadline := time.Now().Add(5 * time.Second)
		for {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
			if err != nil {
				break
			}
			if i := bytes.LastIndexByte(b, ')'); i > 0 && i+2 < len(b) && b[i+2] == 'Z' {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("init pid %d still running: %s", pid, b)
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if ents, err := os.ReadDir(stateDir); err == nil && len(ents) > 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("files left in %s: %v", stateDir, names)
	}
}

// MountsUnder returns the mount points in /proc/self/mountinfo at or below dir.
func MountsUnder(t testing.TB, dir string) []string {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) > 4 && (fs[4] == dir || strings.HasPrefix(fs[4], dir+"/")) {
			out = append(out, fs[4])
		}
	}
	return out
}

func testLifecycle(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	ctx := t.Context()
	spec := Prepare(t, rt, tmpl)
	if _, err := rt.Create(ctx, spec); err != nil {
		t.Fatalf("create: %v", err)
	}
	mustState(t, rt, spec.ID, runtime.StateCreated)
	if err := rt.Start(ctx, spec.ID); err != nil {
		t.Fatalf("start: %v", err)
	}
	st := mustState(t, rt, spec.ID, runtime.StateRunning)
	if st.Pid <= 0 {
		t.Fatalf("running sandbox reports pid %d", st.Pid)
	}
	if err := WaitAgent(ctx, rt, spec.ID, agentTimeout); err != nil {
		t.Fatal(err)
	}
	code, err := Health(ctx, rt, spec.ID)
	if err != nil || code != http.StatusNoContent {
		t.Fatalf("GET /health = %d, %v; want 204", code, err)
	}
	mustAlive(t, rt, spec.ID, o)
	if err := rt.Stop(ctx, spec.ID, runtime.StopOptions{Timeout: 2 * time.Second}); err != nil {
		t.Fatalf("stop: %v", err)
	}
	mustState(t, rt, spec.ID, runtime.StateStopped)
	if _, err := Health(ctx, rt, spec.ID); err == nil {
		t.Fatalf("agent still answers after stop")
	}
	if c, err := rt.AgentConn(ctx, spec.ID); !errors.Is(err, errdefs.ErrUnavailable) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("agent conn of a stopped sandbox: err = %v, want unavailable", err)
	}
	if err := rt.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	mustNotFound(t, rt, spec.ID)
	AssertNoLeftovers(t, spec.StateDir, st.Pid)
	if err := rt.Start(ctx, spec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("start after delete: err = %v, want not found", err)
	}
	if err := rt.Stop(ctx, spec.ID, runtime.StopOptions{}); !errdefs.IsNotFound(err) {
		t.Fatalf("stop after delete: err = %v, want not found", err)
	}
	if _, err := rt.AgentConn(ctx, spec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("agent conn after delete: err = %v, want not found", err)
	}
}

func testDeleteIdempotent(t *testing.T, f Factory) {
	rt, tmpl := f(t)
	ctx := t.Context()
	if err := rt.Delete(ctx, NewID("never")); err != nil {
		t.Fatalf("delete of an unknown sandbox: %v", err)
	}
	spec := Prepare(t, rt, tmpl)
	if _, err := rt.Create(ctx, spec); err != nil {
		t.Fatalf("create: %v", err)
	}
	// Never started: Delete must still remove everything.
	for i := range 2 {
		if err := rt.Delete(ctx, spec.ID); err != nil {
			t.Fatalf("delete #%d: %v", i+1, err)
		}
	}
	mustNotFound(t, rt, spec.ID)
	AssertNoLeftovers(t, spec.StateDir, 0)
}

func testStopCreated(t *testing.T, f Factory) {
	rt, tmpl := f(t)
	ctx := t.Context()
	spec := Prepare(t, rt, tmpl)
	if _, err := rt.Create(ctx, spec); err != nil {
		t.Fatalf("create: %v", err)
	}
	for i := range 2 {
		if err := rt.Stop(ctx, spec.ID, StopOptions()); err != nil {
			t.Fatalf("stop #%d of a created sandbox: %v", i+1, err)
		}
	}
	mustState(t, rt, spec.ID, runtime.StateStopped)
	if err := rt.Start(ctx, spec.ID); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("start of a stopped sandbox: err = %v, want failed precondition", err)
	}
	if err := rt.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	AssertNoLeftovers(t, spec.StateDir, 0)
}

// StopOptions returns stop options with a short grace period.
func StopOptions() runtime.StopOptions { return runtime.StopOptions{Timeout: time.Second} }

func testDeleteRunning(t *testing.T, f Factory) {
	rt, tmpl := f(t)
	spec, _ := StartSandbox(t, rt, tmpl)
	st := mustState(t, rt, spec.ID, runtime.StateRunning)
	if err := rt.Delete(t.Context(), spec.ID); err != nil {
		t.Fatalf("delete running: %v", err)
	}
	mustNotFound(t, rt, spec.ID)
	AssertNoLeftovers(t, spec.StateDir, st.Pid)
}

func testBadSpec(t *testing.T, f Factory) {
	rt, tmpl := f(t)
	cases := map[string]func(*runtime.Spec){
		"no id":     func(s *runtime.Spec) { s.ID = "" },
		"no layers": func(s *runtime.Spec) { s.Rootfs.Layers = nil },
		"missing layer": func(s *runtime.Spec) {
			s.Rootfs.Layers = []runtime.Layer{{Format: runtime.LayerDir, Path: "/nonexistent/opendsec/layer"}}
		},
		"relative layer": func(s *runtime.Spec) {
			s.Rootfs.Layers = []runtime.Layer{{Format: runtime.LayerDir, Path: "relative/dir"}}
		},
		"no state dir":  func(s *runtime.Spec) { s.StateDir = "" },
		"memory zero":   func(s *runtime.Spec) { s.Resources.MemoryMB = 0 },
		"memory neg":    func(s *runtime.Spec) { s.Resources.MemoryMB = -1 },
		"cpu negative":  func(s *runtime.Spec) { s.Resources.CPU = -1 },
		"pids negative": func(s *runtime.Spec) { s.Resources.PidsLimit = -5 },
		"bad env":       func(s *runtime.Spec) { s.Guest.Env = []string{"NOEQUALS"} },
		"relative netns": func(s *runtime.Spec) {
			s.Network = runtime.NetworkAttachment{Mode: runtime.NetworkVeth, NetNS: "rel/ns"}
		},
	}
	for name, mutate := range cases {
		t.Run(strings.ReplaceAll(name, " ", "_"), func(t *testing.T) {
			spec := tmpl
			spec.ID = NewID("bad")
			spec.StateDir = filepath.Join(t.TempDir(), "state")
			if err := os.Mkdir(spec.StateDir, 0o700); err != nil {
				t.Fatal(err)
			}
			dir := spec.StateDir
			mutate(&spec)
			_, err := rt.Create(t.Context(), spec)
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("create: err = %v, want invalid argument", err)
			}
			var fe *errdefs.FieldError
			if !errors.As(err, &fe) || fe.Field == "" {
				t.Fatalf("create: err %v does not name the field", err)
			}
			if spec.ID != "" {
				mustNotFound(t, rt, spec.ID)
			}
			AssertNoLeftovers(t, dir, 0)
		})
	}
}

func testDuplicate(t *testing.T, f Factory) {
	rt, tmpl := f(t)
	spec := Prepare(t, rt, tmpl)
	if _, err := rt.Create(t.Context(), spec); err != nil {
		t.Fatalf("create: %v", err)
	}
	again := spec
	again.StateDir = filepath.Join(t.TempDir(), "again")
	if err := os.Mkdir(again.StateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.Create(t.Context(), again); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("second create with the same id: err = %v, want already exists", err)
	}
	AssertNoLeftovers(t, again.StateDir, 0)
	mustState(t, rt, spec.ID, runtime.StateCreated)
}

func testRecover(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	ctx := t.Context()
	spec, h := StartSandbox(t, rt, tmpl)
	stopped, hStopped := StartSandbox(t, rt, tmpl)
	if err := rt.Stop(ctx, stopped.ID, runtime.StopOptions{}); err != nil {
		t.Fatalf("stop: %v", err)
	}

	// A new instance, as after a node restart.
	rt2, _ := f(t)
	if _, err := rt2.Status(ctx, spec.ID); !errdefs.IsNotFound(err) {
		t.Fatalf("fresh runtime knows %s before Recover: %v", spec.ID, err)
	}
	if err := rt2.Recover(ctx, h); err != nil {
		t.Fatalf("recover: %v", err)
	}
	t.Cleanup(func() { rt2.Delete(context.Background(), spec.ID) })
	mustState(t, rt2, spec.ID, runtime.StateRunning)
	mustAlive(t, rt2, spec.ID, o)

	if err := rt2.Recover(ctx, hStopped); err != nil {
		t.Fatalf("recover stopped sandbox: %v", err)
	}
	t.Cleanup(func() { rt2.Delete(context.Background(), stopped.ID) })
	mustState(t, rt2, stopped.ID, runtime.StateStopped)

	gone := h
	gone.ID = NewID("gone")
	if err := rt2.Recover(ctx, gone); !errdefs.IsNotFound(err) {
		t.Fatalf("recover of a sandbox that does not exist: err = %v, want not found", err)
	}
	st := mustState(t, rt2, spec.ID, runtime.StateRunning)
	if err := rt2.Stop(ctx, spec.ID, runtime.StopOptions{Timeout: time.Second}); err != nil {
		t.Fatalf("stop recovered: %v", err)
	}
	if err := rt2.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete recovered: %v", err)
	}
	AssertNoLeftovers(t, spec.StateDir, st.Pid)
}

// testDeleteWithoutRecover: the node crashed after Create but before it
// stored the Handle, so after the restart it can only Delete by ID.
func testDeleteWithoutRecover(t *testing.T, f Factory) {
	rt, tmpl := f(t)
	ctx := t.Context()
	spec, _ := StartSandbox(t, rt, tmpl)
	st := mustState(t, rt, spec.ID, runtime.StateRunning)
	rt2, _ := f(t)
	if err := rt2.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete by id from a fresh runtime: %v", err)
	}
	mustNotFound(t, rt2, spec.ID)
	AssertNoLeftovers(t, spec.StateDir, st.Pid)
	if _, err := Health(ctx, rt, spec.ID); err == nil {
		t.Fatalf("agent still answers after delete")
	}
}

func testLongStateDir(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	spec := Prepare(t, rt, tmpl)
	spec.StateDir = filepath.Join(spec.StateDir, strings.Repeat("d", 100), strings.Repeat("e", 100))
	if err := os.MkdirAll(spec.StateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := rt.Create(ctx, spec); err != nil {
		t.Fatalf("create: %v", err)
	}
	if err := rt.Start(ctx, spec.ID); err != nil {
		t.Fatalf("start: %v", err)
	}
	if err := WaitAgent(ctx, rt, spec.ID, agentTimeout); err != nil {
		t.Fatalf("agent at a %d-byte state dir: %v", len(spec.StateDir), err)
	}
	mustAlive(t, rt, spec.ID, o)
	if err := rt.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	AssertNoLeftovers(t, spec.StateDir, 0)
}

func testConcurrent(t *testing.T, f Factory, o Options, n int) {
	rt, tmpl := f(t)
	ctx := t.Context()
	specs := make([]runtime.Spec, n)
	for i := range specs {
		specs[i] = Prepare(t, rt, tmpl)
	}
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for _, s := range specs {
		wg.Go(func() {
			if _, err := rt.Create(ctx, s); err != nil {
				errs <- fmt.Errorf("create %s: %w", s.ID, err)
				return
			}
			if err := rt.Start(ctx, s.ID); err != nil {
				errs <- fmt.Errorf("start %s: %w", s.ID, err)
				return
			}
			if err := WaitAgent(ctx, rt, s.ID, agentTimeout); err != nil {
				errs <- err
				return
			}
			// Each sandbox keeps its own files (and runs its own processes).
			if err := WriteFile(ctx, rt, s.ID, "/conc", []byte(s.ID)); err != nil {
				errs <- err
				return
			}
			if b, err := ReadFile(ctx, rt, s.ID, "/conc"); err != nil || string(b) != s.ID {
				errs <- fmt.Errorf("read back in %s: %q, %v", s.ID, b, err)
				return
			}
			if o.Exec {
				res, err := Run(ctx, rt, s.ID, "", "echo", s.ID)
				if err != nil || res.Stdout != s.ID+"\n" {
					errs <- fmt.Errorf("echo in %s: %q, %v", s.ID, res.Stdout, err)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	for _, s := range specs {
		wg.Go(func() {
			if err := rt.Stop(ctx, s.ID, runtime.StopOptions{}); err != nil {
				t.Errorf("stop %s: %v", s.ID, err)
			}
			if err := rt.Delete(ctx, s.ID); err != nil {
				t.Errorf("delete %s: %v", s.ID, err)
			}
		})
	}
	wg.Wait()
	for _, s := range specs {
		AssertNoLeftovers(t, s.StateDir, 0)
	}
}

func testPause(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	p, ok := rt.(runtime.Pauser)
	if !rt.Info().Capabilities.Pause {
		if ok {
			t.Fatalf("implements Pauser but Info().Capabilities.Pause is false")
		}
		t.Skip("backend does not advertise Pause")
	}
	if !ok {
		t.Fatalf("advertises Pause but does not implement runtime.Pauser")
	}
	ctx := t.Context()
	spec, _ := StartSandbox(t, rt, tmpl)
	if err := WriteFile(ctx, rt, spec.ID, "/kept", []byte("across the pause")); err != nil {
		t.Fatal(err)
	}
	first := 0
	if o.Exec {
		// A loop that counts every 20 ms, started in the background.
		if res, err := Run(ctx, rt, spec.ID, "", "/bin/sh", "-c",
			"(i=0; while :; do i=$((i+1)); echo $i > /count.tmp && mv /count.tmp /count; sleep 0.02; done) >/dev/null 2>&1 </dev/null &"); err != nil || res.ExitCode != 0 {
			t.Fatalf("start counter: %v %+v", err, res)
		}
		first = waitCount(t, rt, spec.ID, 1)
	}

	if err := p.Pause(ctx, spec.ID); err != nil {
		t.Fatalf("pause: %v", err)
	}
	if err := p.Pause(ctx, spec.ID); err != nil {
		t.Fatalf("pause of a paused sandbox (must be idempotent): %v", err)
	}
	mustState(t, rt, spec.ID, runtime.StatePaused)
	short, cancel := contextWithTimeout(t, 300*time.Millisecond)
	defer cancel()
	if code, err := Health(short, rt, spec.ID); err == nil {
		t.Fatalf("the agent of a paused sandbox answered %d", code)
	}
	if o.Exec {
		short, cancel := contextWithTimeout(t, 300*time.Millisecond)
		defer cancel()
		if _, err := Run(short, rt, spec.ID, "", "true"); err == nil {
			t.Fatalf("a paused sandbox ran a process")
		}
		// Stay paused for a second: a running counter would advance by ~50.
		time.Sleep(time.Second)
	}
	mustState(t, rt, spec.ID, runtime.StatePaused)
	if err := p.Resume(ctx, spec.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}
	if err := p.Resume(ctx, spec.ID); err != nil {
		t.Fatalf("resume of a running sandbox (must be idempotent): %v", err)
	}
	mustState(t, rt, spec.ID, runtime.StateRunning)
	if b, err := ReadFile(ctx, rt, spec.ID, "/kept"); err != nil || string(b) != "across the pause" {
		t.Fatalf("file after resume: %q, %v", b, err)
	}
	if o.Exec {
		after := readCount(t, rt, spec.ID)
		// Between the first read and the pause, and between the resume and
		// this read, the loop runs for a few ticks at most; the paused second
		// must not count.
		if after-first > 25 {
			t.Fatalf("counter went from %d to %d across a 1 s pause: the sandbox ran while paused", first, after)
		}
		waitCount(t, rt, spec.ID, after+5) // and it counts again
	}
	mustAlive(t, rt, spec.ID, o)

	// Stop must work on a paused sandbox too.
	if err := p.Pause(ctx, spec.ID); err != nil {
		t.Fatalf("pause: %v", err)
	}
	if err := rt.Stop(ctx, spec.ID, runtime.StopOptions{Timeout: time.Second}); err != nil {
		t.Fatalf("stop paused: %v", err)
	}
	mustState(t, rt, spec.ID, runtime.StateStopped)
	if err := p.Pause(ctx, spec.ID); err == nil {
		t.Fatalf("pause of a stopped sandbox succeeded")
	}
}

// testPauseRecover: a paused sandbox is still paused after a node restart
// (a second backend instance that Recovers it), and resumes from there.
func testPauseRecover(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	p, ok := rt.(runtime.Pauser)
	if !ok {
		t.Skip("backend does not implement Pause")
	}
	ctx := t.Context()
	spec, h := StartSandbox(t, rt, tmpl)
	if err := p.Pause(ctx, spec.ID); err != nil {
		t.Fatalf("pause: %v", err)
	}
	rt2, _ := f(t)
	if err := rt2.Recover(ctx, h); err != nil {
		t.Fatalf("recover paused: %v", err)
	}
	mustState(t, rt2, spec.ID, runtime.StatePaused)
	if err := rt2.(runtime.Pauser).Resume(ctx, spec.ID); err != nil {
		t.Fatalf("resume after recover: %v", err)
	}
	mustState(t, rt2, spec.ID, runtime.StateRunning)
	mustAlive(t, rt2, spec.ID, o)
	if err := rt2.Delete(ctx, spec.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
}

// readCount reads the counter testPause's loop writes to /count.
func readCount(t testing.TB, rt runtime.Runtime, id string) int {
	t.Helper()
	res, err := Run(t.Context(), rt, id, "", "cat", "/count")
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("read counter: %v %+v", err, res)
	}
	n, err := strconv.Atoi(strings.TrimSpace(res.Stdout))
	if err != nil {
		t.Fatalf("counter %q: %v", res.Stdout, err)
	}
	return n
}

// waitCount polls until the counter reaches at least n and returns it.
func waitCount(t testing.TB, rt runtime.Runtime, id string, n int) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		res, err := Run(t.Context(), rt, id, "", "cat", "/count")
		if err == nil && res.ExitCode == 0 {
			if c, err := strconv.Atoi(strings.TrimSpace(res.Stdout)); err == nil && c >= n {
				return c
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("counter did not reach %d in 10 s (last: %q, %v)", n, res.Stdout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func testStats(t *testing.T, f Factory, o Options) {
	rt, tmpl := f(t)
	sr, ok := rt.(runtime.StatsReader)
	if !rt.Info().Capabilities.Stats {
		if ok {
			t.Fatalf("implements StatsReader but Info().Capabilities.Stats is false")
		}
		t.Skip("backend does not advertise Stats")
	}
	if !ok {
		t.Fatalf("advertises Stats but does not implement runtime.StatsReader")
	}
	spec, _ := StartSandbox(t, rt, tmpl)
	mustAlive(t, rt, spec.ID, o)
	st, err := sr.Stats(t.Context(), spec.ID)
	if err != nil {
		t.Fatalf("stats: %v", err)
	}
	if st.MemoryBytes <= 0 || st.MemoryBytes > tmpl.Resources.MemoryMB<<20 {
		t.Errorf("memory = %d bytes, want within (0, %d MiB]", st.MemoryBytes, tmpl.Resources.MemoryMB)
	}
	if st.Pids < 1 {
		t.Errorf("pids = %d, want >= 1 (the agent)", st.Pids)
	}
	if st.CPUNanos == 0 {
		t.Errorf("cpu = 0 ns for a running sandbox")
	}
	if st.MemoryLimitBytes != 0 && st.MemoryLimitBytes != tmpl.Resources.MemoryMB<<20 {
		t.Errorf("memory limit = %d bytes, want %d MiB", st.MemoryLimitBytes, tmpl.Resources.MemoryMB)
	}
	if st.PidsLimit != 0 && tmpl.Resources.PidsLimit > 0 && st.PidsLimit != tmpl.Resources.PidsLimit {
		t.Errorf("pids limit = %d, want %d", st.PidsLimit, tmpl.Resources.PidsLimit)
	}
	if st.MemoryCacheBytes < 0 || st.MemoryCacheBytes > st.MemoryBytes {
		t.Errorf("memory cache = %d, want within [0, memory %d]", st.MemoryCacheBytes, st.MemoryBytes)
	}
	// Writing 1 MiB to the root filesystem shows in the disk use.
	before := st.DiskUsedBytes
	if err := WriteFile(t.Context(), rt, spec.ID, "/stats.bin", make([]byte, 1<<20)); err != nil {
		t.Fatalf("write a file: %v", err)
	}
	// A backend may cache its disk measurement for a while (the container
	// backend does, for a multiple of what the walk took): poll.
	st2, err := sr.Stats(t.Context(), spec.ID)
	for deadline := time.Now().Add(30 * time.Second); err == nil && st2.DiskTotalBytes != 0 && st2.DiskUsedBytes-before < 1<<20 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond) // polling
		st2, err = sr.Stats(t.Context(), spec.ID)
	}
	if err != nil {
		t.Fatalf("stats: %v", err)
	}
	if st2.DiskTotalBytes != 0 && st2.DiskUsedBytes-before < 1<<20 {
		t.Errorf("disk used went from %d to %d after writing 1 MiB (polled 30 s)", before, st2.DiskUsedBytes)
	}
	if st2.CPUNanos < st.CPUNanos {
		t.Errorf("cpu went backwards: %d then %d", st.CPUNanos, st2.CPUNanos)
	}
	t.Logf("idle stats: memory %d KiB (cache %d KiB, limit %d MiB), pids %d/%d, cpu %s, disk %d KiB of %d MiB",
		st.MemoryBytes>>10, st.MemoryCacheBytes>>10, st.MemoryLimitBytes>>20, st.Pids, st.PidsLimit, time.Duration(st.CPUNanos), st2.DiskUsedBytes>>10, st2.DiskTotalBytes>>20)
}
