package specpb

import (
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// FromNode converts a spec in the node's own message (opendsec.node.v1),
// refusing what FromProto refuses. Unlike the public message it carries
// BackendOptions.
func FromNode(p *nodev1.SandboxSpec) (sandboxspec.Spec, error) {
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
		Network:                  RulesFromNode(p.GetNetwork()),
		AutoPause:                p.GetAutoPause(),
		OnTimeout:                p.GetOnTimeout(),
		AllowPrivilegeEscalation: p.GetAllowPrivilegeEscalation(),
		CPUClass:                 p.GetCpuClass(),
		BackendOptions:           p.GetBackendOptions(),
		DiskMB:                   p.GetDiskMb(),
		Snapshot:                 p.GetSnapshot(),
	}, nil
}

// ToNode converts a spec to the node's message; a MemoryMB of 0 (not
// normalized) is unset.
func ToNode(s sandboxspec.Spec) *nodev1.SandboxSpec {
	p := &nodev1.SandboxSpec{
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
		Network:                  RulesToNode(s.Network),
		AutoPause:                s.AutoPause,
		OnTimeout:                s.OnTimeout,
		AllowPrivilegeEscalation: s.AllowPrivilegeEscalation,
		CpuClass:                 s.CPUClass,
		BackendOptions:           s.BackendOptions,
		DiskMb:                   s.DiskMB,
		Snapshot:                 s.Snapshot,
	}
	if s.MemoryMB != 0 {
		p.MemoryMb = proto.Int64(s.MemoryMB)
	}
	return p
}

// RulesFromNode converts a network policy in the node's message; nil stays
// nil (the node's default).
func RulesFromNode(p *nodev1.NetworkPolicy) *sandboxspec.NetworkRules {
	if p == nil {
		return nil
	}
	r := &sandboxspec.NetworkRules{RuleSets: p.GetRuleSets()}
	for _, a := range p.GetAllow() {
		r.Allow = append(r.Allow, sandboxspec.NetworkRule{CIDR: a.GetCidr(), Domain: a.GetDomain(), Protocol: a.GetProtocol(), Ports: a.GetPorts()})
	}
	return r
}

// RulesToNode converts a network policy to the node's message; nil stays
// nil.
func RulesToNode(r *sandboxspec.NetworkRules) *nodev1.NetworkPolicy {
	if r == nil {
		return nil
	}
	p := &nodev1.NetworkPolicy{RuleSets: r.RuleSets}
	for _, a := range r.Allow {
		p.Allow = append(p.Allow, &nodev1.NetworkRule{Cidr: a.CIDR, Domain: a.Domain, Protocol: a.Protocol, Ports: a.Ports})
	}
	return p
}
