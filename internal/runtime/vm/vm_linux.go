package vm

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/kvmprobe"
	"github.com/kernflux/opendsec/internal/runtime/sched"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
	"github.com/kernflux/opendsec/internal/unixsock"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// Runtime is the vm backend.
type Runtime struct {
	cfg   Config
	accel string
	why   string // why this accelerator

	sbs vmm.Table[sandbox]

	// privateSnapshots puts guest RAM into the migration stream (restores
	// get private copies): the benchmark's comparison with shared pages.
	privateSnapshots bool

	// channel is the agent channel of VMs this backend boots (decideChannel),
	// and why; vsockOK says whether the host has vhost-vsock (a restore
	// of a vsock VM needs it whatever channel is configured).
	channel, channelWhy string
	vsockOK             bool
	vsockWhy            string
	cids                cidAllocator
}

type sandbox struct {
	id   string
	spec runtime.Spec
	st   handleState

	startMu sync.Mutex // serialises Start; mu is held only for the fields
	mu      sync.Mutex
	started bool
	qmp     *qmpClient
	fatal   error // accelerator mismatch seen in the logs

	exit     *runtime.ExitLatch // QEMU's end (Done once it has exited)
	stopping bool
	startedC chan struct{}

	agentMu sync.Mutex // guards agent; held while dialling
	agent   *vmchan.Client

	// exited is closed when the current QEMU process has exited (nil
	// before the first). parking says its exit is Reclaim's doing: the
	// sandbox lives on, paused, with its state in reclaimDir.
	exited  chan struct{}
	parking bool
	// reclaimed: no QEMU runs; the guest's state is in reclaimDir and
	// Resume restores it (Status says paused).
	reclaimed bool
	// argsChanged: st.Args are not the Handle's (a reclaim's restore maps
	// the guest RAM shared again); the run file keeps them for Recover.
	argsChanged bool
}

var cgroupControllers = []string{"cpu", "memory", "pids"}

// New builds the backend: it checks the QEMU binary and decides the
// accelerator (explicit, or kvmprobe for "auto").
func New(ctx context.Context, cfg Config) (runtime.Runtime, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	p, err := exec.LookPath(cfg.QEMUPath)
	if err != nil {
		return nil, fmt.Errorf("node.backends.vm.qemu_path %q: %w: install qemu-system-x86 or set qemu_path: %w", cfg.QEMUPath, errdefs.ErrFailedPrecondition, err)
	}
	cfg.QEMUPath = p
	r := &Runtime{cfg: cfg, sbs: vmm.Table[sandbox]{Backend: Name}, accel: cfg.Accel, why: "configured"}
	r.vsockOK, r.vsockWhy = vhostVsock(vhostVsockPath)
	if r.vsockOK {
		r.cids.taken = cidTakenOnHost
	}
	if r.channel, r.channelWhy, err = decideChannel(cfg.AgentChannel, r.vsockOK, r.vsockWhy); err != nil {
		return nil, err
	}
	if cfg.Accel == "auto" {
		res, err := kvmprobe.Detect(ctx, kvmprobe.Options{})
		if err != nil {
			return nil, fmt.Errorf("vm accelerator detection: %w", err)
		}
		r.accel, r.why = string(res.Accel), res.Reason
	}
	slog.Info("vm backend", "qemu", p, "accel", r.accel, "why", r.why, "machine", cfg.Machine, "agent_channel", r.channel, "agent_channel_why", r.channelWhy)
	on, why := r.freePageReportingWhy()
	if cfg.FreePageReporting != nil && *cfg.FreePageReporting {
		slog.Warn("vm free page reporting", "on", on, "why", why)
	} else {
		slog.Info("vm free page reporting", "on", on, "why", why)
	}
	return r, nil
}

// Accel is the accelerator every VM of this backend gets, and why.
func (r *Runtime) Accel() (string, string) { return r.accel, r.why }

// AgentChannel is the agent channel of the VMs this backend boots
// ("serial" or "vsock"), and why.
func (r *Runtime) AgentChannel() (string, string) { return r.channel, r.channelWhy }

// Info implements runtime.Runtime.
func (r *Runtime) Info() runtime.Info {
	out, _ := exec.Command(r.cfg.QEMUPath, "--version").Output()
	v, _, _ := strings.Cut(string(out), "\n")
	return runtime.Info{Name: Name, Version: strings.TrimPrefix(v, "QEMU emulator version "), Capabilities: runtime.CapabilitiesOf(r, true)}
}

// NetworkMode says the node must give this backend's sandboxes a tap.
func (r *Runtime) NetworkMode() runtime.NetworkMode { return runtime.NetworkTap }

// ValidateOptions implements runtime.Runtime: the vm backend has none.
func (r *Runtime) ValidateOptions(opts map[string]string) error {
	for k := range opts {
		return errdefs.Invalid("backend_options."+k, "is unknown: the vm backend takes no options")
	}
	return nil
}

func (r *Runtime) get(id string) (*sandbox, error) { return r.sbs.Get(id) }

// validate checks spec against the host and the assets; it makes nothing.
// What every backend checks comes first (runtime.ValidateSpec: at least
// one layer, memory and cpu given, the network mode); then what a VM needs.
func (r *Runtime) validate(spec runtime.Spec) (vcpus int, memMB int64, err error) {
	if err := runtime.ValidateSpec(spec, runtime.SpecRules{
		Backend:     Name,
		MinMemoryMB: minMemoryMB,
		MemoryWhy:   "a VM's kernel, init and agent need it",
		MinCPU:      0.01,
		Networks:    []runtime.NetworkMode{runtime.NetworkTap},
		NetworkHint: "the vm backend needs a tap (or no network)",
		LayerDisks:  true,
	}); err != nil {
		return 0, 0, err
	}
	memMB = spec.Resources.MemoryMB
	vcpus = int(spec.Resources.CPU + 0.999)
	if n := goruntime.NumCPU(); vcpus > n {
		return 0, 0, errdefs.Invalid("resources.cpu", "%g (%d vCPUs): this host has %d CPUs; ask for at most %d", spec.Resources.CPU, vcpus, n, n)
	}
	for i, l := range spec.Rootfs.Layers {
		if l.Format != runtime.LayerEROFS {
			return 0, 0, errdefs.Invalid(fmt.Sprintf("rootfs.layers[%d]", i), "format %q (%s): the vm backend needs EROFS layers (it attaches them as disks)", l.Format, l.Digest)
		}
	}
	for _, p := range []string{r.cfg.kernelPath(), r.cfg.initrdPath()} {
		if _, err := os.Stat(p); err != nil {
			return 0, 0, fmt.Errorf("guest asset %s: %w: run `make guest-assets` or set node.backends.vm.assets_dir: %w", p, errdefs.ErrFailedPrecondition, err)
		}
	}
	return vcpus, memMB, nil
}

// minMemoryMB is the least guest RAM a sandbox may ask for.
const minMemoryMB = 64

func (r *Runtime) cgroupPath(id string) string {
	node := r.cfg.NodeID
	if node == "" {
		node = "default"
	}
	return "opendsec-vm-" + node + "/" + id
}

// Create implements runtime.Runtime: it validates, makes the writable disk,
// the configuration disk and the cgroup, and builds QEMU's command line.
// Nothing runs yet.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (runtime.Handle, error) {
	return r.create(ctx, spec, nil)
}

// memPath is sandbox id's RAM file.
func (r *Runtime) memPath(id string) string {
	node := r.cfg.NodeID
	if node == "" {
		node = "default"
	}
	return filepath.Join(r.cfg.MemoryDir, node+"-"+id+".mem")
}

