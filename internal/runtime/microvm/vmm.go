package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
)

// MaxVCPUs is Firecracker's limit (MachineConfiguration.vcpu_count maximum).
const MaxVCPUs = 32

// AgentVsockPort is the guest port the agent listens on.
const AgentVsockPort = 1024

// GuestCID is every VM's guest CID: each VM has its own vsock device and
// host socket, so the CID need not differ, and a clone keeps the source's.
const GuestCID = 3

// Plan is everything one VM boots with, as paths inside the jail.
type Plan struct {
	VCPUs    int
	MemoryMB int64
	Kernel   string
	Initrd   string
	BootArgs string
	// Layers are read-only drives, topmost first; Writable is the
	// sandbox's writable drive.
	Layers   []string
	Writable string
	// ConfigDisk is the guest's configuration disk (vmchan.GuestConfig),
	// read-only, after Writable ("" for none).
	ConfigDisk string
	// Tap is the tap inside the sandbox's netns ("" for none), MAC its guest MAC.
	Tap, MAC  string
	VsockPath string
	LogPath   string
	Metrics   string
	// BalloonMB inflates a balloon of this size at boot (0: no balloon).
	BalloonMB int64
}

// Validate checks the plan's numbers and files before anything is made;
// hostCPUs bounds the vCPUs. Fields are named as the create request names them.
func (p Plan) Validate(hostCPUs int) error {
	switch {
	case p.MemoryMB <= 0:
		return errdefs.Invalid("resources.memory_mb", "is %d; a microVM needs memory, give at least 128", p.MemoryMB)
	case p.VCPUs <= 0:
		return errdefs.Invalid("resources.cpu", "gives %d vCPUs; give at least 1", p.VCPUs)
	case p.VCPUs > MaxVCPUs:
		return errdefs.Invalid("resources.cpu", "gives %d vCPUs, more than Firecracker's %d; give at most %d", p.VCPUs, MaxVCPUs, min(MaxVCPUs, hostCPUs))
	case hostCPUs > 0 && p.VCPUs > hostCPUs:
		return errdefs.Invalid("resources.cpu", "gives %d vCPUs, more than this host's %d; give at most %d", p.VCPUs, hostCPUs, hostCPUs)
	}
	if err := regular(p.Kernel); err != nil {
		return errdefs.New(errdefs.ErrFailedPrecondition, "guest kernel: %w; build the guest assets (make guest) or set node.backends.microvm.kernel", err)
	}
	if p.Initrd != "" {
		if err := regular(p.Initrd); err != nil {
			return errdefs.New(errdefs.ErrFailedPrecondition, "guest initrd: %w; build the guest assets (make guest) or set node.backends.microvm.initrd", err)
		}
	}
	return nil
}

func regular(path string) error {
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() || st.Size() == 0 {
		return fmt.Errorf("%s is not a non-empty file", path)
	}
	return nil
}

// Boot configures a VM that has not started through its API (Configure)
// and starts it (InstanceStart).
func Boot(ctx context.Context, c *Client, p Plan) error {
	if err := Configure(ctx, c, p); err != nil {
		return err
	}
	if err := c.Action(ctx, ActionInstanceStart); err != nil {
		return fmt.Errorf("boot: %w", err)
	}
	return nil
}

