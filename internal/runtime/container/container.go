// Package container is the container backend: each sandbox is an OCI
// container run by the runc binary with namespaces (pid, mount, uts, ipc,
// network, cgroup), cgroup limits (v1 and v2), Docker's default seccomp
// profile and capability set, no_new_privs and masked /proc paths, on an
// overlayfs root. opendsec-init is the container's PID 1 and starts the
// opendsec-agent on demand (both bind-mounted read-only); the node reaches
// the agent over a unix socket init holds.
//
// Create only prepares the bundle; Start runs it with one `runc run
// --detach`. The seccomp profile is compiled to BPF once per node start
// and installed by opendsec-init before anything else runs (seccomp_linux.go),
// so runc does not recompile it with libseccomp on every create.
//
// The runc binary (not libcontainer as a library) is used so containers are
// detached from the node process: they keep running when the node crashes or
// restarts, and Recover finds them again in runc's state directory.
package container

import (
	"github.com/kernflux/opendsec/internal/errdefs"
)

// Config configures the backend.
type Config struct {
	// RuncPath is the runc binary; empty means "runc" looked up in PATH.
	RuncPath string `json:"runc_path,omitempty"`
	// StateRoot is runc's state directory (runc --root); empty means
	// /run/opendsec/runc. It must be on a filesystem that survives a node
	// restart (tmpfs /run is fine: containers do not survive a reboot either).
	StateRoot string `json:"state_root,omitempty"`
	// CgroupParent is the cgroup under which every sandbox gets
	// <CgroupParent>/<id>; empty means /opendsec.
	CgroupParent string `json:"cgroup_parent,omitempty"`
}

// Defaults for Config.
const (
	DefaultRuncPath     = "runc"
	DefaultStateRoot    = "/run/opendsec/runc"
	DefaultCgroupParent = "/opendsec"
)

func (c *Config) setDefaults() {
	if c.RuncPath == "" {
		c.RuncPath = DefaultRuncPath
	}
	if c.StateRoot == "" {
		c.StateRoot = DefaultStateRoot
	}
	if c.CgroupParent == "" {
		c.CgroupParent = DefaultCgroupParent
	}
}

func (c *Config) validate() error {
	if c.StateRoot[0] != '/' {
		return errdefs.Invalid("container.state_root", "must be an absolute path, got %q", c.StateRoot)
	}
	if c.CgroupParent[0] != '/' {
		return errdefs.Invalid("container.cgroup_parent", "must start with '/', e.g. /opendsec, got %q", c.CgroupParent)
	}
	return nil
}