// create is Create, or with from the preparation of a restore from a snapshot.
func (r *Runtime) create(ctx context.Context, spec runtime.Spec, from *restoreFrom) (h runtime.Handle, err error) {
	vcpus, memMB, err := r.validate(spec)
	if err != nil {
		return runtime.Handle{}, err
	}
	if from != nil {
		if err := from.check(r, spec, vcpus, memMB); err != nil {
			return runtime.Handle{}, err
		}
		vcpus, memMB = from.m.VCPUs, from.m.MemoryMB
	}
	sb := &sandbox{id: spec.ID, spec: spec, exit: runtime.NewExitLatch(), startedC: make(chan struct{})}
	if !r.sbs.Add(spec.ID, sb) {
		return runtime.Handle{}, fmt.Errorf("vm sandbox %q: %w", spec.ID, errdefs.ErrAlreadyExists)
	}
	cg := r.cgroupPath(spec.ID)
	mem := r.memPath(spec.ID)
	defer func() {
		if err != nil {
			if sb.st.AgentCID != 0 {
				r.cids.release(spec.ID, sb.st.AgentCID)
			}
			removeCgroup(cg)
			for _, f := range ownedFiles {
				_ = os.Remove(filepath.Join(spec.StateDir, f))
			}
			_ = os.Remove(mem)
			r.sbs.Remove(spec.ID)
		}
	}()
	if err := os.MkdirAll(spec.StateDir, 0o700); err != nil {
		return runtime.Handle{}, fmt.Errorf("vm state dir: %w: %w", errdefs.ErrInternal, err)
	}
	// The directory is this sandbox's from now on: Recover and Delete
	// tell it from another sandbox's by this file.
	if err := writeRunState(spec.StateDir, runState{ID: spec.ID}); err != nil {
		return runtime.Handle{}, err
	}
	if err := os.MkdirAll(r.cfg.MemoryDir, 0o700); err != nil {
		return runtime.Handle{}, fmt.Errorf("vm memory dir node.backends.vm.memory_dir %s: %w: %w", r.cfg.MemoryDir, errdefs.ErrInternal, err)
	}
	hostname := spec.Guest.Hostname
	if hostname == "" {
		hostname = spec.ID
	}
	sb.st = handleState{StateDir: spec.StateDir, Cgroup: cg, Accel: r.accel, MemoryMB: memMB, VCPUs: vcpus, MemPath: mem, Hostname: hostname, NetNS: spec.Network.NetNS,
		CPUClass: string(spec.CPUClass)}
	if spec.Network.Mode == runtime.NetworkTap {
		sb.st.MAC, sb.st.Addr, sb.st.Gateway = spec.Network.MAC.String(), spec.Network.GuestAddr.String(), spec.Network.Gateway.String()
	}
	disk := filepath.Join(spec.StateDir, "rw.ext4")
	if from == nil {
		diskMB := spec.Resources.DiskMB
		if diskMB == 0 {
			diskMB = DefaultDiskMB
		}
		if err := vmm.MakeDisk(ctx, disk, diskMB); err != nil {
			return runtime.Handle{}, fmt.Errorf("vm %w", err)
		}
		if err := vmm.WriteConfigDisk(filepath.Join(spec.StateDir, "config.img"), spec.Guest); err != nil {
			return runtime.Handle{}, err
		}
		sb.st.MemShared = true
		sb.st.Balloon = r.freePageReporting()
		o := argOpts{balloon: sb.st.Balloon}
		if r.channel == ChannelVsock {
			sb.st.AgentCID = r.cids.alloc(spec.ID)
			o.cid = sb.st.AgentCID
		}
		if r.cfg.LayerDevice == LayerPmem && r.assetFeature(featurePmemLayers) {
			if o.pmem, err = r.pmemLayers(spec.Rootfs.Layers); err != nil {
				return runtime.Handle{}, err
			}
		}
		sb.st.Args = r.args(spec, vcpus, memMB, disk, mem, o)
	} else {
		if spec.Network.Mode == runtime.NetworkTap {
			// Every fork or restore has its own MAC; the attachment's
			// address stays (the network is the same in every namespace).
			sb.st.MAC = cloneMAC(spec.ID, spec.Network.MAC).String()
		}
		if argsVsock(from.m.Args) {
			// The snapshot's guest serves its agent on vsock: the clone
			// needs vhost-vsock and a CID of its own.
			if !r.vsockOK {
				return runtime.Handle{}, fmt.Errorf("vm restore: %w: the snapshot's VM reached its agent over vsock, and %s", errdefs.ErrFailedPrecondition, r.vsockWhy)
			}
			sb.st.AgentCID = r.cids.alloc(spec.ID)
		}
		if sb.st.Args, err = from.prepare(ctx, spec, mem, sb.st.MAC); err != nil {
			return runtime.Handle{}, err
		}
		if sb.st.AgentCID != 0 {
			sb.st.Args = setArgsCID(sb.st.Args, sb.st.AgentCID)
		}
		// The saved guest may have its balloon driver bound (a reclaimed
		// VM's state): a snapshot of this one must unbind it.
		sb.st.Balloon = argsBalloon(sb.st.Args)
		sb.st.Incoming = filepath.Join(spec.StateDir, "state")
		sb.st.IncomingStreamRAM = !from.m.IgnoreShared
		sb.st.MemShared = !from.m.IgnoreShared // its own RAM file (prepare)
	}
	if err := makeCgroup(cg, vcpus, memMB+MemoryOverheadMB, spec.CPUClass == runtime.CPUBestEffort); err != nil {
		return runtime.Handle{}, err
	}
	return r.handle(sb), nil
}

// ownedFiles are what the backend makes in StateDir.
var ownedFiles = []string{"rw.ext4", "config.img", "state", "qmp.sock", "agent.sock", "console.log", "qemu.log", "qemu.pid", runFile, runFile + ".tmp"}

func (r *Runtime) handle(sb *sandbox) runtime.Handle {
	b, _ := json.Marshal(sb.st)
	return runtime.Handle{ID: sb.id, Version: 1, State: b}
}

// The fds QEMU finds its listening sockets at (os/exec's ExtraFiles start at 3).
const (
	qmpFD   = 3
	agentFD = 4
)

// listenFDs binds StateDir's qmp.sock and agent.sock (stale ones from an
// earlier run go) through /proc/self/fd of the directory, so their length
// never matters, and returns them for ExtraFiles in qmpFD, agentFD order.
func listenFDs(sd string) ([]*os.File, error) {
	dir, err := os.Open(sd)
	if err != nil {
		return nil, fmt.Errorf("%w: sockets: %w", errdefs.ErrInternal, err)
	}
	defer func() { _ = dir.Close() }()
	var out []*os.File
	for _, name := range []string{"qmp.sock", "agent.sock"} {
		f, err := unixsock.ListenAt(int(dir.Fd()), name, 64)
		if err != nil {
			for _, o := range out {
				_ = o.Close()
			}
			return nil, fmt.Errorf("%w: socket %s: %w", errdefs.ErrInternal, filepath.Join(sd, name), err)
		}
		out = append(out, f)
	}
	return out, nil
}

// argOpts are the command line's optional devices.
type argOpts struct {
	balloon bool // virtio-balloon with free page reporting
	// cid: the agent channel is a vhost-vsock device with this guest CID
	// (0: the virtio-serial port).
	cid uint32
	// pmem are the layers' padded copies (pmemLayer) for virtio-pmem, in
	// layer order; nil: layers are virtio-blk disks.
	pmem []pmemLayer
}

// featurePmemLayers is the assets' manifest feature of a guest init that
// mounts layers from virtio-pmem devices (opendsec.layerdev=pmem).
const featurePmemLayers = "pmem-layers"