// Configure configures a VM that has not started: logger and metrics
// first (Firecracker takes them only before boot), then machine, kernel,
// drives, network, vsock, balloon.
func Configure(ctx context.Context, c *Client, p Plan) error {
	if p.LogPath != "" {
		if err := c.PutLogger(ctx, Logger{LogPath: p.LogPath, Level: "Warning", ShowLevel: true}); err != nil {
			return fmt.Errorf("boot: %w", err)
		}
	}
	if p.Metrics != "" {
		if err := c.PutMetrics(ctx, Metrics{MetricsPath: p.Metrics}); err != nil {
			return fmt.Errorf("boot: %w", err)
		}
	}
	steps := []func() error{
		func() error {
			return c.PutMachineConfig(ctx, MachineConfig{VcpuCount: p.VCPUs, MemSizeMib: p.MemoryMB})
		},
		func() error {
			return c.PutBootSource(ctx, BootSource{KernelImagePath: p.Kernel, InitrdPath: p.Initrd, BootArgs: p.BootArgs})
		},
	}
	for i, l := range p.Layers {
		d := Drive{DriveID: fmt.Sprintf("layer%d", i), PathOnHost: l, IsReadOnly: true, IsRootDevice: false}
		steps = append(steps, func() error { return c.PutDrive(ctx, d) })
	}
	if p.Writable != "" {
		d := Drive{DriveID: "rw", PathOnHost: p.Writable, CacheType: "Unsafe"}
		steps = append(steps, func() error { return c.PutDrive(ctx, d) })
	}
	if p.ConfigDisk != "" {
		d := Drive{DriveID: "config", PathOnHost: p.ConfigDisk, IsReadOnly: true}
		steps = append(steps, func() error { return c.PutDrive(ctx, d) })
	}
	if p.Tap != "" {
		n := NetworkInterface{IfaceID: "eth0", HostDevName: p.Tap, GuestMAC: p.MAC}
		steps = append(steps, func() error { return c.PutNetworkInterface(ctx, n) })
	}
	if p.VsockPath != "" {
		steps = append(steps, func() error { return c.PutVsock(ctx, Vsock{GuestCID: GuestCID, UDSPath: p.VsockPath}) })
	}
	if p.BalloonMB > 0 {
		steps = append(steps, func() error {
			return c.PutBalloon(ctx, Balloon{AmountMib: p.BalloonMB, DeflateOnOOM: true, StatsPollingIntervalS: 1})
		})
	}
	for _, s := range steps {
		if err := s(); err != nil {
			return fmt.Errorf("boot: %w", err)
		}
	}
	return nil
}

// SnapshotMeta is written next to a snapshot: what it needs to be loaded
// safely. Loads refuse a snapshot whose files changed size or content or
// that was made under another accelerator kind.
type SnapshotMeta struct {
	Version int `json:"version"`
	// Accel is the accelerator kind the snapshot was made under
	// (kvmprobe Kind, e.g. "hardware"); vCPU state does not carry across.
	Accel       string `json:"accel"`
	MemoryMB    int64  `json:"memory_mb"`
	VCPUs       int    `json:"vcpus"`
	StateSize   int64  `json:"state_size"`
	StateSHA256 string `json:"state_sha256"`
	MemSize     int64  `json:"mem_size"`
}

// Snapshot file names inside a snapshot directory.
const (
	SnapshotStateFile = "vmstate"
	SnapshotMemFile   = "memory"
	SnapshotMetaFile  = "snapshot.json"
)

// CreateSnapshot pauses the VM, writes a full snapshot to dir (paths as
// the VMM sees them: jailDir is dir inside the jail, "" for the same),
// resumes it unless keepPaused, and writes the metadata. The VM is paused
// only while Firecracker writes its state.
func CreateSnapshot(ctx context.Context, c *Client, dir, jailDir string, meta SnapshotMeta, keepPaused bool) (err error) {
	if jailDir == "" {
		jailDir = dir
	}
	defer func() {
		if keepPaused {
			return
		}
		if rerr := c.PatchVM(context.WithoutCancel(ctx), VMResumed); rerr != nil && err == nil {
			err = fmt.Errorf("snapshot: resume source: %w", rerr)
		}
	}()
	if err := vmmSnapshot(ctx, c, jailDir); err != nil {
		return err
	}
	return writeMeta(dir, meta)
}

// vmmSnapshot has the paused VMM save its state and memory files in
// jailDir (a path as the VMM sees it).
func vmmSnapshot(ctx context.Context, c *Client, jailDir string) error {
	if err := c.PatchVM(ctx, VMPaused); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	if err := c.CreateSnapshot(ctx, SnapshotCreate{
		SnapshotType: SnapshotFull,
		SnapshotPath: filepath.Join(jailDir, SnapshotStateFile),
		MemFilePath:  filepath.Join(jailDir, SnapshotMemFile),
	}); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	return nil
}

