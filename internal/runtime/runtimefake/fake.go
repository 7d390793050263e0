// Package runtimefake is a backend for tests of the code above the backend
// contract (the node, the daemon). It implements runtime.Runtime and every
// optional interface without running anything: a sandbox is an in-memory
// record with a small HTTP agent (GET /health, GET and POST /files on an
// in-memory file tree) served on in-memory pipes, so it needs no root and
// no runc. Its files survive pause, snapshot, restore and fork the way a
// real backend's do, which is what the conformance suite and node tests
// observe. Failure knobs (Hook) make any operation fail or block; Kill
// ends a sandbox's "init" from outside, as a crash would.
//
// Sandboxes live as long as the process, keyed by the backend's state
// root: a second Runtime on the same root is the same node after a
// restart, and Recover finds them there.
//
// It registers itself as backend "fake" when imported: import it only from
// tests.
package runtimefake

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Name is the backend's registered name.
const Name = "fake"

func init() {
	runtime.Register(Name, func(_ context.Context, env runtime.Env, raw json.RawMessage) (runtime.Runtime, error) {
		var cfg Config
		if err := runtime.DecodeConfig(Name, raw, &cfg); err != nil {
			return nil, err
		}
		if cfg.StateRoot == "" {
			cfg.StateRoot = filepath.Join(env.StateDir, "fake")
		}
		return New(cfg), nil
	})
}

// Config configures the fake.
type Config struct {
	// StateRoot identifies the fake "machine": Runtimes on one root share
	// sandboxes. Required (the registry defaults it under the node's dir).
	StateRoot string `json:"state_root,omitempty"`
	// Options are the backend options the fake accepts (any value); every
	// other key is refused.
	Options []string `json:"options,omitempty"`
}

// Op names an operation for Hook.
type Op string

const (
	OpCreate   Op = "create"
	OpStart    Op = "start"
	OpStop     Op = "stop"
	OpDelete   Op = "delete"
	OpPause    Op = "pause"
	OpResume   Op = "resume"
	OpPrestart Op = "prestart"
	OpLaunch   Op = "launch"
	OpSnapshot Op = "snapshot"
	OpRestore  Op = "restore"
	OpFork     Op = "fork"
	OpDiff     Op = "diff"
	OpRecover  Op = "recover"
	OpReclaim  Op = "reclaim"
)

// machine is what outlives a Runtime: the sandboxes of one state root.
type machine struct {
	mu        sync.Mutex
	sandboxes map[string]*sandbox
	nextPid   int
}

var (
	machinesMu sync.Mutex
	machines   = map[string]*machine{}
)

func machineFor(root string) *machine {
	machinesMu.Lock()
	defer machinesMu.Unlock()
	m, ok := machines[root]
	if !ok {
		// Pids above the kernel's pid_max (at most 2^22) name no real process.
		m = &machine{sandboxes: map[string]*sandbox{}, nextPid: 1 << 30}
		machines[root] = m
	}
	return m
}

// Runtime is the fake backend.
type Runtime struct {
	cfg Config
	m   *machine

	mu    sync.Mutex
	known map[string]bool // sandboxes this instance made or recovered
	hooks map[Op]func(ctx context.Context, id string) error
	calls map[Op]int
}

var (
	_ runtime.Runtime      = (*Runtime)(nil)
	_ runtime.Prestarter   = (*Runtime)(nil)
	_ runtime.Pauser       = (*Runtime)(nil)
	_ runtime.Reclaimer    = (*Runtime)(nil)
	_ runtime.StatsReader  = (*Runtime)(nil)
	_ runtime.Snapshotter  = (*Runtime)(nil)
	_ runtime.Forker       = (*Runtime)(nil)
	_ runtime.RootfsDiffer = (*Runtime)(nil)
)

// New returns a fake backend on cfg.StateRoot.
func New(cfg Config) *Runtime {
	if cfg.StateRoot == "" {
		cfg.StateRoot = "default"
	}
	return &Runtime{cfg: cfg, m: machineFor(cfg.StateRoot), known: map[string]bool{},
		hooks: map[Op]func(context.Context, string) error{}, calls: map[Op]int{}}
}

// Hook makes fn run at the start of every op (nil removes it): an error it
// returns fails the operation before it changed anything; it may block
// (honouring ctx) to hold the operation.
func (r *Runtime) Hook(op Op, fn func(ctx context.Context, id string) error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if fn == nil {
		delete(r.hooks, op)
		return
	}
	r.hooks[op] = fn
}

