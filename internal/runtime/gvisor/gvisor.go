// Package gvisor is the gvisor backend: each sandbox is an OCI bundle run by
// runsc (gVisor's user-space kernel) on the systrap or ptrace platform, so it
// needs no KVM. The agent (opendsec-agent) is the sandbox's PID 1 and listens
// on TCP on the sandbox's own loopback (netstack); the node reaches it with
// `runsc exec <id> opendsec-agent --dial tcp:127.0.0.1:PORT` over a
// socketpair. A host unix socket bound into the sandbox would be quicker,
// but runsc cannot checkpoint a sandbox holding one ("Cannot save endpoint
// with bound host socket"), and memory snapshots are why this backend
// exists: Snapshot and Fork use `runsc checkpoint --leave-running` and
// Restore/Start use `runsc restore`, so restored sandboxes resume the
// source's processes and memory.
package gvisor

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Name is the backend's name in the registry and in specs.
const Name = "gvisor"

func init() { runtime.Register(Name, open) }

// Config configures the backend (node.backends.gvisor).
type Config struct {
	// RunscPath is the runsc binary; empty means "runsc" in PATH
	// (scripts/install-deps.sh installs a pinned one).
	RunscPath string `json:"runsc_path,omitempty"`
	// Platform is runsc's --platform: systrap (the default) or ptrace.
	Platform string `json:"platform,omitempty"`
	// StateRoot is runsc's --root; empty means /run/opendsec/<node>/runsc.
	StateRoot string `json:"state_root,omitempty"`
	// CgroupParent is the cgroup under which each sandbox gets <parent>/<id>;
	// empty means /opendsec-gvisor[-<node>].
	CgroupParent string `json:"cgroup_parent,omitempty"`
	// AgentPath is the static opendsec-agent binary, bind-mounted
	// read-only into every sandbox as its PID 1. Required.
	AgentPath string `json:"agent_path"`
	// DebugLogDir, when set, gets runsc's debug logs (one file per runsc
	// command and sandbox process: runsc --debug --debug-log=DIR/).
	DebugLogDir string `json:"debug_log_dir,omitempty"`
	// NodeID is from runtime.Env.
	NodeID string `json:"-"`
}

// Platforms runsc can use without KVM.
const (
	PlatformSystrap = "systrap"
	PlatformPtrace  = "ptrace"
)

func open(ctx context.Context, env runtime.Env, raw json.RawMessage) (runtime.Runtime, error) {
	var cfg Config
	if err := runtime.DecodeConfig(Name, raw, &cfg); err != nil {
		return nil, err
	}
	cfg.NodeID = env.NodeID
	return New(ctx, cfg)
}

func (c *Config) setDefaults() {
	if c.RunscPath == "" {
		c.RunscPath = "runsc"
	}
	if c.Platform == "" {
		c.Platform = PlatformSystrap
	}
	if c.StateRoot == "" {
		c.StateRoot = filepath.Join("/run/opendsec", c.NodeID, "runsc")
	}
	if c.CgroupParent == "" {
		c.CgroupParent = "/opendsec-gvisor"
		if c.NodeID != "" {
			c.CgroupParent += "-" + c.NodeID
		}
	}
}

func (c *Config) validate() error {
	switch c.Platform {
	case PlatformSystrap, PlatformPtrace:
	default:
		return errdefs.Invalid("gvisor.platform", "%q is not a platform runsc can use here; give systrap (the default) or ptrace", c.Platform)
	}
	if !filepath.IsAbs(c.StateRoot) {
		return errdefs.Invalid("gvisor.state_root", "must be an absolute path, got %q", c.StateRoot)
	}
	if c.CgroupParent == "" || c.CgroupParent[0] != '/' {
		return errdefs.Invalid("gvisor.cgroup_parent", "must start with '/', got %q", c.CgroupParent)
	}
	if !filepath.IsAbs(c.AgentPath) {
		return errdefs.Invalid("gvisor.agent_path", "%q must be the absolute path of opendsec-agent; build it with `make agent`", c.AgentPath)
	}
	if fi, err := os.Stat(c.AgentPath); err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return errdefs.Invalid("gvisor.agent_path", "%q is not an executable file; build it with `make agent`", c.AgentPath)
	}
	return nil
}
