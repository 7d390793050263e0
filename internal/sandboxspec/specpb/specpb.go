// Package specpb maps sandboxspec.Spec to and from its protobuf messages,
// in one place for the apiserver and the node: the public
// opendsec.v1.SandboxSpec (FromProto, ToProto) and the node's own
// opendsec.node.v1.SandboxSpec (FromNode, ToNode), which also carries
// backend options. It is apart from sandboxspec so that backends, which import
// sandboxspec for its limits, do not depend on the generated API code.
package specpb

import (
	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// FromProto converts a caller's spec. It refuses only what the Go type
// cannot express: a missing spec, and an explicit memory_mb of 0 (in the
// API unset means the default; 0 is a mistake). Everything else is for
// sandboxspec.Normalize.
func FromProto(p *v1.SandboxSpec) (sandboxspec.Spec, error) {
	if p == nil {
		return sandboxspec.Spec{}, errdefs.Invalid("spec", "is missing; give at least an image, e.g. {\"image\": \"root/busybox\"}")
	}
	if p.MemoryMb != nil && *p.MemoryMb == 0 {
		return sandboxspec.Spec{}, sandboxspec.MemoryTooSmall(0)
	}
	return sandboxspec.Spec{
		Backend:                  p.GetBackend(),
		Image:                    p.GetImage(),
		CPU:                      p.GetCpu(),
		MemoryMB:                 p.GetMemoryMb(),
		TimeoutSec:               p.GetTimeoutSeconds(),
		IdleSec:                  p.GetIdleTimeoutSeconds(),
		Env:                      p.GetEnv(),
		User:                     p.GetUser(),
		Labels:                   p.GetLabels(),
		TaskID:                   p.GetTaskId(),
		PidsLimit:                p.GetPidsLimit(),
		Workdir:                  p.GetWorkdir(),
		Network:                  RulesFromProto(p.GetNetwork()),
		AutoPause:                p.GetAutoPause(),
		OnTimeout:                p.GetOnTimeout(),
		AllowPrivilegeEscalation: p.GetAllowPrivilegeEscalation(),
		CPUClass:                 p.GetCpuClass(),
		DiskMB:                   p.GetDiskMb(),
		Snapshot:                 p.GetSnapshot(),
	}, nil
}

// ToProto converts a spec back; a MemoryMB of 0 (not normalized) is unset.
// BackendOptions have no API field yet and are not carried.
func ToProto(s sandboxspec.Spec) *v1.SandboxSpec {
	p := &v1.SandboxSpec{
		Backend:                  s.Backend,
		Image:                    s.Image,
		Cpu:                      s.CPU,
		TimeoutSeconds:           s.TimeoutSec,
		IdleTimeoutSeconds:       s.IdleSec,
		Env:                      s.Env,
		User:                     s.User,
		Labels:                   s.Labels,
		TaskId:                   s.TaskID,
		PidsLimit:                s.PidsLimit,
		Workdir:                  s.Workdir,
		Network:                  RulesToProto(s.Network),
		AutoPause:                s.AutoPause,
		OnTimeout:                s.OnTimeout,
		AllowPrivilegeEscalation: s.AllowPrivilegeEscalation,
		CpuClass:                 s.CPUClass,
		DiskMb:                   s.DiskMB,
		Snapshot:                 s.Snapshot,
	}
	if s.MemoryMB != 0 {
		p.MemoryMb = proto.Int64(s.MemoryMB)
	}
	return p
}

// RulesFromProto converts a network policy; nil stays nil (the node's
// default).
func RulesFromProto(p *v1.NetworkPolicy) *sandboxspec.NetworkRules {
	if p == nil {
		return nil
	}
	r := &sandboxspec.NetworkRules{RuleSets: p.GetRuleSets()}
	for _, a := range p.GetAllow() {
		r.Allow = append(r.Allow, sandboxspec.NetworkRule{CIDR: a.GetCidr(), Domain: a.GetDomain(), Protocol: a.GetProtocol(), Ports: a.GetPorts()})
	}
	return r
}

// RulesToProto converts a network policy; nil stays nil.
func RulesToProto(r *sandboxspec.NetworkRules) *v1.NetworkPolicy {
	if r == nil {
		return nil
	}
	p := &v1.NetworkPolicy{RuleSets: r.RuleSets}
	for _, a := range r.Allow {
		p.Allow = append(p.Allow, &v1.NetworkRule{Cidr: a.CIDR, Domain: a.Domain, Protocol: a.Protocol, Ports: a.Ports})
	}
	return p
}