func writeMeta(dir string, meta SnapshotMeta) error {
	sum, err := vmm.SumFile(filepath.Join(dir, SnapshotStateFile), true)
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "snapshot state file: %w", err)
	}
	meta.StateSize, meta.StateSHA256 = sum.Size, sum.SHA256
	st, err := os.Stat(filepath.Join(dir, SnapshotMemFile))
	if err != nil {
		return errdefs.New(errdefs.ErrInternal, "snapshot memory file: %w", err)
	}
	meta.MemSize = st.Size()
	return writeMetaFile(dir, meta)
}

// writeMetaFile writes meta (its sizes and digest filled) in dir, a
// directory only the node writes.
func writeMetaFile(dir string, meta SnapshotMeta) error {
	meta.Version = 1
	b, _ := json.MarshalIndent(meta, "", "  ")
	tmp := filepath.Join(dir, SnapshotMetaFile+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return errdefs.New(errdefs.ErrInternal, "snapshot metadata: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, SnapshotMetaFile)); err != nil {
		return errdefs.New(errdefs.ErrInternal, "snapshot metadata: %w", err)
	}
	return nil
}

// CheckSnapshot reads dir's metadata and checks the files against it and
// the accelerator kind of this host, before any VMM is started for a load.
func CheckSnapshot(dir, accel string) (SnapshotMeta, error) {
	var m SnapshotMeta
	b, err := os.ReadFile(filepath.Join(dir, SnapshotMetaFile))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return m, errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s has no %s: it is incomplete or not a microvm snapshot", dir, SnapshotMetaFile)
		}
		return m, errdefs.New(errdefs.ErrInternal, "snapshot metadata: %w", err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s: metadata is corrupted (%v)", dir, err)
	}
	if m.Accel != accel {
		return m, errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s was made under accelerator %q and this host is %q: vCPU state does not carry across accelerator kinds; make a new snapshot here", dir, m.Accel, accel)
	}
	st, err := os.Stat(filepath.Join(dir, SnapshotMemFile))
	if err != nil {
		return m, errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s memory file: %w", dir, err)
	}
	if st.Size() != m.MemSize || m.MemSize != m.MemoryMB<<20 {
		return m, errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s memory file is %d bytes, want %d (%d MiB): truncated or corrupted", dir, st.Size(), m.MemoryMB<<20, m.MemoryMB)
	}
	sum, err := vmm.SumFile(filepath.Join(dir, SnapshotStateFile), true)
	if err != nil {
		return m, errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s state file: %w", dir, err)
	}
	if sum.Size != m.StateSize || sum.SHA256 != m.StateSHA256 {
		return m, errdefs.New(errdefs.ErrFailedPrecondition, "snapshot %s state file is %d bytes with sha256 %.12s, recorded %d bytes %.12s: truncated or corrupted", dir, sum.Size, sum.SHA256, m.StateSize, m.StateSHA256)
	}
	return m, nil
}

// Load restores a fresh VMM (started with no configuration) from a
// checked snapshot: memory from the File backend (mapped MAP_PRIVATE by
// Firecracker, so clones share the file's pages), the clone's own tap, and
// resumes it. jailDir is the snapshot directory as the VMM sees it.
func Load(ctx context.Context, c *Client, jailDir, tap string) error {
	req := SnapshotLoad{
		SnapshotPath: filepath.Join(jailDir, SnapshotStateFile),
		MemBackend:   &MemoryBackend{BackendType: "File", BackendPath: filepath.Join(jailDir, SnapshotMemFile)},
		ResumeVM:     true,
	}
	if tap != "" {
		req.NetworkOverrides = []NetworkOverride{{IfaceID: "eth0", HostDevName: tap}}
	}
	if err := c.LoadSnapshot(ctx, req); err != nil {
		return fmt.Errorf("load snapshot: %w", err)
	}
	return nil
}