// pmemLayer is a layer file as a virtio-pmem device's backing: its size is
// a multiple of pmemAlign.
type pmemLayer struct {
	path string
	size int64
}

// pmemAlign: the guest maps device memory in 2 MiB sections.
const pmemAlign = 2 << 20

// pmemLayers returns the layers' padded copies, making those that do not
// exist yet (one per digest, shared by every VM of the node).
func (r *Runtime) pmemLayers(layers []runtime.Layer) ([]pmemLayer, error) {
	if r.cfg.NodeStateDir == "" {
		// Never a shared temp dir: a local user could make the files QEMU maps.
		return nil, fmt.Errorf("vm layer_device pmem: %w: the backend has no node state dir for the layers' device files; run it in a node (its state dir) or set layer_device to blk", errdefs.ErrFailedPrecondition)
	}
	dir := filepath.Join(r.cfg.NodeStateDir, "vm-pmem")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("vm pmem layer dir: %w: %w", errdefs.ErrInternal, err)
	}
	var out []pmemLayer
	for i, l := range layers {
		fi, err := os.Stat(l.Path)
		if err != nil {
			return nil, fmt.Errorf("rootfs.layers[%d] %s: %w: %w", i, l.Path, errdefs.ErrFailedPrecondition, err)
		}
		size := (fi.Size() + pmemAlign - 1) / pmemAlign * pmemAlign
		id := l.Digest
		if id == "" {
			// Named by content: two layers of one basename never share a file.
			sum, err := vmm.SumFile(l.Path, true)
			if err != nil {
				return nil, fmt.Errorf("rootfs.layers[%d] %s: %w: %w", i, l.Path, errdefs.ErrFailedPrecondition, err)
			}
			id = "sha256:" + sum.SHA256
		}
		name := strings.NewReplacer(":", "-", "/", "-").Replace(id) + ".img"
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err != nil || st.Size() != size {
			if err := padCopy(l.Path, p, size); err != nil {
				return nil, fmt.Errorf("vm pmem layer %s: %w: %w", l.Digest, errdefs.ErrInternal, err)
			}
		}
		out = append(out, pmemLayer{path: p, size: size})
	}
	return out, nil
}

// padCopy copies src to dst (through a temp file and a rename, so a
// concurrent reader never sees half of it) and extends it to size.
func padCopy(src, dst string, size int64) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer func() { _ = in.Close() }()
	tmp, err := os.CreateTemp(filepath.Dir(dst), filepath.Base(dst)+".tmp*")
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	if _, err := io.Copy(tmp, in); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Truncate(size); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}

// assetFeature reports whether the guest assets' manifest.json lists feature.
func (r *Runtime) assetFeature(feature string) bool {
	b, err := os.ReadFile(filepath.Join(r.cfg.AssetsDir, "manifest.json"))
	if err != nil {
		return false
	}
	var m struct {
		Features []string `json:"features"`
	}
	return json.Unmarshal(b, &m) == nil && slices.Contains(m.Features, feature)
}

// freePageReporting says whether a new VM gets the balloon device.
func (r *Runtime) freePageReporting() bool {
	on, _ := r.freePageReportingWhy()
	return on
}

// freePageReportingWhy says whether a new VM gets the balloon device, and
// why: only when configured on, and only with guest assets whose init can
// unbind its driver before a snapshot. It is off by default: a restore
// maps the snapshot's RAM file private, and QEMU (7.2, and every release
// since: ram_block_discard_range only warns about private file mappings
// since 8.1) discards a page such a guest reports free by punching it out
// of the file itself, so root in one restored guest could rebind the
// driver and corrupt the memory of the snapshot and of every sibling fork.
func (r *Runtime) freePageReportingWhy() (bool, string) {
	if r.cfg.FreePageReporting == nil {
		return false, "off by default: QEMU punches a page a restored guest reports free out of the snapshot's shared RAM file, so root in one fork could corrupt its siblings; set free_page_reporting: true only where every fork's guest is trusted"
	}
	if !*r.cfg.FreePageReporting {
		return false, "off (free_page_reporting: false)"
	}
	if !r.assetFeature(featureBalloonControl) {
		return false, "configured on, but the guest assets do not list " + featureBalloonControl + ": rebuild them (make guest-assets)"
	}
	return true, "on (free_page_reporting: true): unsafe with forks of untrusted guests, root in one restored guest could rebind its balloon driver and corrupt the snapshot's RAM file its sibling forks share"
}

// argsBalloon says whether QEMU arguments give the VM a virtio-balloon
// (its guest may have the driver bound, whatever the node's setting).
func argsBalloon(args []string) bool {
	for i, a := range args {
		if a == "-device" && i+1 < len(args) && strings.HasPrefix(args[i+1], "virtio-balloon") {
			return true
		}
	}
	return false
}

// featureBalloonControl is the assets' manifest feature of a guest init
// that serves vmchan.BalloonPath.
const featureBalloonControl = "balloon-control"

