// Package spectest holds spec inputs shared by the tests of every component
// that validates specs (apiserver, node), so they can show they give the
// same answer as sandboxspec for the same input.
package spectest

import (
	"strings"

	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// Bad is a spec every node refuses, whatever its backends and capacity.
type Bad struct {
	// Field is the field the error must name.
	Field string
	Spec  *v1.SandboxSpec
}

// BadSpecs are node-independent bad inputs, one bad field each.
func BadSpecs() []Bad {
	img := func(f func(*v1.SandboxSpec)) *v1.SandboxSpec {
		s := &v1.SandboxSpec{Image: "root/busybox"}
		f(s)
		return s
	}
	return []Bad{
		{"spec", nil},
		{"image", &v1.SandboxSpec{}},
		{"image", &v1.SandboxSpec{Image: "   "}},
		{"image", &v1.SandboxSpec{Image: "root/busy box"}},
		{"backend", img(func(s *v1.SandboxSpec) { s.Backend = "Not A Backend" })},
		{"cpu", img(func(s *v1.SandboxSpec) { s.Cpu = -1 })},
		{"cpu", img(func(s *v1.SandboxSpec) { s.Cpu = 0.001 })},
		{"memory_mb", img(func(s *v1.SandboxSpec) { s.MemoryMb = proto.Int64(-5) })},
		{"memory_mb", img(func(s *v1.SandboxSpec) { s.MemoryMb = proto.Int64(0) })},
		{"memory_mb", img(func(s *v1.SandboxSpec) { s.MemoryMb = proto.Int64(15) })},
		{"timeout_seconds", img(func(s *v1.SandboxSpec) { s.TimeoutSeconds = -1 })},
		{"timeout_seconds", img(func(s *v1.SandboxSpec) { s.TimeoutSeconds = 86401 })},
		{"idle_timeout_seconds", img(func(s *v1.SandboxSpec) { s.IdleTimeoutSeconds = -1 })},
		{"idle_timeout_seconds", img(func(s *v1.SandboxSpec) { s.IdleTimeoutSeconds = 86401 })},
		{"pids_limit", img(func(s *v1.SandboxSpec) { s.PidsLimit = -1 })},
		{"pids_limit", img(func(s *v1.SandboxSpec) { s.PidsLimit = 3 })},
		{"pids_limit", img(func(s *v1.SandboxSpec) { s.PidsLimit = 10_000_000 })},
		{"env", img(func(s *v1.SandboxSpec) { s.Env = map[string]string{"": "x"} })},
		{"env", img(func(s *v1.SandboxSpec) { s.Env = map[string]string{"A=B": "x"} })},
		{"env", img(func(s *v1.SandboxSpec) { s.Env = map[string]string{"A": "x\x00y"} })},
		{"env", img(func(s *v1.SandboxSpec) { s.Env = map[string]string{"A": strings.Repeat("x", 128<<10)} })},
		{"user", img(func(s *v1.SandboxSpec) { s.User = "Robert'); DROP" })},
		{"labels", img(func(s *v1.SandboxSpec) { s.Labels = map[string]string{"bad key": "x"} })},
		{"labels", img(func(s *v1.SandboxSpec) { s.Labels = map[string]string{"k": strings.Repeat("v", 257)} })},
		{"task_id", img(func(s *v1.SandboxSpec) { s.TaskId = strings.Repeat("t", 129) })},
		{"workdir", img(func(s *v1.SandboxSpec) { s.Workdir = "relative" })},
		{"disk_mb", img(func(s *v1.SandboxSpec) { s.DiskMb = -1 })},
		{"disk_mb", img(func(s *v1.SandboxSpec) { s.DiskMb = 15 })},
	}
}
