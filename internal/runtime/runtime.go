// Package runtime is the backend contract: the lifecycle of one sandbox on one
// node, the same for containers, microVMs and VMs. Exec and files are not part
// of it: they go through the agent inside every sandbox, reached with
// AgentConn. Optional capabilities (prestart, pause, stats, snapshot, fork,
// rootfs diff) are separate interfaces found by type assertion and
// advertised in Info().Capabilities (CapabilitiesOf fills them from the
// interfaces, so the two cannot disagree).
//
// A Spec is backend-neutral: the root filesystem arrives as layer
// descriptors from the image store (a backend that needs directories asks
// the store to mount them; a VM backend attaches the EROFS files as disks),
// the guest settings are what the guest sees (env, hostname, user, workdir,
// nameservers), and the network is an attachment the node made (a netns with
// a veth or a tap, one fixed guest address). What only one backend
// understands is in that backend's own config (Register) or in
// Spec.Options, which the backend validates.
//
// Backends register by name (Register) and the node is built from the
// config's backends section (Open); the node never imports a backend.
// Every backend passes the conformance suite in runtime/runtimetest.
package runtime

import (
	"context"
	"net"
	"net/netip"
	"time"
)

// LayerFormat is how the image store keeps a layer.
type LayerFormat string

const (
	// LayerEROFS: Layer.Path is an EROFS image file.
	LayerEROFS LayerFormat = "erofs"
	// LayerDir: Layer.Path is a directory tree.
	LayerDir LayerFormat = "dir"
)

// Layer is one read-only layer of a root filesystem, as the image store
// keeps it.
type Layer struct {
	// Digest is the layer's content digest ("sha256:<hex>").
	Digest string
	Format LayerFormat
	// Path is the EROFS file or the directory, on the store's filesystem.
	Path string
	// Size is the size of Path in bytes (0 if unknown).
	Size int64
}

// LayerMounter makes layers available as read-only directories on this
// node. The image store implements it. Mounts are counted per holder (the
// sandbox ID) and dropped when the node releases the holder's image hold,
// so a backend never unmounts layers itself.
type LayerMounter interface {
	MountLayers(ctx context.Context, holder string, layers []Layer) ([]string, error)
}

// Rootfs is a sandbox's root filesystem: read-only layers (topmost first)
// under a private writable layer the backend makes in Spec.StateDir.
type Rootfs struct {
	// Image is the image's name, for logs and labels ("root/py:3.11").
	Image string
	// ImageID is the image's content ID.
	ImageID string
	Layers  []Layer
	// Mounter mounts Layers as directories for backends that need them
	// (Dirs). Nil when every layer is a LayerDir.
	Mounter LayerMounter
}

// Dirs returns the layers as directories, topmost first: LayerDir layers as
// they are, the others mounted through Mounter for holder.
func (r Rootfs) Dirs(ctx context.Context, holder string) ([]string, error) {
	var toMount []Layer
	for _, l := range r.Layers {
		if l.Format != LayerDir {
			toMount = append(toMount, l)
		}
	}
	if len(toMount) == 0 {
		dirs := make([]string, len(r.Layers))
		for i, l := range r.Layers {
			dirs[i] = l.Path
		}
		return dirs, nil
	}
	if r.Mounter == nil {
		return nil, errNoMounter
	}
	return r.Mounter.MountLayers(ctx, holder, r.Layers)
}

// Image is an image held for a sandbox: its root filesystem and the
// defaults from its config, which the node folds into Guest.
type Image struct {
	Rootfs  Rootfs
	Env     []string // "K=V"
	Workdir string
	User    string
}

// Guest is what the sandbox's processes see.
type Guest struct {
	// Env is the agent's environment and, through it, every process's
	// ("K=V", one entry per key): the image's env with the sandbox's on top
	// (MergeEnv).
	Env []string
	// Hostname; empty means the sandbox ID.
	Hostname string
	// User and Workdir are the default user and working directory of
	// processes (empty: root, /).
	User    string
	Workdir string
	// Nameservers go to /etc/resolv.conf when set.
	Nameservers []string
}

// NetworkMode is how the sandbox's network namespace reaches the guest.
type NetworkMode string

const (
	// NetworkNone: a new, empty namespace (only loopback).
	NetworkNone NetworkMode = ""
	// NetworkVeth: the node configured Device (a veth end) inside NetNS
	// with the guest address; a container joins NetNS and uses it as is.
	NetworkVeth NetworkMode = "veth"
	// NetworkTap: Device is a tap inside NetNS; a VM backend attaches it
	// to the guest's NIC (MAC) and the guest configures GuestAddr and
	// Gateway itself.
	NetworkTap NetworkMode = "tap"
)