// args is QEMU's command line (after the binary).
func (r *Runtime) args(spec runtime.Spec, vcpus int, memMB int64, disk, mem string, o argOpts) []string {
	sd := spec.StateDir
	dev := func(kind string) string {
		if r.cfg.Machine == "q35" {
			return kind + "-pci"
		}
		return kind + "-device"
	}
	machine := "microvm,pic=on,memory-backend=ram0"
	if r.cfg.Machine == "q35" {
		machine = "q35,memory-backend=ram0"
	}
	accel := r.accel
	if accel == "tcg" {
		accel = "tcg,tb-size=32"
	}
	hostname := spec.Guest.Hostname
	if hostname == "" {
		hostname = spec.ID
	}
	blkLayers := len(spec.Rootfs.Layers) // layers before the rw disk
	if o.pmem != nil {
		blkLayers = 0
	}
	cmdline := []string{"console=ttyS0", "quiet", "tsc_early_khz=2000000", "cryptomgr.notests", "mitigations=off",
		"tsc=reliable", "no_timer_check", "i8042.noaux", "i8042.nokbd", "i8042.nopnp", "i8042.nomux", "8250.nr_uarts=1",
		"nowatchdog", "audit=0", "panic=-1", "rcupdate.rcu_expedited=1",
		"opendsec.layers=" + strconv.Itoa(len(spec.Rootfs.Layers)), "opendsec.rw=vd" + string(rune('a'+blkLayers)),
		"opendsec.config=vd" + string(rune('a'+blkLayers+1)),
		"opendsec.hostname=" + hostname}
	if o.pmem != nil {
		// The pmem devices sit above 4 GiB, which makes the kernel set
		// aside 64 MiB of bounce buffers (swiotlb) that virtio does not
		// use here: measured 66 MiB more guest RAM touched per VM.
		cmdline = append(cmdline, "opendsec.layerdev=pmem", "swiotlb=noforce")
	}
	if o.cid != 0 {
		cmdline = append(cmdline, "opendsec.agent=vsock")
	}
	memArg := strconv.FormatInt(memMB, 10) + "M"
	if o.pmem != nil {
		extra := int64(0)
		for _, p := range o.pmem {
			extra += p.size
		}
		memArg += ",slots=" + strconv.Itoa(len(o.pmem)) + ",maxmem=" + strconv.FormatInt(memMB+extra>>20, 10) + "M"
	}
	if spec.Network.Mode == runtime.NetworkTap {
		cmdline = append(cmdline, "opendsec.ip="+spec.Network.GuestAddr.String(), "opendsec.gw="+spec.Network.Gateway.String(),
			"opendsec.mac="+spec.Network.MAC.String())
	}
	a := []string{"-name", "opendsec-" + spec.ID, "-M", machine, "-accel", accel, "-cpu", "max",
		"-smp", strconv.Itoa(vcpus), "-m", memArg,
		// Guest RAM is a shared mapping of a file in the memory dir: a
		// snapshot (x-ignore-shared) copies the file instead of streaming it.
		"-object", "memory-backend-file,id=ram0,size=" + strconv.FormatInt(memMB, 10) + "M,mem-path=" + mem + ",share=on",
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", r.cfg.kernelPath(), "-initrd", r.cfg.initrdPath(), "-append", strings.Join(cmdline, " "),
		"-chardev", "file,id=ser0,path=" + filepath.Join(sd, "console.log"), "-serial", "chardev:ser0",
		// QMP and the agent's chardev listen on sockets Start binds in
		// StateDir and passes as fds 3 and 4 (listenFDs): a long StateDir
		// does not fit sun_path, and connections wait in their backlog
		// until QEMU serves them.
		"-chardev", "socket,id=qmp,fd=" + strconv.Itoa(qmpFD) + ",server=on,wait=off", "-mon", "chardev=qmp,mode=control",
		"-pidfile", filepath.Join(sd, "qemu.pid"),
	}
	if r.cfg.Machine == "microvm" {
		a = append(a, "-global", "virtio-mmio.force-legacy=false")
	}
	for i, l := range spec.Rootfs.Layers {
		id := "layer" + strconv.Itoa(i)
		if o.pmem != nil {
			// Shared and read-only: the guest's DAX mount reads the host's
			// page cache of the file, one copy for every VM.
			pm := o.pmem[i]
			pmemDev := "virtio-pmem-pci"
			if r.cfg.Machine == "microvm" {
				pmemDev = "virtio-pmem"
			}
			a = append(a, "-object", "memory-backend-file,id="+id+",mem-path="+pm.path+",size="+strconv.FormatInt(pm.size, 10)+",share=on,readonly=on",
				"-device", pmemDev+",memdev="+id+",id=p"+id)
			continue
		}
		a = append(a, "-drive", "file="+l.Path+",format=raw,if=none,readonly=on,id="+id, "-device", dev("virtio-blk")+",drive="+id)
	}
	a = append(a, "-drive", "file="+disk+",format=raw,if=none,cache=unsafe,id=rw", "-device", dev("virtio-blk")+",drive=rw",
		"-drive", "file="+filepath.Join(sd, "config.img")+",format=raw,if=none,readonly=on,id=config", "-device", dev("virtio-blk")+",drive=config")
	if o.cid != 0 {
		a = append(a, "-device", vsockDevice(r.cfg.Machine, o.cid))
	} else {
		a = append(a, "-device", dev("virtio-serial"),
			"-chardev", "socket,id=agent,fd="+strconv.Itoa(agentFD)+",server=on,wait=off",
			"-device", "virtserialport,chardev=agent,name=agent")
	}
	if o.balloon {
		// Free pages the guest reports are discarded (a hole punched in
		// the RAM file); deflate-on-oom lets a guest under memory pressure
		// take back pages a balloon holds.
		a = append(a, "-device", dev("virtio-balloon")+",free-page-reporting=on,deflate-on-oom=on")
	}
	if spec.Network.Mode == runtime.NetworkTap {
		a = append(a, "-netdev", "tap,id=net0,ifname="+spec.Network.Device+",script=no,downscript=no",
			"-device", dev("virtio-net")+",netdev=net0,mac="+spec.Network.MAC.String())
	}
	return a
}

// Start implements runtime.Runtime: QEMU runs in the sandbox's netns and
// cgroup; Start returns once QMP says the VM runs and the guest's agent
// answers GET /health through AgentConn (within ctx and the boot timeout).
func (r *Runtime) Start(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.startMu.Lock()
	defer sb.startMu.Unlock()
	sb.mu.Lock()
	started := sb.started
	sb.mu.Unlock()
	select {
	case <-sb.exit.Done():
		return fmt.Errorf("vm sandbox %q: %w: it was stopped; a stopped VM does not start again (create a new sandbox)", id, errdefs.ErrFailedPrecondition)
	default:
	}
	if started {
		return nil
	}
	args := sb.st.Args
	if sb.st.Incoming != "" {
		args = append(slices.Clip(args), "-incoming", "defer")
	}
	pid, q, err := r.launch(ctx, sb, args)
	if err != nil {
		return err
	}
	fail := func(err error) error {
		_ = vmm.Kill(pid)
		<-sb.exit.Done()
		return err
	}
	if sb.st.Incoming != "" {
		if err := r.incoming(ctx, sb, q, sb.st.Incoming, sb.st.IncomingStreamRAM); err != nil {
			return fail(err)
		}
	}
	if st, err := q.Status(ctx); err != nil {
		return fail(err)
	} else if st != "running" {
		return fail(fmt.Errorf("vm %s: %w: qemu is %q after start, not running", id, errdefs.ErrInternal, st))
	}
	if r.cfg.noAgentWait {
		return nil
	}
	if err := r.waitAgent(ctx, sb); err != nil {
		return fail(err)
	}
	if sb.st.Incoming != "" {
		if err := r.setIdentity(ctx, sb); err != nil {
			return fail(err)
		}
		if err := r.setNeighbour(sb); err != nil {
			return fail(err)
		}
	}
	return nil
}

// setNeighbour points the sandbox namespace's neighbour entry for the
// guest at the guest's MAC (a restore's own, cloneMAC).
func (r *Runtime) setNeighbour(sb *sandbox) error {
	ns := cmp.Or(sb.spec.Network.NetNS, sb.st.NetNS)
	if ns == "" || sb.st.MAC == "" || sb.st.Addr == "" {
		return nil
	}
	mac, err := net.ParseMAC(sb.st.MAC)
	if err != nil {
		return fmt.Errorf("vm %s mac %q: %w: %w", sb.id, sb.st.MAC, errdefs.ErrInternal, err)
	}
	pfx, err := netip.ParsePrefix(sb.st.Addr)
	if err != nil {
		return fmt.Errorf("vm %s guest address %q: %w: %w", sb.id, sb.st.Addr, errdefs.ErrInternal, err)
	}
	dev := sb.spec.Network.Device
	if dev == "" {
		dev = "tap0"
	}
	return setGuestNeighbour(ns, dev, pfx.Addr().AsSlice(), mac)
}

