// Package sched applies a sandbox's CPU class (runtime.CPUClass) to host
// processes and decides and applies core scheduling (PR_SCHED_CORE).
//
// best_effort runs a sandbox's threads under SCHED_IDLE: the kernel gives
// them CPU only when no normal (SCHED_OTHER) thread wants it, so a
// best-effort sandbox next to a latency one on the same CPU takes almost
// nothing from it (the backends also give its cgroup the least CPU
// weight). The policy is inherited over fork and clone, so setting it on a
// sandbox's init (a VM's QEMU before its threads exist) covers what it
// starts later.
//
// Core scheduling gives each VM's QEMU its own cookie: the kernel then never
// runs two tasks with different cookies on SMT siblings of one core at the
// same time, so a tenant's vCPU threads never share a core's caches and
// buffers with another tenant's. It only matters where SMT is on, and
// needs a kernel with CONFIG_SCHED_CORE.
package sched

// SMTActivePath says whether SMT is on (1) or off (0).
const SMTActivePath = "/sys/devices/system/cpu/smt/active"

// CoreDecision is whether the node gives sandboxes core-scheduling
// cookies, and why (for the log and the node's capabilities).
type CoreDecision struct {
	Enabled bool
	Reason  string
}

// DecideCore decides core scheduling from the content of SMTActivePath
// (smtActive; readErr when it could not be read) and whether the kernel
// answers PR_SCHED_CORE (kernelErr nil).
func DecideCore(smtActive string, readErr error, kernelErr error) CoreDecision {
	switch {
	case readErr != nil:
		return CoreDecision{Reason: "no SMT information (" + SMTActivePath + ": " + readErr.Error() + "): core scheduling off"}
	case trim(smtActive) != "1":
		return CoreDecision{Reason: "SMT is off (" + SMTActivePath + " = " + trim(smtActive) + "): no sibling to share, core scheduling not needed"}
	case kernelErr != nil:
		return CoreDecision{Reason: "SMT is on but the kernel has no core scheduling (PR_SCHED_CORE: " + kernelErr.Error() + "; CONFIG_SCHED_CORE): vCPUs of different tenants may share a core"}
	}
	return CoreDecision{Enabled: true, Reason: "SMT is on: each VM gets its own core-scheduling cookie"}
}

func trim(s string) string {
	for len(s) > 0 && (s[len(s)-1] == '\n' || s[len(s)-1] == ' ') {
		s = s[:len(s)-1]
	}
	return s
}
