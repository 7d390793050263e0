package microvm

import (
	"context"
	"debug/elf"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
)

// Name is the backend's name in the registry and in specs.
const Name = "microvm"

func init() { runtime.Register(Name, open) }

// Config is node.backends.microvm.
type Config struct {
	// FirecrackerPath and JailerPath are the binaries (defaults
	// /usr/local/bin/firecracker and /usr/local/bin/jailer).
	FirecrackerPath string `json:"firecracker_path"`
	JailerPath      string `json:"jailer_path"`
	// ChrootBase is the jailer's --chroot-base-dir (default /srv/jailer).
	ChrootBase string `json:"chroot_base"`
	// UIDStart and UIDCount are the uids (and gids) given to VMs, one each
	// (default 900000 and 65536).
	UIDStart int `json:"uid_start"`
	UIDCount int `json:"uid_count"`
	// GuestDir holds the guest assets, vmlinux and initrd.cpio (default
	// /var/cache/opendsec/guest/current).
	GuestDir string `json:"guest_dir"`
	// KVMDevice is the KVM device (default /dev/kvm).
	KVMDevice string `json:"kvm_device"`
}

func (c *Config) defaults() {
	if c.FirecrackerPath == "" {
		c.FirecrackerPath = "/usr/local/bin/firecracker"
	}
	if c.JailerPath == "" {
		c.JailerPath = "/usr/local/bin/jailer"
	}
	if c.ChrootBase == "" {
		c.ChrootBase = "/srv/jailer"
	}
	if c.UIDStart == 0 {
		c.UIDStart = 900000
	}
	if c.UIDCount == 0 {
		c.UIDCount = 65536
	}
	if c.GuestDir == "" {
		c.GuestDir = "/var/cache/opendsec/guest/current"
	}
	if c.KVMDevice == "" {
		c.KVMDevice = "/dev/kvm"
	}
}

func (c Config) validate() error {
	const f = "node.backends.microvm."
	for _, nf := range [][2]string{{"firecracker_path", c.FirecrackerPath}, {"jailer_path", c.JailerPath}, {"chroot_base", c.ChrootBase}, {"guest_dir", c.GuestDir}, {"kvm_device", c.KVMDevice}} {
		if name, p := nf[0], nf[1]; !filepath.IsAbs(p) {
			return errdefs.Invalid(f+name, "is %q; give an absolute path", p)
		}
	}
	if c.UIDStart < 1000 || c.UIDCount < 1 || c.UIDStart+c.UIDCount > 1<<31 {
		return errdefs.Invalid(f+"uid_start", "uid range %d+%d is not usable; give uid_start >= 1000 and uid_count >= 1 below 2^31", c.UIDStart, c.UIDCount)
	}
	return nil
}

// parseConfig decodes and checks the config section.
func parseConfig(raw json.RawMessage) (Config, error) {
	var c Config
	if err := runtime.DecodeConfig(Name, raw, &c); err != nil {
		return Config{}, err
	}
	c.defaults()
	return c, c.validate()
}

// checkBinaries reports a missing or non-executable firecracker or jailer.
func checkBinaries(c Config) error {
	for _, nf := range [][2]string{{"firecracker_path", c.FirecrackerPath}, {"jailer_path", c.JailerPath}} {
		name, p := nf[0], nf[1]
		st, err := os.Stat(p)
		if err != nil || !st.Mode().IsRegular() || st.Mode().Perm()&0o111 == 0 {
			why := "is not an executable file"
			if err != nil {
				why = err.Error()
			}
			return errdefs.New(errdefs.ErrFailedPrecondition, "microvm backend: %s (node.backends.microvm.%s): %s; install Firecracker (deploy/quickstart.sh does where it can download it) or remove the microvm section", p, name, why)
		}
	}
	if interp, err := elfInterp(c.FirecrackerPath); err == nil && interp != "" {
		return errdefs.New(errdefs.ErrFailedPrecondition, "microvm backend: %s (node.backends.microvm.firecracker_path) is dynamically linked (it needs %s): the jailer runs it in an empty chroot, where it cannot start; use a static build (the release binaries are; a build from source needs the musl target or RUSTFLAGS=\"-C target-feature=+crt-static\")", c.FirecrackerPath, interp)
	}
	return nil
}

// elfInterp is the ELF program interpreter (dynamic loader) path names,
// "" for a static executable.
func elfInterp(path string) (string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return "", err
	}
	defer func() { _ = f.Close() }()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			b := make([]byte, p.Filesz)
			if _, err := p.ReadAt(b, 0); err != nil {
				return "", err
			}
			return strings.TrimRight(string(b), "\x00"), nil
		}
	}
	return "", nil
}