// launch runs QEMU with args in the sandbox's netns and cgroup, records
// it in the run file and connects to its QMP socket. On error the QEMU it
// started is killed (its end is the sandbox's unless sb.parking).
func (r *Runtime) launch(ctx context.Context, sb *sandbox, args []string) (int, *qmpClient, error) {
	id := sb.id
	name := r.cfg.QEMUPath
	ns := sb.spec.Network.NetNS
	if ns == "" {
		ns = sb.st.NetNS // a sandbox found by Recover
	}
	if ns != "" {
		args = append([]string{"--net=" + ns, "--", name}, args...)
		name = "nsenter"
	}
	logf, err := os.OpenFile(filepath.Join(sb.st.StateDir, "qemu.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, nil, fmt.Errorf("vm qemu log: %w: %w", errdefs.ErrInternal, err)
	}
	defer func() { _ = logf.Close() }()
	socks, err := listenFDs(sb.st.StateDir)
	if err != nil {
		return 0, nil, fmt.Errorf("vm %s: %w", id, err)
	}
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = socks
	// QEMU is not the node's: its own session, so a node restart leaves it running.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	// Under SCHED_IDLE (best effort) and with its own core-scheduling
	// cookie from exec on: every QEMU thread (vCPUs included) inherits
	// them, so its vCPUs never share an SMT core with another VM's.
	err = sched.Start(cmd, sched.StartOptions{Idle: runtime.CPUClass(sb.st.CPUClass) == runtime.CPUBestEffort, Cookie: sched.Core().Enabled})
	// QEMU has its copies; one kept here would hold connections in the
	// backlog after QEMU is gone.
	for _, f := range socks {
		_ = f.Close()
	}
	if err != nil {
		return 0, nil, fmt.Errorf("vm qemu start: %w: %w", errdefs.ErrInternal, err)
	}
	pid := cmd.Process.Pid
	stime := vmm.StartTime(pid) // not reaped before cmd.Wait: the pid is QEMU's
	exited := make(chan struct{})
	sb.mu.Lock()
	sb.st.Pid, sb.st.StartTime = pid, stime
	sb.exited = exited
	first := !sb.started
	sb.started = true
	sb.mu.Unlock()
	if first {
		close(sb.startedC)
	}
	go func() {
		err := cmd.Wait() // QEMU is reaped before Wait reports, so its cgroup can go
		code := -1
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err == nil {
			code = 0
		}
		r.qemuEnded(sb, exited, code)
	}()
	fail := func(err error) (int, *qmpClient, error) {
		_ = vmm.Kill(pid)
		<-exited
		return 0, nil, err
	}
	// Recorded before anything else: a node killed from here on finds
	// this QEMU again through the StateDir (Recover), whatever Handle it
	// kept. Args go in when they are not the Handle's (after a reclaim).
	rs := runState{ID: id, Pid: pid, StartTime: stime, Reclaimed: sb.reclaimed}
	if sb.argsChanged {
		rs.Args = sb.st.Args
	}
	if err := writeRunState(sb.st.StateDir, rs); err != nil {
		return fail(err)
	}
	if err := joinCgroup(sb.st.Cgroup, pid); err != nil {
		return fail(err)
	}
	go r.watchLogs(sb, exited)
	q, err := r.connectQMP(ctx, sb)
	if err != nil {
		return fail(err)
	}
	sb.mu.Lock()
	sb.qmp = q
	sb.mu.Unlock()
	return pid, q, nil
}

// qemuEnded is the end of one QEMU process of sb: the sandbox's end unless
// Reclaim made it exit (and no Stop came meanwhile).
func (r *Runtime) qemuEnded(sb *sandbox, exited chan struct{}, code int) {
	sb.mu.Lock()
	planned := sb.parking && !sb.stopping
	sb.mu.Unlock()
	close(exited)
	if !planned {
		r.ended(sb, "", code)
	}
}

// incoming loads the snapshot's state into the just started QEMU (it
// waits in -incoming defer), and runs the guest on.
func (r *Runtime) incoming(ctx context.Context, sb *sandbox, q *qmpClient, path string, streamRAM bool) error {
	sb.mu.Lock()
	exited := sb.exited
	sb.mu.Unlock()
	if _, err := q.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": !streamRAM}}}); err != nil {
		return fmt.Errorf("vm %s restore: %w", sb.id, err)
	}
	if _, err := q.Execute(ctx, "migrate-incoming", map[string]any{"uri": "exec:cat " + shellQuote(path)}); err != nil {
		return fmt.Errorf("vm %s restore: %w", sb.id, err)
	}
	for wait := time.Millisecond; ; wait = min(2*wait, 20*time.Millisecond) {
		st, err := q.Status(ctx)
		if err != nil {
			select {
			case <-exited:
				return fmt.Errorf("vm %s restore from the snapshot: %w", sb.id, r.exitError(sb))
			default:
			}
			return fmt.Errorf("vm %s restore: %w", sb.id, err)
		}
		if st != "inmigrate" {
			break
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-exited:
			t.Stop()
			return fmt.Errorf("vm %s restore from the snapshot: %w", sb.id, r.exitError(sb))
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("vm %s restore: %w: %w", sb.id, errdefs.ErrDeadlineExceeded, ctx.Err())
		}
	}
	if _, err := q.Execute(ctx, "cont", nil); err != nil {
		return fmt.Errorf("vm %s restore: %w", sb.id, err)
	}
	return nil
}

// setIdentity gives a restored guest its own identity (vmchan.Identity):
// its hostname, its network attachment, fresh entropy for its RNG and the
// host's clock.
func (r *Runtime) setIdentity(ctx context.Context, sb *sandbox) error {
	id, err := vmm.NewIdentity(sb.st.Hostname, sb.st.MAC, sb.st.Addr, sb.st.Gateway)
	if err != nil {
		return fmt.Errorf("vm %s: %w", sb.id, err)
	}
	return r.postGuest(ctx, sb, "identity", vmchan.IdentityPath, id)
}

// setBalloon binds (on) or unbinds the guest's balloon driver through the
// guest init's vmchan.BalloonPath; the guest must be running.
func (r *Runtime) setBalloon(ctx context.Context, sb *sandbox, on bool) error {
	ctx, cancel := context.WithTimeout(ctx, balloonCallTimeout)
	defer cancel()
	return r.postGuest(ctx, sb, "balloon", vmchan.BalloonPath, vmchan.Balloon{FreePageReporting: on})
}

// postGuest sends v to the guest init's route path (what names it in
// errors); guest assets older than the backend lack the newer routes.
func (r *Runtime) postGuest(ctx context.Context, sb *sandbox, what, path string, v any) error {
	if err := vmm.PostGuest(ctx, r.agentHTTP(sb.id), path, v); err != nil {
		if errors.Is(err, errdefs.ErrInternal) {
			return fmt.Errorf("vm %s %s: %w (guest assets older than this backend?)", sb.id, what, err)
		}
		return fmt.Errorf("vm %s %s: %w", sb.id, what, err)
	}
	return nil
}

// balloonCallTimeout bounds one balloon call: the guest answers it in
// milliseconds, and a guest that does not fails the snapshot rather than
// hanging it.
const balloonCallTimeout = 15 * time.Second

// shellQuote quotes s for sh (QEMU runs exec: migration URIs with sh -c).
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'"'"'`) + "'" }

// waitAgent does GET /health through the agent channel until the agent
// answers 204, QEMU exits, ctx ends or the boot timeout passes; the error
// of a timeout carries the end of the console log.
func (r *Runtime) waitAgent(ctx context.Context, sb *sandbox) error {
	return r.waitAgentFor(ctx, sb, r.cfg.bootTimeout(), 0)
}

// waitAgentFor is waitAgent within timeout. With attempt > 0 each GET
// /health gets that long, and one that fails drops the channel's session
// so the next dials a new one: the guest then sees its host end go away
// and serves a fresh session (after a node restart or a resume, its old
// one may swallow requests).
func (r *Runtime) waitAgentFor(ctx context.Context, sb *sandbox, timeout, attempt time.Duration) error {
	var failed func()
	if attempt > 0 {
		failed = sb.closeAgent
	}
	last := vmm.WaitHealth(ctx, r.agentHTTP(sb.id), timeout, sb.exit.Done(), attempt, failed)
	if last == nil {
		return nil
	}
	if sb.exit.Ended() {
		return r.exitError(sb)
	}
	console, _ := os.ReadFile(filepath.Join(sb.st.StateDir, "console.log"))
	return fmt.Errorf("vm %s: %w: the guest agent did not answer within %s (last: %w); console: %s",
		sb.id, errdefs.ErrDeadlineExceeded, timeout, last, vmm.LastLines(console, 15))
}

// agentHTTP is an HTTP client whose connections are AgentConns of id.
func (r *Runtime) agentHTTP(id string) *http.Client {
	return vmm.AgentHTTP(func(ctx context.Context) (net.Conn, error) { return r.AgentConn(ctx, id) })
}