// NetworkAttachment is the network the node made for a sandbox. Every
// sandbox's namespace has the same guest address, gateway and MAC (the node
// maps each to its own node-side address outside the namespace), so a
// memory snapshot or fork keeps a valid network configuration. A VM backend
// gives a restored or forked guest a MAC of its own and repoints the
// namespace's neighbour entry for GuestAddr on Device at it.
type NetworkAttachment struct {
	Mode NetworkMode
	// NetNS is the path of the network namespace. It must exist by Start,
	// not yet at Create: the node makes it while the backend prepares.
	NetNS string
	// Device is the interface inside NetNS the guest uses.
	Device string
	// GuestAddr (with its prefix), Gateway and MAC are the guest side.
	GuestAddr netip.Prefix
	Gateway   netip.Addr
	MAC       net.HardwareAddr
}

// Resources are the sandbox's limits.
type Resources struct {
	CPU       float64 // cores
	MemoryMB  int64
	PidsLimit int64
	// DiskMB is the quota of the sandbox's writable layer in MiB (bytes,
	// and inodes in proportion); 0 means no quota.
	DiskMB int64
}

// Spec describes a sandbox to create.
type Spec struct {
	ID        string
	Rootfs    Rootfs
	Resources Resources
	Guest     Guest
	Network   NetworkAttachment
	// StateDir is a node-local directory owned by the backend for this
	// sandbox (writable layer, sockets, logs). The node creates it and
	// removes it after Delete.
	StateDir string
	Labels   map[string]string
	// AllowPrivilegeEscalation lets the sandbox's processes gain
	// privileges through setuid programs (sudo): no no_new_privs. The
	// capability set, seccomp filter and namespaces stay the same.
	AllowPrivilegeEscalation bool
	// CPUClass is how the host schedules the sandbox's processes (a VM's
	// QEMU threads): CPULatency (the default, also for "") or
	// CPUBestEffort (SCHED_IDLE and the least cgroup CPU weight: it runs
	// on CPU time nothing else wants).
	CPUClass CPUClass
	// Options are backend-owned settings from the create request; the
	// backend validates them (ValidateOptions) before the node admits the
	// sandbox.
	Options map[string]string
}

// CPUClass is a sandbox's CPU class (sandboxspec's cpu_class).
type CPUClass string

const (
	CPULatency    CPUClass = "latency"
	CPUBestEffort CPUClass = "best_effort"
)

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
	// FilesystemPaused: the sandbox is paused with only its files kept
	// (FilesystemPauser); State is StatePaused and nothing of it runs.
	FilesystemPaused bool
}

// ExitStatus is how a sandbox's init ended, as Wait reports it.
type ExitStatus struct {
	// ExitCode is init's exit code, -1 when unknown (init was not the
	// node's child, or it was killed).
	ExitCode int
	// OOMKilled: the kernel killed a task of the sandbox for memory.
	OOMKilled bool
	// Reason says in a few words why the sandbox ended ("init exited",
	// "killed for memory", "stopped"), for the node to record.
	Reason string
	// At is when the backend saw the end.
	At time.Time
}

// StopOptions control Stop.
type StopOptions struct {
	// Timeout before SIGKILL after SIGTERM; 0 means kill at once.
	Timeout time.Duration
}

// Capabilities lists the optional interfaces a backend implements.
type Capabilities struct {
	Prestart   bool
	Pause      bool
	Stats      bool
	Snapshot   bool
	Fork       bool
	RootfsDiff bool
	// Reclaim: a paused sandbox's memory can be pushed out (Reclaimer).
	Reclaim bool
	// MemorySnapshot: snapshots and forks keep the sandbox's memory
	// (processes, open ports), not only its files.
	MemorySnapshot bool
	// FilesystemPause: a sandbox can be paused keeping only its files
	// (FilesystemPauser).
	FilesystemPause bool
}

// CapabilitiesOf derives the capabilities from the interfaces rt
// implements; MemorySnapshot is the backend's own word.
func CapabilitiesOf(rt Runtime, memorySnapshot bool) Capabilities {
	_, pre := rt.(Prestarter)
	_, pause := rt.(Pauser)
	_, stats := rt.(StatsReader)
	_, snap := rt.(Snapshotter)
	_, fork := rt.(Forker)
	_, diff := rt.(RootfsDiffer)
	_, reclaim := rt.(Reclaimer)
	_, fsPause := rt.(FilesystemPauser)
	return Capabilities{Prestart: pre, Pause: pause, Stats: stats, Snapshot: snap, Fork: fork, RootfsDiff: diff, Reclaim: reclaim,
		MemorySnapshot: memorySnapshot && (snap || fork), FilesystemPause: fsPause}
}

// Info describes a backend.
type Info struct {
	Name         string
	Version      string
	Capabilities Capabilities
	// Detail says in a sentence what the backend chose at open and why
	// (the container backend: its OCI runtime, runc or crun); may be
	// empty.
	Detail string
}