// Calls returns how many times op was called on this instance.
func (r *Runtime) Calls(op Op) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[op]
}

func (r *Runtime) hook(ctx context.Context, op Op, id string) error {
	r.mu.Lock()
	r.calls[op]++
	fn := r.hooks[op]
	r.mu.Unlock()
	if fn == nil {
		return nil
	}
	return fn(ctx, id)
}

// Info describes the backend.
func (r *Runtime) Info() runtime.Info {
	return runtime.Info{Name: Name, Version: "fake 1", Capabilities: runtime.CapabilitiesOf(r, true)}
}

// ValidateOptions accepts the keys named in Config.Options.
func (r *Runtime) ValidateOptions(opts map[string]string) error {
	keys := make([]string, 0, len(opts))
	for k := range opts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		ok := false
		for _, a := range r.cfg.Options {
			ok = ok || a == k
		}
		if !ok {
			return errdefs.Invalid("backend_options."+k, "the fake backend has no option %q (it has: %s)", k, strings.Join(r.cfg.Options, ", "))
		}
	}
	return nil
}

// sandbox is one fake sandbox.
type sandbox struct {
	id  string
	mu  sync.Mutex
	st  runtime.State
	pid int
	// prestarted: made by Prestart, not launched yet.
	prestarted bool
	spec       runtime.Spec
	env        []string
	files      map[string][]byte
	started    time.Time
	deleted    bool

	// resumed is closed and replaced at each pause: held agent requests
	// wait on it.
	resumed chan struct{}
	done    chan struct{} // closed when "init" ended
	gone    chan struct{} // closed at delete
	exit    runtime.ExitStatus
	// memory: it came from a snapshot or fork with its memory.
	memory bool
	// reclaimed: a Reclaim pushed its memory out (until it runs again).
	reclaimed bool
}

func validate(s runtime.Spec) error {
	switch {
	case s.ID == "" || strings.ContainsAny(s.ID, "/\\ \t\n.:") || len(s.ID) > 64:
		return errdefs.Invalid("id", "%q must be 1-64 characters of [a-zA-Z0-9_-]", s.ID)
	case len(s.Rootfs.Layers) == 0:
		return errdefs.Invalid("rootfs.layers", "must list at least one layer")
	case s.StateDir == "" || !filepath.IsAbs(s.StateDir):
		return errdefs.Invalid("state_dir", "must be an absolute directory path, got %q", s.StateDir)
	case s.Resources.MemoryMB <= 0:
		return errdefs.Invalid("resources.memory_mb", "must be positive, got %d", s.Resources.MemoryMB)
	case s.Resources.CPU < 0:
		return errdefs.Invalid("resources.cpu", "must not be negative, got %v", s.Resources.CPU)
	case s.Resources.PidsLimit < 0:
		return errdefs.Invalid("resources.pids_limit", "must not be negative, got %d", s.Resources.PidsLimit)
	case s.Network.NetNS != "" && !filepath.IsAbs(s.Network.NetNS):
		return errdefs.Invalid("network.netns", "must be an absolute path, got %q", s.Network.NetNS)
	}
	for i, l := range s.Rootfs.Layers {
		if !filepath.IsAbs(l.Path) {
			return errdefs.Invalid(fmt.Sprintf("rootfs.layers[%d]", i), "must be an absolute path, got %q", l.Path)
		}
		if _, err := os.Stat(l.Path); err != nil {
			return errdefs.Invalid(fmt.Sprintf("rootfs.layers[%d]", i), "%q does not exist", l.Path)
		}
	}
	for i, e := range s.Guest.Env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" {
			return errdefs.Invalid("guest.env", "entry %d %q must be KEY=VALUE", i, e)
		}
	}
	return nil
}

// Create records the sandbox (state created).
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (runtime.Handle, error) {
	if err := validate(spec); err != nil {
		return runtime.Handle{}, err
	}
	if err := r.hook(ctx, OpCreate, spec.ID); err != nil {
		return runtime.Handle{}, err
	}
	return r.add(spec, map[string][]byte{}, false)
}