// uids hands out one uid per VM from the configured range.
type uids struct {
	mu    sync.Mutex
	start int
	used  map[int]bool
	count int
}

func newUIDs(start, count int) *uids { return &uids{start: start, count: count, used: map[int]bool{}} }

func (u *uids) get() (int, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for i := range u.count {
		if !u.used[u.start+i] {
			u.used[u.start+i] = true
			return u.start + i, nil
		}
	}
	return 0, errdefs.New(errdefs.ErrResourceExhausted, "microvm: all %d uids from %d are in use; raise node.backends.microvm.uid_count", u.count, u.start)
}

// take marks uid used (a sandbox found by Recover keeps its uid).
func (u *uids) take(uid int) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if uid < u.start || uid >= u.start+u.count {
		return errdefs.New(errdefs.ErrFailedPrecondition, "microvm: uid %d is outside node.backends.microvm's range %d+%d; was the range changed with VMs running?", uid, u.start, u.count)
	}
	u.used[uid] = true
	return nil
}

func (u *uids) put(uid int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	delete(u.used, uid)
}

// jailID is what the jailer accepts as --id.
var jailID = regexp.MustCompile(`^[a-zA-Z0-9-]{1,64}$`)

// Jail is one VM's jailer setup.
type Jail struct {
	ID       string
	UID, GID int
	NetNS    string
	// CgroupVersion is 1 or 2; CPU in cores, MemoryMB the VM's memory plus
	// the VMM's overhead.
	CgroupVersion int
	CPU           float64
	MemoryMB      int64
	// Parent is the jailer's --parent-cgroup ("": the jailer's default,
	// the exec file's name).
	Parent string
}

// APISocket is the API socket's path inside the jail.
const APISocket = "/run/firecracker.socket"

// Root is the jail's chroot: <base>/<exec name>/<id>/root.
func (c Config) Root(id string) string {
	return filepath.Join(c.ChrootBase, filepath.Base(c.FirecrackerPath), id, "root")
}

// JailerArgs is the jailer's command line for j.
func (c Config) JailerArgs(j Jail) ([]string, error) {
	if !jailID.MatchString(j.ID) {
		return nil, errdefs.Invalid("id", "%q is not a jailer id (letters, digits and '-', at most 64)", j.ID)
	}
	args := []string{
		"--id", j.ID,
		"--exec-file", c.FirecrackerPath,
		"--uid", strconv.Itoa(j.UID),
		"--gid", strconv.Itoa(j.GID),
		"--chroot-base-dir", c.ChrootBase,
		"--cgroup-version", strconv.Itoa(j.CgroupVersion),
	}
	if j.NetNS != "" {
		args = append(args, "--netns", j.NetNS)
	}
	if j.Parent != "" {
		args = append(args, "--parent-cgroup", j.Parent)
	}
	const period = 100000
	quota := int64(j.CPU * period)
	switch j.CgroupVersion {
	case 1:
		if quota > 0 {
			args = append(args, "--cgroup", fmt.Sprintf("cpu.cfs_period_us=%d", period), "--cgroup", fmt.Sprintf("cpu.cfs_quota_us=%d", quota))
		}
		if j.MemoryMB > 0 {
			args = append(args, "--cgroup", fmt.Sprintf("memory.limit_in_bytes=%d", j.MemoryMB<<20))
		}
	case 2:
		if quota > 0 {
			args = append(args, "--cgroup", fmt.Sprintf("cpu.max=%d %d", quota, period))
		}
		if j.MemoryMB > 0 {
			args = append(args, "--cgroup", fmt.Sprintf("memory.max=%d", j.MemoryMB<<20))
		}
	default:
		return nil, errdefs.New(errdefs.ErrInternal, "cgroup version %d", j.CgroupVersion)
	}
	return append(args, "--", "--api-sock", APISocket), nil
}

