// Package runtime is the backend contract: the lifecycle of one sandbox on one
// node, the same for containers, microVMs and VMs. Exec and files are not part
// of it: they go through the agent inside every sandbox, reached with
// AgentConn. Optional capabilities (pause, snapshot, fork, stats) are separate
// interfaces found by type assertion and advertised in Info().Capabilities.
//
// Every backend passes the conformance suite in runtime/runtimetest.
package runtime

import (
	"context"
	"net"
	"time"
)

// Image is a root filesystem made of read-only layers.
type Image struct {
	// Name is for logs and labels, e.g. "root/py:3.11".
	Name string
	// Layers are read-only directories, topmost first. The sandbox's root is
	// these layers plus a private writable upper layer.
	Layers []string
	// Env ("K=V"), Workdir and User are the image's defaults.
	Env     []string
	Workdir string
	User    string
}

// Resources are the sandbox's limits.
type Resources struct {
	CPU       float64 // cores
	MemoryMB  int64
	PidsLimit int64
}

// Spec describes a sandbox to create.
type Spec struct {
	ID        string
	Image     Image
	Resources Resources
	// Env for the agent and, through it, every process ("K=V").
	Env []string
	// Hostname inside the sandbox; empty = ID.
	Hostname string
	// AgentPath is the host path of the static opendsec-agent binary. The
	// backend makes it available read-only inside the sandbox and runs it,
	// on demand, under InitPath.
	AgentPath string
	// InitPath is the host path of the static opendsec-init binary, the
	// sandbox's PID 1: it holds the agent's listening socket and starts the
	// agent server when a connection arrives. Empty means opendsec-init in
	// AgentPath's directory.
	InitPath string
	// AgentIdleExit is how long the agent server stays without requests,
	// processes or watchers before it exits (init starts it again on the
	// next connection). Zero means never.
	AgentIdleExit time.Duration
	// StateDir is a node-local directory owned by the backend for this
	// sandbox (upper layer, sockets, logs). The node creates it and removes
	// it after Delete.
	StateDir string
	Labels   map[string]string
	// NetNS is the path of a network namespace the sandbox joins (made and
	// policed by the node, see internal/netpolicy). It must exist by Start,
	// not yet at Create: the node makes it while the backend prepares.
	// Empty means a new, empty namespace (only loopback).
	NetNS string
	// Nameservers are written to the sandbox's /etc/resolv.conf when set.
	Nameservers []string
}

// Handle lets a backend find a sandbox again after the node restarts. The
// node stores it in its sandbox table and passes it back to Recover.
type Handle struct {
	ID      string
	Version int
	// State is the backend's own blob (JSON for the container backend).
	State []byte
}

// State is a sandbox's state as the backend sees it.
type State string

const (
	StateCreated State = "created"
	StateRunning State = "running"
	StatePaused  State = "paused"
	StateStopped State = "stopped"
)

// Status is what Status reports.
type Status struct {
	State State
	// Pid of the sandbox's init on the host (0 if none).
	Pid int
	// ExitCode of init when stopped, if known.
	ExitCode int
}

// StopOptions control Stop.
type StopOptions struct {
	// Timeout before SIGKILL after SIGTERM; 0 means kill at once.
	Timeout time.Duration
}

// Capabilities lists the optional interfaces a backend implements.
type Capabilities struct {
	Pause    bool
	Snapshot bool
	Fork     bool
	Stats    bool
}

// Info describes a backend.
type Info struct {
	Name         string
	Version      string
	Capabilities Capabilities
}

// Runtime is the backend contract. All methods are safe for concurrent use
// on different sandboxes. Errors use the internal/errdefs categories: a
// missing sandbox is errdefs.ErrNotFound, a bad Spec errdefs.ErrInvalidArgument.
type Runtime interface {
	Info() Info
	// Create prepares the sandbox (root filesystem, cgroups, config) without
	// starting it. On error nothing is left behind.
	Create(ctx context.Context, spec Spec) (Handle, error)
	// Start runs the sandbox's init (the agent).
	Start(ctx context.Context, id string) error
	// Stop ends every process of the sandbox. The sandbox can be deleted after.
	Stop(ctx context.Context, id string, opts StopOptions) error
	// Delete removes everything Create made: mounts, cgroups, files under
	// StateDir owned by the backend. Idempotent: deleting a missing sandbox
	// succeeds.
	Delete(ctx context.Context, id string) error
	// Status reports the sandbox's state; errdefs.ErrNotFound if unknown.
	Status(ctx context.Context, id string) (Status, error)
	// Recover re-attaches to a sandbox after a node restart, from its Handle.
	// Running sandboxes keep running; errdefs.ErrNotFound if it is gone.
	Recover(ctx context.Context, h Handle) error
	// AgentConn opens a connection to the sandbox's agent (a unix socket for
	// containers, vsock or virtio-serial for VMs) that speaks HTTP.
	AgentConn(ctx context.Context, id string) (net.Conn, error)
}

// Prestarter is implemented by backends that can make a sandbox's processes
// ahead of its start, for a node's warm pool. After Create and Prestart
// everything of the sandbox exists (namespaces, mounts, cgroups, its network
// joined, its agent's socket listening) but nothing of it runs, and Status
// reports StateCreated. Launch lets it run, with env ("K=V", on top of the
// image's) as its agent's environment instead of Spec.Env; Start of a
// prestarted sandbox is Launch with no env. Stop and Delete work on a
// prestarted sandbox that never ran.
type Prestarter interface {
	Prestart(ctx context.Context, id string) error
	Launch(ctx context.Context, id string, env []string) error
}

// Pauser is implemented by backends that can freeze a sandbox. Both are
// idempotent: pausing a paused sandbox and resuming a running one succeed.
// While paused, no process of the sandbox runs (its agent does not answer),
// memory and files are kept, and Status reports StatePaused, also after a
// Recover. Stop and Delete work on a paused sandbox.
type Pauser interface {
	Pause(ctx context.Context, id string) error
	Resume(ctx context.Context, id string) error
}

// Stats is a sandbox's resource use, host-side. Zero means unknown for the
// limits and the disk fields.
type Stats struct {
	// MemoryBytes is the memory charged to the sandbox, page cache included.
	MemoryBytes int64
	// MemoryCacheBytes is the page cache part of MemoryBytes.
	MemoryCacheBytes int64
	// MemoryLimitBytes is the sandbox's memory limit.
	MemoryLimitBytes int64
	// CPUNanos is the CPU time used since the sandbox started.
	CPUNanos uint64
	Pids     int64
	// PidsLimit is the sandbox's process limit.
	PidsLimit int64
	// DiskUsedBytes is what the sandbox wrote to its writable layer;
	// DiskTotalBytes is the size of the filesystem that holds it.
	DiskUsedBytes  int64
	DiskTotalBytes int64
	// DiskMeasuredAt is when the disk numbers were measured: a backend may
	// cache them (measuring can mean walking every file). Zero when they
	// are not known yet.
	DiskMeasuredAt time.Time
}

// StatsReader is implemented by backends that report resource use.
type StatsReader interface {
	Stats(ctx context.Context, id string) (Stats, error)
}