func (r *Runtime) add(spec runtime.Spec, files map[string][]byte, memory bool) (runtime.Handle, error) {
	r.m.mu.Lock()
	defer r.m.mu.Unlock()
	if _, ok := r.m.sandboxes[spec.ID]; ok {
		return runtime.Handle{}, errdefs.New(errdefs.ErrAlreadyExists, "sandbox %q already exists", spec.ID)
	}
	sb := &sandbox{id: spec.ID, st: runtime.StateCreated, spec: spec, env: spec.Guest.Env, files: files,
		resumed: closed(), done: make(chan struct{}), gone: make(chan struct{}), memory: memory}
	r.m.sandboxes[spec.ID] = sb
	r.mu.Lock()
	r.known[spec.ID] = true
	r.mu.Unlock()
	b, _ := json.Marshal(handleState{StateRoot: r.cfg.StateRoot})
	return runtime.Handle{ID: spec.ID, Version: 1, State: b}, nil
}

type handleState struct {
	StateRoot string `json:"state_root"`
}

func closed() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}

// get returns a sandbox this instance knows.
func (r *Runtime) get(id string) (*sandbox, error) {
	r.mu.Lock()
	known := r.known[id]
	r.mu.Unlock()
	r.m.mu.Lock()
	sb, ok := r.m.sandboxes[id]
	r.m.mu.Unlock()
	if !ok || !known {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox %q not found", id)
	}
	return sb, nil
}

func (r *Runtime) run(sb *sandbox, env []string) {
	r.m.mu.Lock()
	r.m.nextPid++
	pid := r.m.nextPid
	r.m.mu.Unlock()
	sb.pid = pid
	sb.st = runtime.StateRunning
	sb.started = time.Now()
	sb.prestarted = false
	sb.env = runtime.MergeEnv(sb.env, env)
}

