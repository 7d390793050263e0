package sandboxspec_test

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/sandboxspec/specpb"
	"github.com/kernflux/opendsec/internal/sandboxspec/spectest"
)

func TestNormalizeDefaults(t *testing.T) {
	got, err := sandboxspec.Normalize(sandboxspec.Spec{Image: "root/busybox"})
	if err != nil {
		t.Fatal(err)
	}
	want := sandboxspec.Spec{Image: "root/busybox", CPU: 1, MemoryMB: 512, TimeoutSec: 300, PidsLimit: 1024}
	if got.Backend != "" || got.CPU != want.CPU || got.MemoryMB != want.MemoryMB || got.TimeoutSec != want.TimeoutSec ||
		got.PidsLimit != want.PidsLimit || got.IdleSec != 0 || got.AutoPause || got.Network != nil {
		t.Fatalf("defaults: got %+v, want %+v", got, want)
	}
	// The documented numbers (docs/api.md, the proto comments).
	if sandboxspec.DefaultCPU != 1 || sandboxspec.DefaultMemoryMB != 512 || sandboxspec.MinMemoryMB != 16 ||
		sandboxspec.DefaultTimeoutSec != 300 || sandboxspec.MaxTimeoutSec != 86400 || sandboxspec.DefaultPidsLimit != 1024 {
		t.Fatal("a default or limit changed: update docs/api.md, api/proto/opendsec/v1/sandbox.proto and the CLI help with it")
	}
}

// Values given are kept, at the edges of what is allowed too.
func TestNormalizeKeepsGivenValues(t *testing.T) {
	in := sandboxspec.Spec{
		Backend: "container", Image: "root/py:3.11", CPU: sandboxspec.MinCPU, MemoryMB: sandboxspec.MinMemoryMB,
		TimeoutSec: sandboxspec.MaxTimeoutSec, IdleSec: sandboxspec.MaxTimeoutSec, PidsLimit: sandboxspec.MinPidsLimit,
		Env:  map[string]string{"A": strings.Repeat("x", sandboxspec.MaxEnvEntryBytes-3)}, // "A=" + value + NUL
		User: "user_1", Labels: map[string]string{"e2b.sys/team": strings.Repeat("v", 256)},
		TaskID: strings.Repeat("t", 128), Workdir: "/home/user", AutoPause: true,
		Network:        &sandboxspec.NetworkRules{RuleSets: []string{"pypi"}},
		BackendOptions: map[string]string{"runc.rootless": "false"},
	}
	got, err := sandboxspec.Normalize(in)
	if err != nil {
		t.Fatal(err)
	}
	if got.CPU != in.CPU || got.MemoryMB != in.MemoryMB || got.TimeoutSec != in.TimeoutSec || got.IdleSec != in.IdleSec ||
		got.PidsLimit != in.PidsLimit || got.Backend != in.Backend || got.Network != in.Network || !got.AutoPause ||
		got.BackendOptions["runc.rootless"] != "false" {
		t.Fatalf("normalize changed given values: %+v", got)
	}
}