// connectQMP dials the QMP socket as soon as QEMU made it, until ctx ends or QEMU exits.
func (r *Runtime) connectQMP(ctx context.Context, sb *sandbox) (*qmpClient, error) {
	path := filepath.Join(sb.st.StateDir, "qmp.sock")
	backoff := time.Millisecond
	for {
		q, err := dialQMP(ctx, path)
		if err == nil {
			return q, nil
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("vm %s qmp: %w: %w", sb.id, errdefs.ErrDeadlineExceeded, ctx.Err())
		case <-sb.exit.Done():
			t.Stop()
			return nil, r.exitError(sb)
		case <-t.C:
		}
		backoff = min(backoff*2, 50*time.Millisecond)
	}
}

// exitError says why QEMU ended before it was ready.
func (r *Runtime) exitError(sb *sandbox) error {
	sb.mu.Lock()
	fatal := sb.fatal
	sb.mu.Unlock()
	if fatal == nil {
		fatal = r.scanLogs(sb)
	}
	if fatal != nil {
		return fatal
	}
	log, _ := os.ReadFile(filepath.Join(sb.st.StateDir, "qemu.log"))
	return fmt.Errorf("vm %s: %w: qemu exited: %s", sb.id, errdefs.ErrInternal, vmm.LastLines(log, 5))
}

// accelFatal are the messages of a guest the accelerator cannot run.
var accelFatal = []string{"KVM internal error", "emulation failure"}

// scanLogs returns the accelerator-mismatch error if qemu.log or
// console.log says so.
func (r *Runtime) scanLogs(sb *sandbox) error {
	for _, f := range []string{"qemu.log", "console.log"} {
		b, _ := os.ReadFile(filepath.Join(sb.st.StateDir, f))
		for _, m := range accelFatal {
			if bytes.Contains(b, []byte(m)) {
				return fmt.Errorf("vm %s: %w: accelerator mismatch: %q in %s: the guest cannot run under -accel %s (%s); set node.backends.vm.accel to \"tcg\" or give a kernel for this accelerator",
					sb.id, errdefs.ErrFailedPrecondition, m, f, sb.st.Accel, r.why)
			}
		}
	}
	return nil
}

// watchLogs looks at the logs while QEMU runs; an accelerator mismatch
// kills it, so a guest stuck in the emulator never hangs its caller.
func (r *Runtime) watchLogs(sb *sandbox, exited chan struct{}) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-exited:
			return
		case <-t.C:
		}
		if err := r.scanLogs(sb); err != nil {
			sb.mu.Lock()
			sb.fatal = err
			sb.mu.Unlock()
			slog.Error("vm killed", "id", sb.id, "err", err)
			sb.mu.Lock()
			pid := sb.st.Pid
			sb.mu.Unlock()
			_ = vmm.Kill(pid)
			return
		}
	}
}

// watch waits for QEMU's end through a pidfd (also for a QEMU found by Recover).
func (r *Runtime) watch(sb *sandbox) {
	pid := sb.st.Pid
	exited := make(chan struct{})
	sb.mu.Lock()
	sb.exited = exited
	sb.mu.Unlock()
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		close(exited)
		r.ended(sb, "qemu was gone when the node looked", -1)
		return
	}
	go func() {
		defer func() { _ = unix.Close(fd) }()
		vmm.WaitExit(fd)
		r.qemuEnded(sb, exited, -1)
	}()
}

// ended records QEMU's end (the first one recorded stays): why, or the
// reason the sandbox's state says.
func (r *Runtime) ended(sb *sandbox, why string, code int) {
	if why == "" {
		sb.mu.Lock()
		switch {
		case sb.fatal != nil:
			why = "accelerator mismatch"
		case sb.stopping:
			why = "stopped"
		default:
			why = "qemu exited"
		}
		sb.mu.Unlock()
	}
	sb.exit.Finish(runtime.ExitStatus{ExitCode: code, At: time.Now(), Reason: why})
}

// Wait implements runtime.Runtime (runtime.ExitLatch: Delete stops a
// started VM first, so a deleted sandbox without an end never ran).
func (r *Runtime) Wait(ctx context.Context, id string) (runtime.ExitStatus, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.ExitStatus{}, err
	}
	return sb.exit.Wait(ctx, id, nil)
}

// Stop implements runtime.Runtime: an ACPI power-down for opts.Timeout,
// then QMP quit, then SIGKILL.
func (r *Runtime) Stop(ctx context.Context, id string, opts runtime.StopOptions) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.mu.Lock()
	started, q, pid := sb.started, sb.qmp, sb.st.Pid
	sb.stopping = true
	reclaimed := sb.reclaimed
	sb.mu.Unlock()
	if reclaimed {
		// No QEMU: the sandbox ends here (Delete removes its saved
		// state). A reclaim or restore under way finishes first.
		sb.startMu.Lock()
		sb.mu.Lock()
		reclaimed = sb.reclaimed
		q, pid = sb.qmp, sb.st.Pid
		sb.mu.Unlock()
		if reclaimed {
			r.ended(sb, "stopped", -1)
			sb.startMu.Unlock()
			return nil
		}
		sb.startMu.Unlock()
	}
	if !started {
		// Not started as far as this instance knows; a QEMU a node restart
		// lost track of must not outlive its sandbox. A stopped sandbox
		// never starts: Status says stopped, Wait returns, Start refuses.
		if err := r.killStrays(ctx, id, sb.st.StateDir); err != nil {
			return err
		}
		sb.startMu.Lock() // a Start under way finishes first
		sb.mu.Lock()
		started = sb.started
		sb.mu.Unlock()
		if !started {
			r.ended(sb, "stopped before it started", -1)
			sb.startMu.Unlock()
			return nil
		}
		sb.startMu.Unlock()
		sb.mu.Lock()
		q, pid = sb.qmp, sb.st.Pid
		sb.mu.Unlock()
	}
	if q != nil && opts.Timeout > 0 {
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		_, _ = q.Execute(qctx, "system_powerdown", nil)
		cancel()
		if vmm.Within(ctx, sb.exit.Done(), opts.Timeout) {
			return nil
		}
		qctx, cancel = context.WithTimeout(ctx, time.Second)
		_, _ = q.Execute(qctx, "quit", nil)
		cancel()
		if vmm.Within(ctx, sb.exit.Done(), time.Second) {
			return nil
		}
	}
	select {
	case <-sb.exit.Done():
		return nil // already ended (pid may be 0: a Recover found it gone)
	default:
	}
	if err := vmm.Kill(pid); err != nil {
		return fmt.Errorf("vm %s kill: %w: %w", id, errdefs.ErrInternal, err)
	}
	select {
	case <-sb.exit.Done():
		return nil
	case <-ctx.Done():
		return fmt.Errorf("vm %s stop: %w: %w", id, errdefs.ErrDeadlineExceeded, ctx.Err())
	}
}

