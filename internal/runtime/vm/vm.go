// Package vm is the QEMU backend: one qemu-system-x86_64 per sandbox, run
// in the sandbox's network namespace with its tap as a virtio-net NIC, the
// image's EROFS layers as read-only virtio-blk disks and a sparse ext4 disk
// in the sandbox's StateDir as its writable layer. QEMU is driven through
// QMP on a unix socket in StateDir; the agent is reached over a
// virtio-serial port named "agent" whose chardev socket is in StateDir; the
// serial console goes to console.log and QEMU's stderr to qemu.log there.
//
// The accelerator is always passed explicitly (-accel tcg or kvm): "auto"
// asks kvmprobe, because on a PVM host `-accel kvm` does not fail but the
// guest dies in KVM's instruction emulator. "KVM internal error" or
// "emulation failure" in qemu.log or console.log is a fatal accelerator
// mismatch: the QEMU process is killed and the error says so.
//
// QEMU processes are not the node's: they keep running when the node
// restarts, and Recover finds them again from the pid (checked against
// /proc/<pid>/cmdline and its start time) and the QMP socket in the Handle.
package vm

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Name is the backend's name in the registry and in specs.
const Name = "vm"

// Defaults used when the config or the Spec leaves them at zero.
const (
	DefaultVCPUs    = 1
	DefaultMemoryMB = 512
	// DefaultDiskMB is the writable disk's size when Resources.DiskMB is 0.
	DefaultDiskMB = 2048
	// MemoryOverheadMB is added to the guest's RAM for the QEMU process's
	// cgroup memory limit: TCG's code buffer (32 MiB with tb-size=32),
	// QEMU's own heap and the device state.
	MemoryOverheadMB = 128
	// DefaultAssetsDir is where `make guest-assets` puts the guest kernel
	// and initramfs (one subdirectory per version, "current" the newest).
	DefaultAssetsDir = "/var/cache/opendsec/guest/current"
	// DefaultMemoryDir holds the guests' RAM files (a tmpfs: guest RAM is
	// a shared file mapping there, so a snapshot copies it without QEMU).
	DefaultMemoryDir = "/dev/shm/opendsec-vm"
	// DefaultBootTimeout bounds Start's wait for the agent: a TCG boot takes
	// ~2 s on an idle machine and many times that on a busy one.
	DefaultBootTimeout = 120 * time.Second
)

// Layer devices (Config.LayerDevice).
const (
	LayerBlk  = "blk"
	LayerPmem = "pmem"
)

func init() { runtime.Register(Name, open) }

