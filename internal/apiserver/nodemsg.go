package apiserver

import (
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/kernflux/opendsec/api/gen/opendsec/node/v1"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// This file is the one place where the public API (opendsec.v1) meets the
// node's own messages (opendsec.node.v1): every request the apiserver sends
// a node is built here, and every node answer becomes a public one here.
// node.v1 may change with the node; the public answers must not change
// with it. Node-only fields (Sandbox.backend,
// SandboxSpec.backend_options) are not in the public API and are dropped.

// ---- requests: public -> node ----

func nodeCreateRequest(id string, spec *v1.SandboxSpec, requestID string, skipPool bool) *nodev1.CreateSandboxRequest {
	return &nodev1.CreateSandboxRequest{SandboxId: id, Spec: nodeSpec(spec), RequestId: requestID, SkipWarmPool: skipPool}
}

func nodeGetRequest(id string) *nodev1.GetSandboxRequest {
	return &nodev1.GetSandboxRequest{SandboxId: id}
}

func nodeListRequest() *nodev1.ListSandboxesRequest {
	return &nodev1.ListSandboxesRequest{}
}

func nodeStopRequest(id string) *nodev1.StopSandboxRequest {
	return &nodev1.StopSandboxRequest{SandboxId: id}
}

func nodeSetTimeoutRequest(m *v1.SetTimeoutRequest) *nodev1.SetTimeoutRequest {
	return &nodev1.SetTimeoutRequest{SandboxId: m.GetId(), TimeoutSeconds: m.GetTimeoutSeconds()}
}

func nodeSetNetworkRequest(m *v1.SetNetworkRequest) *nodev1.SetNetworkRequest {
	return &nodev1.SetNetworkRequest{SandboxId: m.GetId(), Network: nodeNetwork(m.GetNetwork())}
}

func nodePauseRequest(m *v1.PauseSandboxRequest) *nodev1.PauseSandboxRequest {
	return &nodev1.PauseSandboxRequest{SandboxId: m.GetId(), Reclaim: m.GetReclaim(), FilesystemOnly: m.GetFilesystemOnly()}
}

func nodeResumeRequest(m *v1.ResumeSandboxRequest) *nodev1.ResumeSandboxRequest {
	return &nodev1.ResumeSandboxRequest{SandboxId: m.GetId(), TimeoutSeconds: m.GetTimeoutSeconds()}
}

func nodeForkRequest(m *v1.ForkSandboxRequest) *nodev1.ForkSandboxRequest {
	return &nodev1.ForkSandboxRequest{SandboxId: m.GetSandboxId(), Count: m.GetCount(), RequestId: m.GetRequestId(),
		TimeoutSeconds: m.GetTimeoutSeconds(), TargetNode: m.GetTargetNode()}
}

func nodeMetricsRequest(m *v1.GetSandboxMetricsRequest) *nodev1.GetSandboxMetricsRequest {
	return &nodev1.GetSandboxMetricsRequest{SandboxId: m.GetId()}
}

func nodePauseBatchRequest(sel *v1.SandboxSelector, reclaim bool) *nodev1.PauseSandboxesRequest {
	return &nodev1.PauseSandboxesRequest{Selector: nodeSelector(sel), Reclaim: reclaim}
}

func nodeResumeBatchRequest(sel *v1.SandboxSelector, timeoutSec int64) *nodev1.ResumeSandboxesRequest {
	return &nodev1.ResumeSandboxesRequest{Selector: nodeSelector(sel), TimeoutSeconds: timeoutSec}
}

// nodeSpec maps a (normalized) public spec field by field; nil stays nil
// and an unset memory_mb stays unset, so the node judges exactly what the
// caller gave.
func nodeSpec(p *v1.SandboxSpec) *nodev1.SandboxSpec {
	if p == nil {
		return nil
	}
	n := &nodev1.SandboxSpec{
		Backend:                  p.GetBackend(),
		Image:                    p.GetImage(),
		Cpu:                      p.GetCpu(),
		TimeoutSeconds:           p.GetTimeoutSeconds(),
		IdleTimeoutSeconds:       p.GetIdleTimeoutSeconds(),
		Env:                      p.GetEnv(),
		User:                     p.GetUser(),
		Labels:                   p.GetLabels(),
		TaskId:                   p.GetTaskId(),
		PidsLimit:                p.GetPidsLimit(),
		Workdir:                  p.GetWorkdir(),
		Network:                  nodeNetwork(p.GetNetwork()),
		AutoPause:                p.GetAutoPause(),
		OnTimeout:                p.GetOnTimeout(),
		AllowPrivilegeEscalation: p.GetAllowPrivilegeEscalation(),
		CpuClass:                 p.GetCpuClass(),
		DiskMb:                   p.GetDiskMb(),
		Snapshot:                 p.GetSnapshot(),
	}
	if p.MemoryMb != nil {
		n.MemoryMb = proto.Int64(p.GetMemoryMb())
	}
	return n
}

// nodeNetwork maps a policy; nil (the node's default) stays nil and an
// empty one (deny everything) stays empty.
func nodeNetwork(p *v1.NetworkPolicy) *nodev1.NetworkPolicy {
	if p == nil {
		return nil
	}
	n := &nodev1.NetworkPolicy{RuleSets: p.GetRuleSets()}
	for _, r := range p.GetAllow() {
		n.Allow = append(n.Allow, &nodev1.NetworkRule{Cidr: r.GetCidr(), Domain: r.GetDomain(), Protocol: r.GetProtocol(), Ports: r.GetPorts()})
	}
	return n
}

func nodeSelector(s *v1.SandboxSelector) *nodev1.SandboxSelector {
	if s == nil {
		return nil
	}
	return &nodev1.SandboxSelector{Labels: s.GetLabels(), TaskId: s.GetTaskId(), Ids: s.GetIds()}
}

// ---- answers: node -> public ----

// publicSandbox is the public view of a node's sandbox; nil stays nil.
func publicSandbox(n *nodev1.Sandbox) *v1.Sandbox {
	if n == nil {
		return nil
	}
	return &v1.Sandbox{
		Id:               n.GetId(),
		NodeId:           n.GetNodeId(),
		Spec:             publicSpec(n.GetSpec()),
		State:            publicState(n.GetState()),
		CreatedAt:        n.GetCreatedAt(),
		ExpiresAt:        n.GetExpiresAt(),
		LastActivityAt:   n.GetLastActivityAt(),
		Reason:           n.GetReason(),
		FromWarmPool:     n.GetFromWarmPool(),
		Owner:            n.GetOwner(),
		Project:          n.GetProject(),
		ParentId:         n.GetParentId(),
		PausedFilesystem: n.GetPausedFilesystem(),
	}
}

// publicForks maps a node's fork answer.
func publicForks(n *nodev1.ForkSandboxResponse) *v1.ForkSandboxResponse {
	out := &v1.ForkSandboxResponse{SourceFrozenUs: n.GetSourceFrozenUs()}
	for _, f := range n.GetForks() {
		out.Forks = append(out.Forks, &v1.ForkResult{Sandbox: publicSandbox(f.GetSandbox()), MemoryPreserved: f.GetMemoryPreserved()})
	}
	return out
}

func publicSandboxes(ns []*nodev1.Sandbox) []*v1.Sandbox {
	if ns == nil {
		return nil
	}
	out := make([]*v1.Sandbox, len(ns))
	for i, n := range ns {
		out[i] = publicSandbox(n)
	}
	return out
}

// publicSpec is nodeSpec's inverse; backend options are left out.
func publicSpec(n *nodev1.SandboxSpec) *v1.SandboxSpec {
	if n == nil {
		return nil
	}
	p := &v1.SandboxSpec{
		Backend:                  n.GetBackend(),
		Image:                    n.GetImage(),
		Cpu:                      n.GetCpu(),
		TimeoutSeconds:           n.GetTimeoutSeconds(),
		IdleTimeoutSeconds:       n.GetIdleTimeoutSeconds(),
		Env:                      n.GetEnv(),
		User:                     n.GetUser(),
		Labels:                   n.GetLabels(),
		TaskId:                   n.GetTaskId(),
		PidsLimit:                n.GetPidsLimit(),
		Workdir:                  n.GetWorkdir(),
		Network:                  publicNetwork(n.GetNetwork()),
		AutoPause:                n.GetAutoPause(),
		OnTimeout:                n.GetOnTimeout(),
		AllowPrivilegeEscalation: n.GetAllowPrivilegeEscalation(),
		CpuClass:                 n.GetCpuClass(),
		DiskMb:                   n.GetDiskMb(),
		Snapshot:                 n.GetSnapshot(),
	}
	if n.MemoryMb != nil {
		p.MemoryMb = proto.Int64(n.GetMemoryMb())
	}
	return p
}

func publicNetwork(n *nodev1.NetworkPolicy) *v1.NetworkPolicy {
	if n == nil {
		return nil
	}
	p := &v1.NetworkPolicy{RuleSets: n.GetRuleSets()}
	for _, r := range n.GetAllow() {
		p.Allow = append(p.Allow, &v1.NetworkRule{Cidr: r.GetCidr(), Domain: r.GetDomain(), Protocol: r.GetProtocol(), Ports: r.GetPorts()})
	}
	return p
}

// publicState maps by value name (the enums name their values alike); a
// value the public enum does not have is UNSPECIFIED.
func publicState(s nodev1.SandboxState) v1.SandboxState {
	return v1.SandboxState(v1.SandboxState_value[s.String()])
}

func publicMetrics(n *nodev1.SandboxMetrics) *v1.SandboxMetrics {
	if n == nil {
		return nil
	}
	return &v1.SandboxMetrics{
		Timestamp:      n.GetTimestamp(),
		CpuCount:       n.GetCpuCount(),
		CpuUsedPct:     n.GetCpuUsedPct(),
		CpuUsageNs:     n.GetCpuUsageNs(),
		MemUsedBytes:   n.GetMemUsedBytes(),
		MemTotalBytes:  n.GetMemTotalBytes(),
		MemCacheBytes:  n.GetMemCacheBytes(),
		Pids:           n.GetPids(),
		PidsLimit:      n.GetPidsLimit(),
		DiskUsedBytes:  n.GetDiskUsedBytes(),
		DiskTotalBytes: n.GetDiskTotalBytes(),
		State:          publicState(n.GetState()),
	}
}

func publicReclaims(ns []*nodev1.SandboxReclaim) []*v1.SandboxReclaim {
	if ns == nil {
		return nil
	}
	out := make([]*v1.SandboxReclaim, len(ns))
	for i, n := range ns {
		out[i] = &v1.SandboxReclaim{SandboxId: n.GetSandboxId(), BytesBefore: n.GetBytesBefore(), BytesAfter: n.GetBytesAfter(),
			BytesFreed: n.GetBytesFreed(), Note: n.GetNote()}
	}
	return out
}

func publicFailures(ns []*nodev1.BatchFailure) []*v1.BatchFailure {
	if ns == nil {
		return nil
	}
	out := make([]*v1.BatchFailure, len(ns))
	for i, n := range ns {
		out[i] = &v1.BatchFailure{SandboxId: n.GetSandboxId(), ErrorCode: n.GetErrorCode(), ErrorMessage: n.GetErrorMessage()}
	}
	return out
}

// ---- snapshots ----

// publicSnapshot is the public view of a node's snapshot; nil stays nil.
func publicSnapshot(n *nodev1.Snapshot) *v1.Snapshot {
	if n == nil {
		return nil
	}
	return &v1.Snapshot{
		Id:              n.GetId(),
		Name:            n.GetName(),
		NodeId:          n.GetNodeId(),
		SourceSandboxId: n.GetSourceSandboxId(),
		Backend:         n.GetBackend(),
		Image:           n.GetImage(),
		ImageId:         n.GetImageId(),
		Spec:            publicSpec(n.GetSpec()),
		Memory:          n.GetMemory(),
		SizeBytes:       n.GetSizeBytes(),
		CreatedAt:       n.GetCreatedAt(),
		Owner:           n.GetOwner(),
		Project:         n.GetProject(),
	}
}

func nodeCreateSnapshotRequest(m *v1.CreateSnapshotRequest) *nodev1.CreateSnapshotRequest {
	return &nodev1.CreateSnapshotRequest{SandboxId: m.GetSandboxId(), Name: m.GetName()}
}