// Delete implements runtime.Runtime: process, sockets, disks, cgroup.
func (r *Runtime) Delete(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return r.deleteUnknown(ctx, id)
	}
	sb.mu.Lock()
	started := sb.started
	sb.mu.Unlock()
	if started {
		if err := r.Stop(ctx, id, runtime.StopOptions{}); err != nil {
			return err
		}
	} else if err := r.killStrays(ctx, id, sb.st.StateDir); err != nil {
		// Never started here (its waiters get not found, not an exit),
		// but a QEMU a node restart lost track of goes.
		return err
	}
	sb.mu.Lock()
	if sb.qmp != nil {
		_ = sb.qmp.Close()
	}
	sb.mu.Unlock()
	sb.closeAgent()
	removeCgroup(sb.st.Cgroup)
	if sb.st.AgentCID != 0 {
		r.cids.release(id, sb.st.AgentCID)
	}
	if sb.st.MemPath != "" {
		if err := os.Remove(sb.st.MemPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("vm %s delete memory file: %w: %w", id, errdefs.ErrInternal, err)
		}
	}
	for _, f := range ownedFiles {
		if err := os.Remove(filepath.Join(sb.st.StateDir, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("vm %s delete %s: %w: %w", id, f, errdefs.ErrInternal, err)
		}
	}
	if err := os.RemoveAll(filepath.Join(sb.st.StateDir, reclaimDir)); err != nil {
		return fmt.Errorf("vm %s delete its reclaimed state: %w: %w", id, errdefs.ErrInternal, err)
	}
	r.sbs.Remove(id)
	sb.exit.Gone()
	return nil
}

// Status implements runtime.Runtime.
func (r *Runtime) Status(ctx context.Context, id string) (runtime.Status, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Status{}, err
	}
	sb.mu.Lock()
	started, q, pid := sb.started, sb.qmp, sb.st.Pid
	sb.mu.Unlock()
	select {
	case <-sb.exit.Done():
		return runtime.Status{State: runtime.StateStopped, ExitCode: -1}, nil
	default:
	}
	if !started {
		return runtime.Status{State: runtime.StateCreated}, nil
	}
	sb.mu.Lock()
	reclaimed := sb.reclaimed
	sb.mu.Unlock()
	if reclaimed {
		return runtime.Status{State: runtime.StatePaused}, nil
	}
	if q != nil {
		if st, err := q.Status(ctx); err == nil {
			switch st {
			case "paused":
				return runtime.Status{State: runtime.StatePaused, Pid: pid}, nil
			case "prelaunch", "inmigrate":
				// A restore whose Start never finished (the node died
				// in it): the guest does not run yet.
				return runtime.Status{State: runtime.StateCreated, Pid: pid}, nil
			}
		}
	}
	return runtime.Status{State: runtime.StateRunning, Pid: pid}, nil
}

// Recover implements runtime.Runtime. The Handle the node keeps is the one
// Create returned (no pid in it): QEMU's pid and start time come from the
// run file Start wrote in the StateDir, or, for a node killed between
// QEMU's exec and that write, from /proc. A running QEMU is watched through
// a pidfd and re-attached through qmp.sock.
func (r *Runtime) Recover(ctx context.Context, h runtime.Handle) error {
	var st handleState
	if err := json.Unmarshal(h.State, &st); err != nil {
		return fmt.Errorf("vm handle %q: %w: %w", h.ID, errdefs.ErrInvalidArgument, err)
	}
	if st.StateDir == "" {
		return fmt.Errorf("vm handle %q: %w: no state dir", h.ID, errdefs.ErrInvalidArgument)
	}
	if r.sbs.Lookup(h.ID) != nil {
		return nil
	}
	rs, err := readRunState(st.StateDir)
	var found []int // QEMUs of this sandbox found by scanning /proc (nil: not scanned)
	switch {
	case err == nil && rs.ID != h.ID:
		return fmt.Errorf("vm sandbox %q: %w: its state dir %s belongs to %q", h.ID, errdefs.ErrNotFound, st.StateDir, rs.ID)
	case errors.Is(err, fs.ErrNotExist):
		// A Handle made before run files, or a state dir that is gone.
		if st.Pid == 0 && !hasDisk(st.StateDir) {
			found = r.findQEMU(h.ID, st.StateDir)
		}
		if st.Pid == 0 && !hasDisk(st.StateDir) && len(found) == 0 {
			return fmt.Errorf("vm sandbox %q: %w: nothing of it in %s", h.ID, errdefs.ErrNotFound, st.StateDir)
		}
	case err != nil:
		return fmt.Errorf("vm sandbox %q recover: %w", h.ID, err)
	}
	pid, stime := st.Pid, st.StartTime
	if rs.Pid > 0 {
		pid, stime = rs.Pid, rs.StartTime
	}
	if len(rs.Args) > 0 {
		st.Args, st.MemShared = rs.Args, true
	}
	st.Balloon = st.Balloon || argsBalloon(st.Args)
	started := pid > 0
	if !r.isOurQEMU(pid, stime, h.ID, st.StateDir) {
		pid, stime = 0, 0
		pids := found
		if pids == nil {
			pids = r.findQEMU(h.ID, st.StateDir)
		}
		if len(pids) > 0 {
			pid, stime, started = pids[0], vmm.StartTime(pids[0]), true
		}
	}
	// A reclaimed sandbox has no QEMU. One found is a restore the node
	// died in: still waiting for or loading the saved state (inmigrate,
	// prelaunch), it is killed and the sandbox stays reclaimed; past that
	// it holds the guest and is taken as the sandbox.
	if rs.Reclaimed && pid > 0 && hasReclaimState(st.StateDir) && r.midRestore(ctx, st.StateDir) {
		slog.Warn("vm recover: a restore from reclaim the node died in is killed; the sandbox stays reclaimed", "id", h.ID, "pid", pid)
		if err := vmm.KillAndWait(context.WithoutCancel(ctx), pid, 10*time.Second); err != nil {
			return fmt.Errorf("vm %s recover: kill the interrupted restore's qemu %d: %w: %w", h.ID, pid, errdefs.ErrInternal, err)
		}
		_ = os.Remove(st.MemPath)
		_ = writeRunState(st.StateDir, runState{ID: h.ID, Reclaimed: true, Args: rs.Args})
		pid, stime = 0, 0
	}
	reclaimed := rs.Reclaimed && pid == 0 && hasReclaimState(st.StateDir)
	if reclaimed {
		started = true
	}
	st.Pid, st.StartTime = pid, stime
	sb := &sandbox{id: h.ID, st: st, exit: runtime.NewExitLatch(), startedC: make(chan struct{}), started: started,
		reclaimed: reclaimed, argsChanged: len(rs.Args) > 0}
	sb.spec.StateDir = st.StateDir
	if started {
		close(sb.startedC)
	}
	if !r.sbs.Add(h.ID, sb) {
		return nil
	}
	if st.AgentCID != 0 {
		// Kept: the running QEMU (or a reclaimed VM's restore) has it.
		if err := r.cids.keep(h.ID, st.AgentCID); err != nil {
			slog.Warn("vm recover: guest cid", "id", h.ID, "err", err)
		}
	}
	if !started || reclaimed {
		return nil
	}
	if pid == 0 {
		r.ended(sb, "qemu was gone when the node looked", -1)
		return nil
	}
	r.watch(sb)
	go r.watchLogs(sb, sb.exited)
	// QMP serves one client: bound the wait for its greeting, so one stuck
	// VM does not hold up the node's start.
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	q, err := dialQMP(qctx, filepath.Join(st.StateDir, "qmp.sock"))
	if err != nil {
		select {
		case <-sb.exit.Done():
			return nil // it ended meanwhile: Wait and Status say so
		default:
		}
		return fmt.Errorf("vm %s recover: %w", h.ID, err)
	}
	sb.mu.Lock()
	sb.qmp = q
	sb.mu.Unlock()
	// The guest's end of the agent channel may still be the session of
	// the node that died: until it notices that host went away, requests
	// on a new session can break. Wait (bounded) until the agent answers
	// on a new one; a paused guest cannot, and Resume waits instead.
	if st, err := q.Status(ctx); err == nil && st == "running" && !r.cfg.noAgentWait {
		if err := r.waitAgentFor(ctx, sb, resumeAgentWait, agentAttempt); err != nil {
			slog.Warn("vm recovered; its agent does not answer yet", "id", h.ID, "err", err)
		}
	}
	return nil
}