// Config is node.backends.vm.
type Config struct {
	// QEMUPath is the qemu-system-x86_64 binary; empty means it is looked up in PATH.
	QEMUPath string `json:"qemu_path,omitempty"`
	// AssetsDir holds vmlinux and initrd.cpio; empty means DefaultAssetsDir.
	AssetsDir string `json:"assets_dir,omitempty"`
	// Accel is "auto" (default: kvmprobe decides), "tcg" or "kvm".
	Accel string `json:"accel,omitempty"`
	// Machine is "microvm" (default) or "q35".
	Machine string `json:"machine,omitempty"`
	// VCPUs and MemoryMB are checked and kept for older configs; a
	// sandbox's own Resources.CPU and MemoryMB (which the node always
	// gives; 0 is refused) size its VM.
	VCPUs    int   `json:"vcpus,omitempty"`
	MemoryMB int64 `json:"memory_mb,omitempty"`

	// MemoryDir holds each VM's RAM file; empty means DefaultMemoryDir.
	// It should be a tmpfs: the running guest writes its RAM there.
	MemoryDir string `json:"memory_dir,omitempty"`

	// FreePageReporting gives every booted VM a virtio-balloon device with
	// free page reporting (and deflate-on-oom): pages the guest frees go
	// back to the host (QEMU punches them out of the guest's RAM file).
	// Unset means on, where the guest assets support it (their manifest
	// lists "balloon-control": the init can unbind the driver before a
	// snapshot, see docs/vm-guest.md); false turns it off.
	FreePageReporting *bool `json:"free_page_reporting,omitempty"`

	// LayerDevice is how image layers reach the guest: "blk" (default:
	// read-only virtio-blk disks; the guest caches what it reads in its
	// own RAM) or "pmem" (virtio-pmem devices mapping the layer file
	// shared and read-only, mounted with DAX: every VM reads the host's
	// one page-cache copy). "pmem" needs guest assets that list
	// "pmem-layers"; with older ones VMs get "blk". Layers are given as
	// copies padded to 2 MiB (the guest maps device memory in 2 MiB
	// sections), one per layer digest under the node's state dir.
	LayerDevice string `json:"layer_device,omitempty"`

	// AgentChannel is how the host reaches a booted VM's agent: "auto"
	// (default: vsock where the host has vhost-vsock, else serial),
	// "serial" (yamux over a virtio-serial port, internal/vmchan) or
	// "vsock" (a vhost-vsock device with a guest CID per VM; refused at
	// open where /dev/vhost-vsock does not open). A restore keeps its
	// snapshot's channel.
	AgentChannel string `json:"agent_channel,omitempty"`

	// BootTimeoutSec bounds Start's wait for the guest's agent (0: DefaultBootTimeout).
	BootTimeoutSec int `json:"boot_timeout_sec,omitempty"`

	// noAgentWait makes Start return at QMP "running" (tests with the
	// halting stand-in kernel, which has no agent).
	noAgentWait bool

	// NodeID and NodeStateDir come from runtime.Env.
	NodeID       string `json:"-"`
	NodeStateDir string `json:"-"`
}

func (c *Config) defaults() error {
	if c.QEMUPath == "" {
		c.QEMUPath = "qemu-system-x86_64"
	}
	if c.MemoryDir == "" {
		c.MemoryDir = DefaultMemoryDir
	}
	if c.AssetsDir == "" {
		c.AssetsDir = DefaultAssetsDir
	}
	switch c.Accel {
	case "":
		c.Accel = "auto"
	case "auto", "tcg", "kvm":
	default:
		return fmt.Errorf("node.backends.vm.accel %q: %w: use \"auto\", \"tcg\" or \"kvm\"", c.Accel, errdefs.ErrInvalidArgument)
	}
	switch c.Machine {
	case "":
		c.Machine = "microvm"
	case "microvm", "q35":
	default:
		return fmt.Errorf("node.backends.vm.machine %q: %w: use \"microvm\" or \"q35\"", c.Machine, errdefs.ErrInvalidArgument)
	}
	switch c.LayerDevice {
	case "":
		c.LayerDevice = LayerBlk
	case LayerBlk, LayerPmem:
	default:
		return fmt.Errorf("node.backends.vm.layer_device %q: %w: use %q (default) or %q", c.LayerDevice, errdefs.ErrInvalidArgument, LayerBlk, LayerPmem)
	}
	if c.LayerDevice == LayerPmem && c.Machine != "q35" {
		return fmt.Errorf("node.backends.vm.layer_device %q: %w: it needs machine \"q35\" (QEMU's microvm has no memory-device slots: the guest never sees a virtio-pmem device); set machine to \"q35\" or layer_device to %q", c.LayerDevice, errdefs.ErrInvalidArgument, LayerBlk)
	}
	switch c.AgentChannel {
	case "":
		c.AgentChannel = ChannelAuto
	case ChannelAuto, ChannelSerial, ChannelVsock:
	default:
		return fmt.Errorf("node.backends.vm.agent_channel %q: %w: use %q (default), %q or %q", c.AgentChannel, errdefs.ErrInvalidArgument, ChannelAuto, ChannelSerial, ChannelVsock)
	}
	if c.VCPUs < 0 {
		return fmt.Errorf("node.backends.vm.vcpus %d: %w: use 0 (default %d) or more", c.VCPUs, errdefs.ErrInvalidArgument, DefaultVCPUs)
	}
	if c.MemoryMB < 0 {
		return fmt.Errorf("node.backends.vm.memory_mb %d: %w: use 0 (default %d) or more", c.MemoryMB, errdefs.ErrInvalidArgument, DefaultMemoryMB)
	}
	if c.BootTimeoutSec < 0 {
		return fmt.Errorf("node.backends.vm.boot_timeout_sec %d: %w: use 0 (default %s) or more", c.BootTimeoutSec, errdefs.ErrInvalidArgument, DefaultBootTimeout)
	}
	if c.VCPUs == 0 {
		c.VCPUs = DefaultVCPUs
	}
	if c.MemoryMB == 0 {
		c.MemoryMB = DefaultMemoryMB
	}
	return nil
}