// Every field's bad values are refused with an invalid-argument error that
// names the field and says what to do.
func TestNormalizeErrors(t *testing.T) {
	ok := func(f func(*sandboxspec.Spec)) sandboxspec.Spec {
		s := sandboxspec.Spec{Image: "root/busybox"}
		f(&s)
		return s
	}
	bigEnv := map[string]string{}
	for i := range 10 {
		bigEnv[strings.Repeat("K", i+1)] = strings.Repeat("v", 120<<10)
	}
	manyOpts := map[string]string{}
	for i := range sandboxspec.MaxBackendOptions + 1 {
		manyOpts["o"+strings.Repeat("x", i)] = "v"
	}
	for _, tc := range []struct {
		name, field, msg string
		spec             sandboxspec.Spec
	}{
		{"empty image", "image", "is empty; e.g. root/py:3.11", sandboxspec.Spec{}},
		{"image with space", "image", "is not an image name", ok(func(s *sandboxspec.Spec) { s.Image = "a b" })},
		{"image not utf8", "image", "is not an image name", ok(func(s *sandboxspec.Spec) { s.Image = "\xff" })},
		{"backend name", "backend", "is not a backend name: lowercase letters", ok(func(s *sandboxspec.Spec) { s.Backend = "Kvm!" })},
		{"cpu negative", "cpu", "must be a number of cores ≥ 0 (0 means 1)", ok(func(s *sandboxspec.Spec) { s.CPU = -1 })},
		{"cpu NaN", "cpu", "must be a number of cores", ok(func(s *sandboxspec.Spec) { s.CPU = math.NaN() })},
		{"cpu Inf", "cpu", "must be a number of cores", ok(func(s *sandboxspec.Spec) { s.CPU = math.Inf(1) })},
		{"cpu tiny", "cpu", "give at least 0.01 cores", ok(func(s *sandboxspec.Spec) { s.CPU = 0.005 })},
		{"memory negative", "memory_mb", "-1 MiB is too small; give at least 16, or leave it unset for the default 512", ok(func(s *sandboxspec.Spec) { s.MemoryMB = -1 })},
		{"memory small", "memory_mb", "15 MiB is too small; give at least 16", ok(func(s *sandboxspec.Spec) { s.MemoryMB = 15 })},
		{"timeout negative", "timeout_seconds", "-1 must be between 0 and 86400 (0 means 300)", ok(func(s *sandboxspec.Spec) { s.TimeoutSec = -1 })},
		{"timeout long", "timeout_seconds", "86401 must be between 0 and 86400", ok(func(s *sandboxspec.Spec) { s.TimeoutSec = 86401 })},
		{"idle negative", "idle_timeout_seconds", "must be between 0 (off) and 86400", ok(func(s *sandboxspec.Spec) { s.IdleSec = -1 })},
		{"idle long", "idle_timeout_seconds", "must be between 0 (off) and 86400", ok(func(s *sandboxspec.Spec) { s.IdleSec = 86401 })},
		{"pids negative", "pids_limit", "-1 must be ≥ 0 (0 means the default 1024)", ok(func(s *sandboxspec.Spec) { s.PidsLimit = -1 })},
		{"pids few", "pids_limit", "give at least 16, or 0 for the default 1024", ok(func(s *sandboxspec.Spec) { s.PidsLimit = 15 })},
		{"pids past the kernel", "pids_limit", "10000000 is more than the kernel can run (4194304); ask for at most the node's node.max_pids_limit (4096", ok(func(s *sandboxspec.Spec) { s.PidsLimit = 10_000_000 })},
		{"env empty key", "env", "must be non-empty without '=' or NUL", ok(func(s *sandboxspec.Spec) { s.Env = map[string]string{"": "x"} })},
		{"env = in key", "env", "must be non-empty without '=' or NUL", ok(func(s *sandboxspec.Spec) { s.Env = map[string]string{"A=B": "x"} })},
		{"env NUL in value", "env", "contains a NUL byte", ok(func(s *sandboxspec.Spec) { s.Env = map[string]string{"A": "\x00"} })},
		{"env one too big", "env", "the kernel's limit for exec", ok(func(s *sandboxspec.Spec) {
			s.Env = map[string]string{"A": strings.Repeat("x", sandboxspec.MaxEnvEntryBytes-2)}
		})},
		{"env all too big", "env", "pass large data as a file instead", ok(func(s *sandboxspec.Spec) { s.Env = bigEnv })},
		{"user", "user", "is not a user name", ok(func(s *sandboxspec.Spec) { s.User = "Root" })},
		{"user long", "user", "is not a user name", ok(func(s *sandboxspec.Spec) { s.User = strings.Repeat("u", 33) })},
		{"label key", "labels", "must be 1-63 characters", ok(func(s *sandboxspec.Spec) { s.Labels = map[string]string{"-k": "v"} })},
		{"label key long", "labels", "must be 1-63 characters", ok(func(s *sandboxspec.Spec) { s.Labels = map[string]string{strings.Repeat("k", 64): "v"} })},
		{"label value", "labels", "at most 256 bytes", ok(func(s *sandboxspec.Spec) { s.Labels = map[string]string{"k": strings.Repeat("v", 257)} })},
		{"label value utf8", "labels", "valid UTF-8", ok(func(s *sandboxspec.Spec) { s.Labels = map[string]string{"k": "\xff"} })},
		{"task id", "task_id", "at most 128 bytes", ok(func(s *sandboxspec.Spec) { s.TaskID = strings.Repeat("t", 129) })},
		{"task id NUL", "task_id", "valid UTF-8", ok(func(s *sandboxspec.Spec) { s.TaskID = "a\x00" })},
		{"workdir relative", "workdir", "must be an absolute path", ok(func(s *sandboxspec.Spec) { s.Workdir = "home" })},
		{"workdir NUL", "workdir", "must be an absolute path", ok(func(s *sandboxspec.Spec) { s.Workdir = "/a\x00" })},
		{"backend option key", "backend_options", "must be 1-63 characters", ok(func(s *sandboxspec.Spec) { s.BackendOptions = map[string]string{"Bad": "v"} })},
		{"backend option value", "backend_options", "without NUL", ok(func(s *sandboxspec.Spec) { s.BackendOptions = map[string]string{"k": "\x00"} })},
		{"backend options many", "backend_options", "at most 32", ok(func(s *sandboxspec.Spec) { s.BackendOptions = manyOpts })},
		{"on_timeout unknown", "on_timeout", `"kill" is not an action; give "stop" (the default), "pause" or "pause_filesystem"`, ok(func(s *sandboxspec.Spec) { s.OnTimeout = "kill" })},
		{"on_timeout case", "on_timeout", `"Pause" is not an action`, ok(func(s *sandboxspec.Spec) { s.OnTimeout = "Pause" })},
		{"on_timeout stop with auto_pause", "on_timeout", `is "stop" but auto_pause is true`, ok(func(s *sandboxspec.Spec) { s.OnTimeout, s.AutoPause = "stop", true })},
		{"cpu_class unknown", "cpu_class", `"idle" is not a CPU class; give "latency" (the default) or "best_effort"`, ok(func(s *sandboxspec.Spec) { s.CPUClass = "idle" })},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := sandboxspec.Normalize(tc.spec)
			wantField(t, err, tc.field, tc.msg)
		})
	}
}