// Runtime is the backend contract. All methods are safe for concurrent use
// on different sandboxes. Errors use the internal/errdefs categories: a
// missing sandbox is errdefs.ErrNotFound, a bad Spec errdefs.ErrInvalidArgument.
type Runtime interface {
	Info() Info
	// ValidateOptions checks Spec.Options without making anything; the
	// node calls it before admitting a sandbox. A backend with no options
	// refuses every key, naming it.
	ValidateOptions(opts map[string]string) error
	// Create prepares the sandbox (root filesystem, cgroups, config) without
	// starting it. On error nothing is left behind.
	Create(ctx context.Context, spec Spec) (Handle, error)
	// Start runs the sandbox's init.
	Start(ctx context.Context, id string) error
	// Wait blocks until the sandbox's init has ended, however it ended
	// (Stop, a crash, a kill from outside, the OOM killer), or ctx ends.
	// It returns at once for a sandbox that already ended, also one found
	// by Recover. It does not delete anything. Waiting on a sandbox that
	// never started blocks until it starts and ends, or is deleted
	// (errdefs.ErrNotFound).
	Wait(ctx context.Context, id string) (ExitStatus, error)
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
// reports StateCreated. Launch lets it run, with env ("K=V") on top of
// Spec.Guest.Env as its agent's environment; Start of a prestarted sandbox
// is Launch with no env. Stop and Delete work on a prestarted sandbox that
// never ran.
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

// FilesystemPauser is implemented by backends that can pause a sandbox
// keeping only its files (E2B's pause with memory false): PauseFilesystem
// ends every process of the sandbox and frees its memory and cgroups, and
// keeps its writable layer, its config and its network attachment;
// ResumeFilesystem starts a fresh init and agent on that same writable
// layer. Both are idempotent. The end of init a PauseFilesystem causes is
// reported to Wait callers of the time (Reason says so); Wait called after
// PauseFilesystem returns blocks until the resumed sandbox ends. While so
// paused Status reports StatePaused with FilesystemPaused, also after a
// Recover, and Stop and Delete work. A ResumeFilesystem that fails leaves
// the sandbox paused so.
type FilesystemPauser interface {
	PauseFilesystem(ctx context.Context, id string) error
	ResumeFilesystem(ctx context.Context, id string) error
}

// Reclaimer is implemented by backends that can push a paused sandbox's
// memory out of RAM (to swap, where the host has it; page cache is dropped
// either way; the vm and gvisor backends write the whole guest to disk and
// end its VMM, and Resume restores it, the sandbox paused meanwhile, also
// after a Recover). Reclaim needs a paused sandbox (failed precondition
// otherwise) and leaves its limits as they were: whatever it lowers on the
// way is put back before it returns, and a backend that was killed mid-way
// puts it back at Resume or Recover. A resumed sandbox takes its pages back
// as it touches them; its processes and data are kept.
type Reclaimer interface {
	Reclaim(ctx context.Context, id string) (ReclaimStats, error)
}

// ReclaimStats is what one Reclaim freed: the memory the sandbox was
// charged in RAM (page cache included, swap not) before and after.
type ReclaimStats struct {
	Before, After int64
	// Note says why less was freed than could have been ("the node has no
	// swap: ..."); empty when nothing held the reclaim back.
	Note string
}

// Freed is Before - After, never negative (0 for nil).
func (s *ReclaimStats) Freed() int64 {
	if s == nil {
		return 0
	}
	return max(s.Before-s.After, 0)
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
	// DiskTotalBytes is its quota, or without one the size of the
	// filesystem that holds it.
	DiskUsedBytes  int64
	DiskTotalBytes int64
	// DiskInodes and DiskInodesLimit are the writable layer's inodes and
	// their quota; 0 when it has no quota.
	DiskInodes, DiskInodesLimit int64
	// DiskMeasuredAt is when the disk numbers were measured: a backend may
	// cache them (measuring can mean walking every file). Zero when they
	// are not known yet.
	DiskMeasuredAt time.Time
}

// StatsReader is implemented by backends that report resource use.
type StatsReader interface {
	Stats(ctx context.Context, id string) (Stats, error)
}

// NetworkModer is implemented by backends whose guests need a network
// attachment other than a veth (VM backends say NetworkTap); the node
// reads it to make the sandbox's network. Without it a backend gets a veth.
type NetworkModer interface {
	NetworkMode() NetworkMode
}

// NetworkModeOf is rt's network attachment mode (NetworkVeth unless it
// says otherwise).
func NetworkModeOf(rt Runtime) NetworkMode {
	if m, ok := rt.(NetworkModer); ok {
		return m.NetworkMode()
	}
	return NetworkVeth
}