// Start lets the sandbox run.
func (r *Runtime) Start(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	if err := r.hook(ctx, OpStart, id); err != nil {
		return err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	switch {
	case sb.st == runtime.StateStopped:
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is stopped and cannot be started again; create a new one", id)
	case sb.st != runtime.StateCreated:
		return nil
	}
	if n := sb.spec.Network.NetNS; n != "" {
		if _, err := os.Stat(n); err != nil {
			return errdefs.Invalid("network.netns", "network namespace of sandbox %s: %v; set it up before Start", id, err)
		}
	}
	r.run(sb, nil)
	return nil
}

// Prestart makes the sandbox wait, nothing running, for Launch.
func (r *Runtime) Prestart(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	if err := r.hook(ctx, OpPrestart, id); err != nil {
		return err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.st != runtime.StateCreated || sb.prestarted {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is %s; prestart a newly created one", id, sb.st)
	}
	r.m.mu.Lock()
	r.m.nextPid++
	sb.pid = r.m.nextPid
	r.m.mu.Unlock()
	sb.prestarted = true
	return nil
}

// Launch lets a prestarted sandbox run with env on top of its guest env.
func (r *Runtime) Launch(ctx context.Context, id string, env []string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	if err := r.hook(ctx, OpLaunch, id); err != nil {
		return err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if !sb.prestarted || sb.st != runtime.StateCreated {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is not prestarted (it is %s)", id, sb.st)
	}
	r.run(sb, env)
	return nil
}

// end marks sb's init ended; sb.mu is held.
func (sb *sandbox) end(reason string, code int) {
	if sb.st == runtime.StateStopped && isClosed(sb.done) {
		return
	}
	sb.st = runtime.StateStopped
	sb.exit = runtime.ExitStatus{ExitCode: code, Reason: reason, At: time.Now()}
	if !isClosed(sb.resumed) {
		close(sb.resumed) // held requests fail now
	}
	if !isClosed(sb.done) {
		close(sb.done)
	}
}

func isClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// Kill ends sandbox id's init from outside, as a crash or `kill -9` would:
// Wait returns with reason.
func (r *Runtime) Kill(id, reason string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.st != runtime.StateRunning && sb.st != runtime.StatePaused {
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is %s, not running", id, sb.st)
	}
	sb.end(reason, 137)
	return nil
}

// Wait returns once the sandbox's init ended.
func (r *Runtime) Wait(ctx context.Context, id string) (runtime.ExitStatus, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.ExitStatus{}, err
	}
	select {
	case <-sb.done:
	case <-sb.gone:
		if !isClosed(sb.done) {
			return runtime.ExitStatus{}, errdefs.New(errdefs.ErrNotFound, "sandbox %q was deleted before it ran", id)
		}
	case <-ctx.Done():
		return runtime.ExitStatus{}, fmt.Errorf("wait for sandbox %s: %w", id, context.Cause(ctx))
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.exit, nil
}

// Stop ends the sandbox.
func (r *Runtime) Stop(ctx context.Context, id string, _ runtime.StopOptions) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	if err := r.hook(ctx, OpStop, id); err != nil {
		return err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.st == runtime.StateCreated && !sb.prestarted {
		sb.end("stopped before it started", -1)
		return nil
	}
	sb.end("stopped", 0)
	return nil
}

// Delete forgets the sandbox. Idempotent.
func (r *Runtime) Delete(ctx context.Context, id string) error {
	if err := r.hook(ctx, OpDelete, id); err != nil {
		return err
	}
	r.m.mu.Lock()
	sb, ok := r.m.sandboxes[id]
	delete(r.m.sandboxes, id)
	r.m.mu.Unlock()
	r.mu.Lock()
	delete(r.known, id)
	r.mu.Unlock()
	if !ok {
		return nil
	}
	sb.mu.Lock()
	sb.deleted = true
	if !isClosed(sb.resumed) {
		close(sb.resumed)
	}
	close(sb.gone)
	sb.mu.Unlock()
	return nil
}

// Status reports the sandbox's state.
func (r *Runtime) Status(ctx context.Context, id string) (runtime.Status, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Status{}, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	st := runtime.Status{State: sb.st, Pid: sb.pid}
	if sb.st == runtime.StateStopped {
		st.ExitCode = sb.exit.ExitCode
	}
	return st, nil
}

// Recover re-attaches to a sandbox of this machine.
func (r *Runtime) Recover(ctx context.Context, h runtime.Handle) error {
	if err := r.hook(ctx, OpRecover, h.ID); err != nil {
		return err
	}
	var hs handleState
	if h.Version != 1 || json.Unmarshal(h.State, &hs) != nil || hs.StateRoot != r.cfg.StateRoot {
		return errdefs.Invalid("handle", "is not a fake handle of state root %q", r.cfg.StateRoot)
	}
	r.m.mu.Lock()
	_, ok := r.m.sandboxes[h.ID]
	r.m.mu.Unlock()
	if !ok {
		return errdefs.New(errdefs.ErrNotFound, "sandbox %q is gone", h.ID)
	}
	r.mu.Lock()
	r.known[h.ID] = true
	r.mu.Unlock()
	return nil
}

// Pause holds the sandbox's agent.
func (r *Runtime) Pause(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	if err := r.hook(ctx, OpPause, id); err != nil {
		return err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	switch sb.st {
	case runtime.StatePaused:
		return nil
	case runtime.StateRunning:
		sb.st = runtime.StatePaused
		sb.resumed = make(chan struct{})
		return nil
	}
	return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is %s; only a running sandbox pauses", id, sb.st)
}

// Resume lets a paused sandbox run again.
func (r *Runtime) Resume(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	if err := r.hook(ctx, OpResume, id); err != nil {
		return err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	switch sb.st {
	case runtime.StateRunning:
		return nil
	case runtime.StatePaused:
		sb.st = runtime.StateRunning
		sb.reclaimed = false
		close(sb.resumed)
		return nil
	}
	return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is %s; only a paused sandbox resumes", id, sb.st)
}

// Stats reports synthetic use: the bytes of its files, one process, CPU
// as time running.
func (r *Runtime) Stats(ctx context.Context, id string) (runtime.Stats, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Stats{}, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	var disk int64
	for _, b := range sb.files {
		disk += int64(len(b))
	}
	st := runtime.Stats{
		MemoryBytes:      fakeMemory(disk, sb.reclaimed),
		MemoryLimitBytes: sb.spec.Resources.MemoryMB << 20,
		PidsLimit:        sb.spec.Resources.PidsLimit,
		DiskUsedBytes:    disk,
		DiskTotalBytes:   1 << 40,
		DiskMeasuredAt:   time.Now(),
	}
	if sb.st == runtime.StateRunning || sb.st == runtime.StatePaused {
		st.Pids = 1
		st.CPUNanos = uint64(time.Since(sb.started).Nanoseconds()) + 1
	}
	return st, nil
}

// FakeResidentBytes is what a reclaimed fake sandbox keeps charged.
const FakeResidentBytes = 64 << 10

// fakeMemory is a fake sandbox's memory: 1 MiB plus its files, or
// FakeResidentBytes once reclaimed.
func fakeMemory(disk int64, reclaimed bool) int64 {
	if reclaimed {
		return FakeResidentBytes
	}
	return 1<<20 + disk
}

// Reclaim "pushes out" a paused sandbox's memory: Stats then reports
// FakeResidentBytes until it is resumed. Before is 1 MiB plus its files.
func (r *Runtime) Reclaim(ctx context.Context, id string) (runtime.ReclaimStats, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.ReclaimStats{}, err
	}
	if err := r.hook(ctx, OpReclaim, id); err != nil {
		return runtime.ReclaimStats{}, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.st != runtime.StatePaused {
		return runtime.ReclaimStats{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is %s; pause it before reclaiming its memory", id, sb.st)
	}
	var disk int64
	for _, b := range sb.files {
		disk += int64(len(b))
	}
	rs := runtime.ReclaimStats{Before: fakeMemory(disk, sb.reclaimed), After: FakeResidentBytes}
	sb.reclaimed = true
	return rs, nil
}

// snapshotFile is what Snapshot writes.
type snapshotFile struct {
	Files map[string][]byte `json:"files"`
	Env   []string          `json:"env"`
}

// Snapshot writes the sandbox's files (and, as a VM backend would, its
// "memory": its env) to dir/fake-snapshot.json.
func (r *Runtime) Snapshot(ctx context.Context, id, dir string) (runtime.SnapshotInfo, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.SnapshotInfo{}, err
	}
	if err := r.hook(ctx, OpSnapshot, id); err != nil {
		return runtime.SnapshotInfo{}, err
	}
	t0 := time.Now() // the copy under the lock is the fake's freeze
	sb.mu.Lock()
	b, err := json.Marshal(snapshotFile{Files: sb.files, Env: sb.env})
	sb.mu.Unlock()
	frozen := max(time.Since(t0), time.Nanosecond)
	if err != nil {
		return runtime.SnapshotInfo{}, fmt.Errorf("encode snapshot: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "fake-snapshot.json"), b, 0o600); err != nil {
		return runtime.SnapshotInfo{}, fmt.Errorf("write snapshot: %w", err)
	}
	return runtime.SnapshotInfo{Memory: true, Bytes: int64(len(b)), SourceFrozen: frozen}, nil
}

// Restore creates a sandbox from a snapshot dir.
func (r *Runtime) Restore(ctx context.Context, spec runtime.Spec, dir string) (runtime.Handle, error) {
	if err := validate(spec); err != nil {
		return runtime.Handle{}, err
	}
	if err := r.hook(ctx, OpRestore, spec.ID); err != nil {
		return runtime.Handle{}, err
	}
	b, err := os.ReadFile(filepath.Join(dir, "fake-snapshot.json"))
	if err != nil {
		return runtime.Handle{}, errdefs.Invalid("snapshot", "%s holds no fake snapshot: %v", dir, err)
	}
	var sf snapshotFile
	if err := json.Unmarshal(b, &sf); err != nil {
		return runtime.Handle{}, errdefs.Invalid("snapshot", "decode: %v", err)
	}
	if sf.Files == nil {
		sf.Files = map[string][]byte{}
	}
	spec.Guest.Env = sf.Env
	return r.add(spec, sf.Files, true)
}

// Fork copies a sandbox's files (and env, its "memory") into new ones.
func (r *Runtime) Fork(ctx context.Context, id string, specs []runtime.Spec) ([]runtime.ForkResult, error) {
	src, err := r.get(id)
	if err != nil {
		return nil, err
	}
	for i, s := range specs {
		if err := validate(s); err != nil {
			var fe *errdefs.FieldError
			if errors.As(err, &fe) {
				return nil, errdefs.Invalid(fmt.Sprintf("specs[%d].%s", i, fe.Field), "%s", fe.Msg)
			}
			return nil, err
		}
	}
	if err := r.hook(ctx, OpFork, id); err != nil {
		return nil, err
	}
	src.mu.Lock()
	if src.st != runtime.StateRunning && src.st != runtime.StatePaused {
		src.mu.Unlock()
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is %s; fork a running or paused one", id, src.st)
	}
	files, env := copyFiles(src.files), src.env
	src.mu.Unlock()
	out := make([]runtime.ForkResult, 0, len(specs))
	for _, s := range specs {
		s.Guest.Env = env
		h, err := r.add(s, copyFiles(files), true)
		if err != nil {
			for _, made := range out {
				_ = r.Delete(context.WithoutCancel(ctx), made.Handle.ID)
			}
			return nil, err
		}
		out = append(out, runtime.ForkResult{Handle: h, MemoryPreserved: true})
	}
	return out, nil
}

func copyFiles(in map[string][]byte) map[string][]byte {
	out := make(map[string][]byte, len(in))
	for k, v := range in {
		out[k] = bytes.Clone(v)
	}
	return out
}

// DiffRootfs writes the sandbox's files into a temporary directory
// (runtime.DiffOverlayDir: they are all additions) and calls fn with it.
func (r *Runtime) DiffRootfs(ctx context.Context, id string, fn func(ctx context.Context, d runtime.RootfsDiff) error) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	if err := r.hook(ctx, OpDiff, id); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "fake-diff-")
	if err != nil {
		return fmt.Errorf("make diff dir: %w", err)
	}
	defer os.RemoveAll(dir)
	sb.mu.Lock()
	files := copyFiles(sb.files)
	sb.mu.Unlock()
	for p, b := range files {
		dst := filepath.Join(dir, filepath.FromSlash(strings.TrimPrefix(p, "/")))
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return fmt.Errorf("write diff: %w", err)
		}
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			return fmt.Errorf("write diff: %w", err)
		}
	}
	return fn(ctx, runtime.RootfsDiff{Format: runtime.DiffOverlayDir, Dir: dir})
}

// Env returns the environment sandbox id's agent runs with.
func (r *Runtime) Env(id string) ([]string, error) {
	sb, err := r.get(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return append([]string(nil), sb.env...), nil
}

// Spec returns the spec sandbox id was created with.
func (r *Runtime) Spec(id string) (runtime.Spec, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Spec{}, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.spec, nil
}

// AgentConn returns one end of an in-memory pipe whose other end the
// sandbox's agent serves. While the sandbox is paused the agent reads
// nothing; a prestarted sandbox's agent waits for Launch.
func (r *Runtime) AgentConn(ctx context.Context, id string) (net.Conn, error) {
	sb, err := r.get(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	st := sb.st
	sb.mu.Unlock()
	if st == runtime.StateStopped {
		return nil, errdefs.New(errdefs.ErrUnavailable, "sandbox %q is stopped: its agent is gone", id)
	}
	client, server := net.Pipe()
	go r.serve(sb, server)
	return client, nil
}

// serve answers HTTP/1.1 requests on c once the sandbox runs.
func (r *Runtime) serve(sb *sandbox, c net.Conn) {
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		// Wait until it runs: created (prestarted or not) or paused
		// sandboxes hold the request, as a frozen agent would.
		for {
			sb.mu.Lock()
			st, resumed, done, gone := sb.st, sb.resumed, sb.done, sb.gone
			sb.mu.Unlock()
			if st == runtime.StateRunning {
				break
			}
			if st == runtime.StateStopped {
				return
			}
			if st == runtime.StatePaused {
				select {
				case <-resumed:
				case <-gone:
					return
				}
				continue
			}
			select { // created: poll for the start
			case <-done:
				return
			case <-gone:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if strings.EqualFold(req.Header.Get("Expect"), "100-continue") {
			// As net/http's server does before a handler reads the body.
			if _, err := io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\n"); err != nil {
				return
			}
		}
		resp := sb.handle(req)
		if err := resp.Write(c); err != nil {
			return
		}
		if req.Close {
			return
		}
	}
}

func (sb *sandbox) handle(req *http.Request) *http.Response {
	respond := func(code int, body []byte) *http.Response {
		return &http.Response{StatusCode: code, ProtoMajor: 1, ProtoMinor: 1, Header: http.Header{},
			Body: io.NopCloser(bytes.NewReader(body)), ContentLength: int64(len(body)), Request: req}
	}
	switch {
	case req.Method == http.MethodGet && req.URL.Path == "/health":
		return respond(http.StatusNoContent, nil)
	case req.URL.Path == "/files":
		p := req.URL.Query().Get("path")
		if !strings.HasPrefix(p, "/") {
			return respond(http.StatusBadRequest, []byte(`{"message":"path must be absolute"}`))
		}
		switch req.Method {
		case http.MethodGet:
			sb.mu.Lock()
			b, ok := sb.files[p]
			sb.mu.Unlock()
			if !ok {
				return respond(http.StatusNotFound, []byte(`{"message":"no such file"}`))
			}
			return respond(http.StatusOK, b)
		case http.MethodPost:
			b, err := io.ReadAll(req.Body)
			if err != nil {
				return respond(http.StatusBadRequest, nil)
			}
			sb.mu.Lock()
			sb.files[p] = b
			sb.mu.Unlock()
			return respond(http.StatusOK, []byte(`[{"path":`+strconv.Quote(p)+`}]`))
		}
	}
	return respond(http.StatusNotFound, []byte(`{"message":"the fake agent serves /health and /files"}`))
}