func wantField(t *testing.T, err error, field, msg string) {
	t.Helper()
	var fe *errdefs.FieldError
	if !errdefs.IsInvalidArgument(err) || !errors.As(err, &fe) || fe.Field != field {
		t.Fatalf("err = %v, want invalid argument naming %s", err, field)
	}
	if !strings.Contains(err.Error(), msg) {
		t.Fatalf("err = %q, want it to contain %q", err, msg)
	}
}

// The shared bad inputs (which the apiserver and node tests use too) are
// refused through the proto mapping, naming their field.
func TestBadSpecs(t *testing.T) {
	for _, b := range spectest.BadSpecs() {
		s, err := specpb.FromProto(b.Spec)
		if err == nil {
			_, err = sandboxspec.Normalize(s)
		}
		var fe *errdefs.FieldError
		if !errors.As(err, &fe) || fe.Field != b.Field {
			t.Errorf("spec %v: err = %v, want invalid argument naming %s", b.Spec, err, b.Field)
		}
	}
}

func TestCheckFits(t *testing.T) {
	s, err := sandboxspec.Normalize(sandboxspec.Spec{Image: "x", Backend: "container", CPU: 4, MemoryMB: 2048})
	if err != nil {
		t.Fatal(err)
	}
	l := sandboxspec.Limits{Where: "node n001", MaxCPU: 4, MaxMemoryMB: 2048, Backends: []string{"container"}}
	if err := sandboxspec.CheckFits(s, l); err != nil {
		t.Fatalf("a spec exactly the node's size: %v", err)
	}
	big := s
	big.CPU = 4.5
	wantField(t, sandboxspec.CheckFits(big, l), "cpu", "4.5 cores exceeds the 4 of node n001; ask for at most 4")
	big = s
	big.MemoryMB = 2049
	wantField(t, sandboxspec.CheckFits(big, l), "memory_mb", "2049 MiB exceeds the 2048 MiB of node n001; ask for at most 2048")
	other := s
	other.Backend = "microvm"
	wantField(t, sandboxspec.CheckFits(other, l), "backend", `"microvm" is not available on node n001 (available: container)`)
	if err := sandboxspec.CheckFits(big, sandboxspec.Limits{}); err != nil {
		t.Fatalf("zero limits check nothing: %v", err)
	}
}