// PrepareJail makes the jail's root and links the plan's host files into
// it (kernel, initrd, layers, writable drive), returning the plan with
// paths as the VMM sees them. It validates the plan first; on any error
// nothing of the jail is left.
func (c Config) PrepareJail(ctx context.Context, j Jail, p Plan, hostCPUs int) (Plan, error) {
	if err := p.Validate(hostCPUs); err != nil {
		return Plan{}, err
	}
	if !jailID.MatchString(j.ID) {
		return Plan{}, errdefs.Invalid("id", "%q is not a jailer id (letters, digits and '-', at most 64)", j.ID)
	}
	root := c.Root(j.ID)
	if err := os.MkdirAll(filepath.Join(root, "run"), 0o750); err != nil {
		return Plan{}, errdefs.New(errdefs.ErrInternal, "jail root: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = c.RemoveJail(j.ID)
		}
	}()
	in := p
	// Read-only files are shared with the host (a hard link, or a
	// read-only bind mount across filesystems); the sandbox's own disks
	// become the VM's uid's.
	place := func(host, name string, own bool) (string, error) {
		if host == "" {
			return "", nil
		}
		if err := ctx.Err(); err != nil {
			return "", err
		}
		owner := -1
		if own {
			owner = j.UID
		}
		if err := placeFile(host, filepath.Join(root, name), owner, j.GID); err != nil {
			return "", errdefs.New(errdefs.ErrInternal, "jail file %s: %w", name, err)
		}
		return "/" + name, nil
	}
	link := func(host, name string) (string, error) { return place(host, name, false) }
	var err error
	if in.Kernel, err = link(p.Kernel, "vmlinux"); err != nil {
		return Plan{}, err
	}
	if in.Initrd, err = link(p.Initrd, "initrd.cpio"); err != nil {
		return Plan{}, err
	}
	in.Layers = make([]string, len(p.Layers))
	for i, l := range p.Layers {
		if in.Layers[i], err = link(l, fmt.Sprintf("layer%d.erofs", i)); err != nil {
			return Plan{}, err
		}
	}
	if in.Writable, err = place(p.Writable, "rw.img", true); err != nil {
		return Plan{}, err
	}
	if in.ConfigDisk, err = place(p.ConfigDisk, "config.img", true); err != nil {
		return Plan{}, err
	}
	in.VsockPath = "/run/vsock.sock"
	in.LogPath, in.Metrics = "", ""
	ok = true
	return in, nil
}

// RemoveJail removes what PrepareJail and the jailer made for id.
func (c Config) RemoveJail(id string) error {
	if !jailID.MatchString(id) {
		return nil
	}
	if err := unmountUnder(filepath.Dir(c.Root(id))); err != nil {
		return errdefs.New(errdefs.ErrInternal, "remove jail: %w", err)
	}
	if err := os.RemoveAll(filepath.Dir(c.Root(id))); err != nil {
		return errdefs.New(errdefs.ErrInternal, "remove jail: %w", err)
	}
	return nil
}

// PlanFor is the VM plan of spec on the host: vCPUs are the CPU limit
// rounded up, the guest assets come from GuestDir, every layer must be an
// EROFS file (a disk), and a tap attachment becomes the VM's NIC. The
// guest's kernel command line is left to the guest assets' contract.
func (c Config) PlanFor(spec runtime.Spec, writable string) (Plan, error) {
	p := Plan{
		VCPUs:    int(math.Ceil(spec.Resources.CPU)),
		MemoryMB: spec.Resources.MemoryMB,
		Kernel:   filepath.Join(c.GuestDir, "vmlinux"),
		Initrd:   filepath.Join(c.GuestDir, "initrd.cpio"),
		Writable: writable,
	}
	if p.VCPUs == 0 {
		p.VCPUs = 1
	}
	for i, l := range spec.Rootfs.Layers {
		if l.Format != runtime.LayerEROFS {
			return Plan{}, errdefs.Invalid(fmt.Sprintf("rootfs.layers[%d]", i), "is a %s layer; the microvm backend attaches layers as disks and needs EROFS files from the image store", l.Format)
		}
		p.Layers = append(p.Layers, l.Path)
	}
	switch spec.Network.Mode {
	case runtime.NetworkNone:
	case runtime.NetworkTap:
		if spec.Network.Device == "" {
			return Plan{}, errdefs.Invalid("network.device", "is empty; a tap attachment names its tap")
		}
		p.Tap = spec.Network.Device
		if spec.Network.MAC != nil {
			p.MAC = spec.Network.MAC.String()
		}
	default:
		return Plan{}, errdefs.Invalid("network.mode", "is %q; the microvm backend takes a tap attachment or none", spec.Network.Mode)
	}
	return p, nil
}

// CheckBinaries reports whether the firecracker and jailer binaries that
// node.backends.microvm (raw; empty for the defaults) names are there:
// nil, or a failed precondition naming the missing one. The node asks it
// when it picks its default backend.
func CheckBinaries(raw json.RawMessage) error {
	c, err := parseConfig(raw)
	if err != nil {
		return err
	}
	return checkBinaries(c)
}