func (c *Config) bootTimeout() time.Duration {
	if c.BootTimeoutSec == 0 {
		return DefaultBootTimeout
	}
	return time.Duration(c.BootTimeoutSec) * time.Second
}

// kernelPath and initrdPath are the guest assets.
func (c *Config) kernelPath() string { return filepath.Join(c.AssetsDir, "vmlinux") }
func (c *Config) initrdPath() string { return filepath.Join(c.AssetsDir, "initrd.cpio") }

func open(ctx context.Context, env runtime.Env, raw json.RawMessage) (runtime.Runtime, error) {
	var cfg Config
	if err := runtime.DecodeConfig(Name, raw, &cfg); err != nil {
		return nil, err
	}
	cfg.NodeID = env.NodeID
	cfg.NodeStateDir = env.StateDir
	return New(ctx, cfg)
}

// handleState is the Handle's State blob.
type handleState struct {
	Pid int `json:"pid"`
	// StartTime is field 22 of /proc/<pid>/stat, so a reused pid is not
	// taken for the sandbox's QEMU.
	StartTime uint64   `json:"start_time"`
	StateDir  string   `json:"state_dir"`
	Cgroup    string   `json:"cgroup"`
	Accel     string   `json:"accel"`
	MemoryMB  int64    `json:"memory_mb"`
	VCPUs     int      `json:"vcpus"`
	Args      []string `json:"args"`
	// MemPath is the guest's RAM file; MemShared says QEMU maps it shared
	// (a booted VM: a snapshot copies it) rather than private (a restored
	// one: its pages are the snapshot's until written).
	MemPath   string `json:"mem_path,omitempty"`
	MemShared bool   `json:"mem_shared,omitempty"`
	// Incoming is the migration state file Start restores from ("" boots).
	Incoming string `json:"incoming,omitempty"`
	// IncomingStreamRAM: the state file has the guest's RAM (it was not
	// a shared file at the snapshot), so it loads without x-ignore-shared.
	IncomingStreamRAM bool `json:"incoming_stream_ram,omitempty"`
	// Identity is what the guest is told after a restore.
	Hostname string `json:"hostname,omitempty"`
	MAC      string `json:"mac,omitempty"`
	Addr     string `json:"addr,omitempty"`
	Gateway  string `json:"gateway,omitempty"`
	// NetNS is the network namespace QEMU runs in, for a Start after Recover.
	NetNS string `json:"netns,omitempty"`
	// Balloon: the VM has a virtio-balloon with free page reporting, whose
	// guest driver a snapshot unbinds first (and binds again after, on a
	// VM that maps its own RAM file shared).
	Balloon bool `json:"balloon,omitempty"`
	// AgentCID is the guest CID of the VM's vhost-vsock device, which
	// carries its agent channel; 0: the virtio-serial port does.
	AgentCID uint32 `json:"agent_cid,omitempty"`
	// CPUClass is the sandbox's runtime.CPUClass.
	CPUClass string `json:"cpu_class,omitempty"`
}