// TestSecurityPidsLimitCheckFits: a pids_limit above the node's
// max_pids_limit is refused naming the field, the limit and the fix.
func TestSecurityPidsLimitCheckFits(t *testing.T) {
	l := sandboxspec.Limits{Where: "node n001", MaxPidsLimit: 4096}
	s, err := sandboxspec.Normalize(sandboxspec.Spec{Image: "x", PidsLimit: 4096})
	if err != nil {
		t.Fatal(err)
	}
	if err := sandboxspec.CheckFits(s, l); err != nil {
		t.Fatalf("pids_limit at the node's max: %v", err)
	}
	for _, pids := range []int64{4097, 4_000_000} {
		s.PidsLimit = pids
		wantField(t, sandboxspec.CheckFits(s, l), "pids_limit", fmt.Sprintf("%d processes exceeds the 4096 one sandbox may have on node n001 (node.max_pids_limit); ask for at most 4096, or 0 for the default 1024", pids))
	}
}

// The default node-wide ceiling leaves the host the larger of 2048 pids
// and 10%.
func TestTotalPidsCeiling(t *testing.T) {
	for _, c := range []struct{ avail, want int64 }{
		{32768, 32768 - 3276}, {4194304, 4194304 - 419430}, {16384, 16384 - 2048}, {3000, 1500},
	} {
		if got := sandboxspec.TotalPidsCeiling(c.avail); got != c.want {
			t.Errorf("TotalPidsCeiling(%d) = %d, want %d", c.avail, got, c.want)
		}
	}
	if n, err := sandboxspec.HostPids(); err != nil || n <= 0 {
		t.Fatalf("HostPids = %d, %v", n, err)
	}
}

// on_timeout and its alias auto_pause agree after Normalize: empty is stop,
// auto_pause alone is pause, on_timeout "pause" sets auto_pause.
func TestNormalizeOnTimeout(t *testing.T) {
	for _, c := range []struct {
		onTimeout string
		autoPause bool
		want      string
	}{
		{"", false, "stop"},
		{"", true, "pause"},
		{"stop", false, "stop"},
		{"pause", false, "pause"},
		{"pause", true, "pause"},
	} {
		got, err := sandboxspec.Normalize(sandboxspec.Spec{Image: "root/busybox", OnTimeout: c.onTimeout, AutoPause: c.autoPause})
		if err != nil {
			t.Fatalf("on_timeout %q auto_pause %v: %v", c.onTimeout, c.autoPause, err)
		}
		if got.OnTimeout != c.want || got.AutoPause != (c.want == "pause") || got.PauseOnTimeout() != (c.want == "pause") {
			t.Errorf("on_timeout %q auto_pause %v: got on_timeout %q auto_pause %v, want %q", c.onTimeout, c.autoPause, got.OnTimeout, got.AutoPause, c.want)
		}
	}
}

func TestNormalizeCPUClass(t *testing.T) {
	for in, want := range map[string]string{"": "latency", "latency": "latency", "best_effort": "best_effort"} {
		got, err := sandboxspec.Normalize(sandboxspec.Spec{Image: "root/busybox", CPUClass: in})
		if err != nil || got.CPUClass != want {
			t.Errorf("cpu_class %q: got %q, %v; want %q", in, got.CPUClass, err, want)
		}
	}
}