// midRestore says whether the QEMU serving sd's qmp.sock has no guest
// running yet: it waits for or loads an incoming state.
func (r *Runtime) midRestore(ctx context.Context, sd string) bool {
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	q, err := dialQMP(qctx, filepath.Join(sd, "qmp.sock"))
	if err != nil {
		return false
	}
	defer q.Close()
	st, err := q.Status(qctx)
	return err == nil && (st == "inmigrate" || st == "prelaunch")
}

// Handle returns the sandbox's current Handle (with QEMU's pid once started).
func (r *Runtime) Handle(id string) (runtime.Handle, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Handle{}, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return r.handle(sb), nil
}

// AgentConn implements runtime.Runtime: one yamux stream (internal/vmchan)
// over the agent's virtio-serial port, whose chardev socket is in StateDir;
// or, on a VM with a vhost-vsock device, one AF_VSOCK connection to the
// guest's AgentVsockPort.
func (r *Runtime) AgentConn(ctx context.Context, id string) (net.Conn, error) {
	sb, err := r.get(id)
	if err != nil {
		return nil, err
	}
	if cid := sb.st.AgentCID; cid != 0 {
		conn, err := dialVsock(ctx, cid, AgentVsockPort)
		if err != nil {
			return nil, fmt.Errorf("vm %s agent: %w", id, err)
		}
		return conn, nil
	}
	c, err := sb.agentClient(ctx)
	if err != nil {
		return nil, fmt.Errorf("vm %s agent: %w", id, err)
	}
	conn, err := c.Open(ctx)
	if err != nil {
		return nil, fmt.Errorf("vm %s agent: %w", id, err)
	}
	return conn, nil
}

// agentClient is the sandbox's vmchan client, dialled on first use.
func (sb *sandbox) agentClient(ctx context.Context) (*vmchan.Client, error) {
	sb.agentMu.Lock()
	defer sb.agentMu.Unlock()
	if sb.agent != nil {
		return sb.agent, nil
	}
	c, err := vmchan.Dial(ctx, filepath.Join(sb.st.StateDir, "agent.sock"))
	if err != nil {
		return nil, err
	}
	sb.agent = c
	return c, nil
}

func (sb *sandbox) closeAgent() {
	sb.agentMu.Lock()
	defer sb.agentMu.Unlock()
	if sb.agent != nil {
		_ = sb.agent.Close()
		sb.agent = nil
	}
}

// Pause implements runtime.Pauser: QMP stop (memory kept). A reclaimed
// sandbox is paused already.
func (r *Runtime) Pause(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.mu.Lock()
	reclaimed := sb.reclaimed
	sb.mu.Unlock()
	if reclaimed {
		return nil
	}
	return r.qmpRun(ctx, id, "stop")
}

// Resume implements runtime.Pauser: QMP cont, then a wait (at most
// resumeAgentWait) until the agent answers again, and the guest's clock
// is stepped to the host's (it stood still while paused). A guest that
// was paused while the host end of its agent channel went away and came
// back (a node restart) first drops its old session: requests made before
// it notices would fail, so Resume waits for that here. A reclaimed
// sandbox is restored from its saved state (restoreReclaimed).
func (r *Runtime) Resume(ctx context.Context, id string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.mu.Lock()
	reclaimed := sb.reclaimed
	sb.mu.Unlock()
	if reclaimed {
		return r.restoreReclaimed(ctx, sb)
	}
	if err := r.qmpRun(ctx, id, "cont"); err != nil {
		return err
	}
	if r.cfg.noAgentWait {
		return nil
	}
	if err := r.waitAgentFor(ctx, sb, resumeAgentWait, agentAttempt); err != nil {
		slog.Warn("vm resumed; its agent does not answer yet", "id", id, "err", err)
		return nil
	}
	if err := r.setClock(ctx, sb); err != nil {
		slog.Warn("vm resumed; its clock was not stepped", "id", id, "err", err)
	}
	return nil
}

// resumeAgentWait bounds Resume's (and Recover's) wait for the agent, and
// agentAttempt one try in it.
const (
	resumeAgentWait = 10 * time.Second
	agentAttempt    = 2 * time.Second
)

func (r *Runtime) qmpRun(ctx context.Context, id, cmd string) error {
	sb, err := r.get(id)
	if err != nil {
		return err
	}
	sb.mu.Lock()
	q := sb.qmp
	sb.mu.Unlock()
	if q == nil {
		return fmt.Errorf("vm %s %s: %w: not running", id, cmd, errdefs.ErrFailedPrecondition)
	}
	_, err = q.Execute(ctx, cmd, nil)
	return err
}

// Stats implements runtime.StatsReader from the cgroup and /proc.
func (r *Runtime) Stats(ctx context.Context, id string) (runtime.Stats, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Stats{}, err
	}
	var s runtime.Stats
	// The sandbox's memory is its guest's: the resident pages of the
	// guest RAM mapping (shared with the RAM file for a booted VM, the
	// snapshot's pages and its own copies for a restored one), within the
	// limit the guest sees, its RAM size. QEMU's own heap and TCG buffer
	// are charged to its cgroup (RAM + MemoryOverheadMB), not shown here.
	// Pids counts QEMU's threads: the guest's processes are not the host's.
	sb.mu.Lock()
	pid, memPath := sb.st.Pid, sb.st.MemPath
	sb.mu.Unlock()
	s.MemoryLimitBytes = sb.st.MemoryMB << 20
	// The guest RAM in use; the cgroup's charge only when it cannot be read.
	rss, haveRSS := mappingRSS(pid, memPath)
	s.MemoryBytes = rss
	if !haveRSS {
		s.MemoryBytes = runtime.CgroupMemory(sb.st.Cgroup)
	}
	pids := filepath.Join(cgroupRoot, "pids", sb.st.Cgroup, "pids.current")
	if unified() {
		pids = filepath.Join(cgroupRoot, sb.st.Cgroup, "pids.current")
	}
	s.Pids, _ = readInt(pids)
	s.MemoryBytes = min(s.MemoryBytes, s.MemoryLimitBytes)
	if b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat"); pid > 0 && err == nil {
		if i := bytes.LastIndexByte(b, ')'); i > 0 {
			if f := strings.Fields(string(b[i+1:])); len(f) > 13 {
				u, _ := strconv.ParseUint(f[11], 10, 64)
				k, _ := strconv.ParseUint(f[12], 10, 64)
				s.CPUNanos = (u + k) * uint64(time.Second/100)
			}
		}
	}
	if fi, err := os.Stat(filepath.Join(sb.st.StateDir, "rw.ext4")); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			s.DiskUsedBytes = st.Blocks * 512
		}
		s.DiskTotalBytes = fi.Size()
	}
	return s, nil
}

// mappingRSS is the resident size of pid's mappings of the file path (or
// the file a symlink there names), from /proc/<pid>/smaps.
func mappingRSS(pid int, path string) (int64, bool) {
	if pid <= 0 || path == "" {
		return 0, false
	}
	names := []string{path}
	if t, err := filepath.EvalSymlinks(path); err == nil && t != path {
		names = append(names, t)
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps")
	if err != nil {
		return 0, false
	}
	var total int64
	found, in := false, false
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			// A mapping's header: range perms offset dev inode [path]
			in = len(f) >= 6 && slices.Contains(names, f[5])
			found = found || in
			continue
		}
		if in && f[0] == "Rss:" && len(f) >= 2 {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			total += kb << 10
		}
	}
	return total, found
}
