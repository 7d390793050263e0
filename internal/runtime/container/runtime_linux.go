package container

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/sched"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/unixsock"
)

var (
	_ runtime.Runtime     = (*Runtime)(nil)
	_ runtime.Pauser      = (*Runtime)(nil)
	_ runtime.StatsReader = (*Runtime)(nil)
)

// handleVersion is the version of handleState's JSON in runtime.Handle.
const handleVersion = 1

// Files and directories the backend makes under Spec.StateDir.
const (
	upperDir  = "upper"
	workDir   = "work"
	rootfsDir = "rootfs"
	runDir    = "run"
	logDir    = "log" // in tmp: the agent's stderr cannot fill the disk
	// tmpDir is the tmpfs holding run and log (symlinks to tmp/run and
	// tmp/log); sandboxes made before it have run and log tmpfs of their own.
	tmpDir     = "tmp"
	configFile = "config.json"
	pidFile    = "init.pid"
	runcLog    = "runc.log"
	agentLog   = "agent.log"
	resolvFile = "resolv.conf" // bind-mounted read-only at /etc/resolv.conf
	// interpreterFile is the code interpreter's runner, bind-mounted
	// read-only at interpreter.PathInSandbox.
	interpreterFile = "interpreter.py"
	// A small tmpfs (the former 1 MiB log and 256 KiB run together):
	// nothing in the sandbox can fill the node's disk through the agent's
	// stderr or the shared socket directory.
	tmpTmpfsOpts = "size=1280k,nr_inodes=80,mode=0700"
)

// handleState is the backend's blob in runtime.Handle.State.
type handleState struct {
	StateRoot  string `json:"state_root"`
	Bundle     string `json:"bundle"`
	CgroupPath string `json:"cgroup_path"`
	// Pid is 0 in handles of this version (Create no longer runs runc);
	// Recover reads init's pid from runc.
	Pid          int       `json:"pid"`
	Created      time.Time `json:"created"`
	OwnsStateDir bool      `json:"owns_state_dir,omitempty"`
	// Disk is the writable layer's quota; nil: none.
	Disk *diskState `json:"disk,omitempty"`
	// Lower is the overlay's lower directories, topmost first, for the
	// root's mount again at a ResumeFilesystem (empty in handles from
	// before filesystem pauses: those cannot be so paused).
	Lower []string `json:"lower,omitempty"`
	// MountPoints is the shared mount point layer on top of Lower in the
	// root's overlay (mountpoints_linux.go); empty: none (made without
	// one, or before there was one). A root mounted again gets the same
	// stack.
	MountPoints string `json:"mount_points,omitempty"`
	// OCIInTmp: the OCI bundle is the bundle's tmpfs (tmp): config.json,
	// the root's mount point, run, log and init.pid live in memory, not
	// in the state dir on disk (ociDir). Handles from before it have them
	// in the state dir itself (run and log symlinks into tmp).
	OCIInTmp bool `json:"oci_in_tmp,omitempty"`
}

// ociDir is the OCI bundle of the sandbox: the directory with config.json,
// rootfs, run, log and init.pid (run and log symlinks there in sandboxes
// made before OCIInTmp).
func (st *handleState) ociDir() string {
	if st.OCIInTmp {
		return filepath.Join(st.Bundle, tmpDir)
	}
	return st.Bundle
}

type sandbox struct {
	id string
	// st is immutable once the sandbox is in Runtime.sandboxes, so Status,
	// AgentConn and Stats read it without locks and never wait for a slow
	// Stop.
	st handleState
	// op serialises lifecycle operations (start, stop, delete, pause).
	op sync.Mutex
	// deleted reports whether Delete finished (set under op).
	deleted atomic.Bool
	// replaced: a PauseFilesystem put a new sandbox in its place (set
	// under op); lock looks the ID up again.
	replaced atomic.Bool
	// phase is where the sandbox is between Create and `runc run` (set
	// under op, read without it).
	phase atomic.Int32
	// pid is init's host pid once runc ran it (0 before).
	pid atomic.Int64
	// netNS is the network namespace to join (Spec.NetNS), checked at
	// Start: it may be made while the bundle is prepared.
	netNS string
	// prestarted: `runc create` made the container (Prestart) and Launch
	// has not let it run yet.
	prestarted atomic.Bool
	// guestEnv is Spec.Guest.Env, for Launch.
	guestEnv []string
	// bestEffort: Spec.CPUClass is best_effort (init runs under
	// SCHED_IDLE from Start on; what it starts inherits it).
	bestEffort bool
	// disk caches the size of the writable layer for Stats.
	disk diskCache
	// exit is how init ended, for Wait.
	exit exitWatch
}

// Phases of a sandbox. Create only prepares the bundle; runc learns about
// the container when Start runs `runc run --detach`, one runc process
// instead of `runc create` + `runc start`.
const (
	// phasePrepared: mounts and config.json are made, runc has not run.
	phasePrepared int32 = iota
	// phaseLaunched: `runc run` was called; runc's state is the truth.
	phaseLaunched
	// phaseStoppedUnstarted: Stop came before Start; it can never start.
	phaseStoppedUnstarted
	// phaseFSPaused: PauseFilesystem ended it and runc forgot it; its
	// writable layer waits for ResumeFilesystem (fspause_linux.go).
	phaseFSPaused
)

// Runtime is the container backend. Create one with New.
type Runtime struct {
	cfg Config
	// oci is the OCI runtime binary (runc or crun) and how it differs
	// (ociruntime_linux.go).
	oci *ociRuntime
	cg  cgroupMounts
	// quietCpusets: make each sandbox's v1 cpuset cgroup first, without
	// load balancing of its own (cgroupMounts.quietCpuset).
	quietCpusets bool
	// cpuset is the cpuset cgroup all sandboxes share where crun does not
	// see the cpuset hierarchy (cgview_linux.go); nil: each has its own.
	cpuset *sharedCpuset
	// stateRootFS says what New did about the state root's file system
	// (stateRootTmpfs); "" when the state root was configured.
	stateRootFS string
	// seccomp is the compiled filter the agent installs (seccomp_linux.go).
	seccomp []byte

	// images and projects are the disk quota mechanisms (disk_linux.go).
	images   *imageQuota
	projects *projectQuota
	// shared holds the files every sandbox mounts read-only (shared_linux.go).
	shared *sharedFiles
	// mpLayer is the lower layer of mount points every sandbox's root
	// has on top (mountpoints_linux.go).
	mpLayer mountPointLayer
	// runcNS is the mount namespace runc runs in (runcns_linux.go).
	runcNS runcNamespace
	// other is the runtime that is not oci, for containers it made
	// (ociFor).
	other otherOCI

	mu        sync.Mutex
	sandboxes map[string]*sandbox // guarded by mu
	creating  map[string]bool     // IDs with a Create in progress; guarded by mu
}

// New checks that the OCI runtime (runc or crun, container.oci_runtime) is
// installed and the process is root, and returns the backend.
func New(cfg Config) (*Runtime, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "container backend needs root (euid is %d)", os.Geteuid())
	}
	cg, err := detectCgroups()
	if err != nil {
		return nil, fmt.Errorf("detect cgroups: %w", err)
	}
	if !cg.v2 && (cg.v1["memory"] == "" || cg.v1["pids"] == "" || cg.v1["cpuacct"] == "") {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "cgroup v1 controllers memory, pids and cpuacct must be mounted (found %v)", cg.v1)
	}
	if cfg.TotalPidsLimit == 0 {
		avail, err := sandboxspec.HostPids()
		if err != nil {
			return nil, errdefs.New(errdefs.ErrFailedPrecondition, "node.total_pids_limit is unset and the host's pid limit cannot be read: %w; set it", err)
		}
		cfg.TotalPidsLimit = sandboxspec.TotalPidsCeiling(avail)
		if cfg.TotalPidsLimit < cfg.MaxPidsLimit {
			return nil, errdefs.Invalid("node.max_pids_limit", "%d is above what all sandboxes together may have on this host (%d, from kernel.pid_max %d less headroom); lower it, or set node.total_pids_limit", cfg.MaxPidsLimit, cfg.TotalPidsLimit, avail)
		}
	}
	if err := checkNofile(cfg.NofileLimit); err != nil {
		return nil, err
	}
	if err := cg.setPidsMax(cfg.CgroupParent, cfg.TotalPidsLimit); err != nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "set node.total_pids_limit on cgroup %s: %w", cfg.CgroupParent, err)
	}
	oci, err := chooseOCIRuntime(&cfg, cg)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.StateRoot, 0o700); err != nil {
		return nil, fmt.Errorf("create runc state root: %w", err)
	}
	// Before the runc namespace (a copy of the node's) is made.
	stateRootFS := ""
	if cfg.tmpfsStateRoot {
		if stateRootFS, err = stateRootTmpfs(cfg.StateRoot); err != nil {
			return nil, err
		}
		// Create's intent records, one per create, in memory too: they
		// are as volatile as the state root next to them (see intentPath).
		intents := cfg.StateRoot + ".intents"
		if err := os.MkdirAll(intents, 0o700); err != nil {
			return nil, fmt.Errorf("create intent dir: %w", err)
		}
		fs, err := stateRootTmpfs(intents)
		if err != nil {
			return nil, err
		}
		stateRootFS += "; intents: " + fs
	}
	prof, err := defaultSeccompProfile()
	if err != nil {
		return nil, err
	}
	filter, err := compileSeccomp(prof)
	if err != nil {
		return nil, err
	}
	// crun runs without the cpuset hierarchy where it can (cgview_linux.go):
	// the sandboxes share one cpuset cgroup.
	var cpuset *sharedCpuset
	if oci.view.hidesCpuset() {
		if cpuset, err = newSharedCpuset(cg.v1["cpuset"], cfg.CgroupParent); err != nil {
			return nil, errdefs.New(errdefs.ErrFailedPrecondition, "make the sandboxes' shared cpuset cgroup: %w", err)
		}
	}
	mkfs, _ := exec.LookPath("mkfs.ext4") // checked when a quota needs it
	return &Runtime{cfg: cfg, oci: oci, cg: cg, quietCpusets: cg.cpusetLoadBalanced() && cpuset == nil, cpuset: cpuset, stateRootFS: stateRootFS, seccomp: filter,
		images: &imageQuota{mkfs: mkfs, dir: cfg.layerTemplateDir(), directIO: true}, projects: &projectQuota{claims: cfg.StateRoot + ".projects"},
		shared:    &sharedFiles{dir: cfg.sharedDir()},
		sandboxes: map[string]*sandbox{}, creating: map[string]bool{}}, nil
}

// newBackend is New for the registry: a nil runtime.Runtime (not one
// holding a nil *Runtime) on error. It warns when the host's file table
// is smaller than what the sandboxes may open together.
func newBackend(ctx context.Context, cfg Config) (runtime.Runtime, error) {
	rt, err := New(cfg)
	if err != nil {
		return nil, err
	}
	if fileMax, err := readInt("/proc/sys/fs/file-max"); err == nil && fileMax > 0 {
		if all := rt.cfg.TotalPidsLimit * rt.cfg.NofileLimit; all > fileMax {
			log.G(ctx).Warn("the sandboxes may open more files than the host's file table holds; raise fs.file-max (systemd sets it to 9223372036854775807) or lower node.nofile_limit (docs/security.md)",
				"fs.file-max", fileMax, "node.total_pids_limit", rt.cfg.TotalPidsLimit, "node.nofile_limit", rt.cfg.NofileLimit)
		}
	}
	rt.sweepHiddenAtStart(ctx)
	log.G(ctx).Info("container OCI runtime", "oci_runtime", rt.oci.kind, "version", rt.oci.version, "path", rt.oci.path,
		"exe", rt.oci.exe, "reason", rt.oci.reason, "hidden_cgroup2_mount", rt.oci.hideUnified, "preload", rt.oci.preload)
	if rt.oci.preloadErr != nil {
		log.G(ctx).Warn("crun runs with Debian's libsystemd: each crun command loads five more libraries (docs/operations.md)", log.Err(rt.oci.preloadErr))
	}
	if rt.stateRootFS != "" {
		log.G(ctx).Info("OCI runtime state root", "state_root", rt.cfg.StateRoot, "file_system", rt.stateRootFS)
	}
	if rt.oci.exeErr != nil {
		log.G(ctx).Warn("crun runs from its path, not from a sealed memfd copy: every crun command copies itself first (its CVE-2019-5736 protection), which costs CPU on each create", "path", rt.oci.path, log.Err(rt.oci.exeErr))
	}
	log.G(ctx).Info("sandbox limits", "cgroup_parent", rt.cfg.CgroupParent, "node.total_pids_limit", rt.cfg.TotalPidsLimit,
		"node.max_pids_limit", rt.cfg.MaxPidsLimit, "node.nofile_limit", rt.cfg.NofileLimit)
	return rt, nil
}

// CgroupV2 reports whether the host uses the unified cgroup hierarchy.
func (r *Runtime) CgroupV2() bool { return r.cg.v2 }

// CgroupDirs returns the host cgroup directories of sandbox id that exist.
func (r *Runtime) CgroupDirs(id string) []string {
	return r.cg.existing(r.cgroupPath(id))
}

func (r *Runtime) cgroupPath(id string) string { return filepath.Join(r.cfg.CgroupParent, id) }

// Info describes the backend.
func (r *Runtime) Info() runtime.Info {
	return runtime.Info{
		Name:         "container",
		Version:      r.oci.String(),
		Detail:       "oci_runtime " + r.oci.kind + ": " + r.oci.reason,
		Capabilities: runtime.CapabilitiesOf(r, false),
	}
}

// Lower bounds under which the agent itself cannot run (sandboxspec's, so a
// spec the apiserver and node accepted never fails here).
const (
	minMemoryMB = sandboxspec.MinMemoryMB
	minCPU      = sandboxspec.MinCPU
	minPids     = sandboxspec.MinPidsLimit
)

// checkNofile refuses an RLIMIT_NOFILE runc could not give: above the
// node's own hard limit, raising it needs CAP_SYS_RESOURCE, which the node
// lacks on some hosts. Every sandbox then gets exactly the configured value.
func checkNofile(nofile int64) error {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return fmt.Errorf("read the node's RLIMIT_NOFILE: %w", err)
	}
	if uint64(nofile) <= rl.Max || hasCapability(unix.CAP_SYS_RESOURCE) {
		return nil
	}
	return errdefs.Invalid("node.nofile_limit", "%d is above the node's own hard RLIMIT_NOFILE (%d), which it cannot raise without CAP_SYS_RESOURCE; give at most %d, or start the node with a higher limit (LimitNOFILE= in its systemd unit, ulimit -Hn)", nofile, rl.Max, rl.Max)
}

// hasCapability reports whether the process has capability c in its
// effective set.
func hasCapability(c int) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && caps&(1<<uint(c)) != 0
		}
	}
	return false
}

func validateSpec(s runtime.Spec, maxPids int64) error {
	return runtime.ValidateSpec(s, runtime.SpecRules{
		Backend: Name, MinMemoryMB: minMemoryMB, MemoryWhy: "the agent alone needs a few MiB", MinCPU: minCPU,
		MinPids: minPids, DefaultPids: defaultPidsLimit, MaxPids: maxPids,
		Networks: []runtime.NetworkMode{runtime.NetworkVeth}, NetworkHint: "it joins a namespace with a veth: give mode veth",
	})
}

// ValidateOptions refuses every option: the container backend has none.
func (r *Runtime) ValidateOptions(opts map[string]string) error {
	for k := range opts {
		return errdefs.Invalid("backend_options."+k, "the container backend has no options; remove it")
	}
	return nil
}

func isIDChars(s string) bool {
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// Create prepares the sandbox: overlay root, tmpfs mounts and config.json.
// runc is not called: Start runs the container in one `runc run --detach`,
// which saves a runc process (and its exec-fifo round trip) on every create.
// Until then Status reports StateCreated. On any error everything made so
// far is undone.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (runtime.Handle, error) {
	return r.create(ctx, spec, nil)
}

// create is Create with the writable layer made from seed (a copy of
// another sandbox's: Fork, Restore); nil: a new, empty one.
func (r *Runtime) create(ctx context.Context, spec runtime.Spec, seed *layerSeed) (_ runtime.Handle, retErr error) {
	if err := validateSpec(spec, r.cfg.MaxPidsLimit); err != nil {
		return runtime.Handle{}, err
	}
	sb := &sandbox{id: spec.ID, netNS: spec.Network.NetNS, guestEnv: spec.Guest.Env, exit: newExitWatch(),
		bestEffort: spec.CPUClass == runtime.CPUBestEffort}
	r.mu.Lock()
	if _, ok := r.sandboxes[spec.ID]; ok || r.creating[spec.ID] {
		r.mu.Unlock()
		return runtime.Handle{}, errdefs.New(errdefs.ErrAlreadyExists, "sandbox %q already exists", spec.ID)
	}
	r.creating[spec.ID] = true
	r.mu.Unlock()

	st := handleState{
		StateRoot:  r.cfg.StateRoot,
		Bundle:     spec.StateDir,
		CgroupPath: r.cgroupPath(spec.ID),
		Created:    time.Now().UTC(),
		OCIInTmp:   true,
	}
	sb.st = st
	defer func() {
		if retErr != nil {
			if err := r.cleanup(context.WithoutCancel(ctx), sb); err != nil {
				log.G(ctx).Error("undo failed create", "sandbox.id", spec.ID, "error", err)
			}
		}
		r.mu.Lock()
		delete(r.creating, spec.ID)
		if retErr == nil {
			r.sandboxes[spec.ID] = sb
		}
		r.mu.Unlock()
	}()
	// runc keeps each container's state in <root>/<id>: cheaper than `runc state`.
	if _, err := os.Lstat(filepath.Join(st.StateRoot, spec.ID)); err == nil {
		// A container left by someone else: never touch it from a failed create.
		sb.st.Bundle = ""
		return runtime.Handle{}, errdefs.New(errdefs.ErrAlreadyExists, "sandbox %q already exists in runc state %s", spec.ID, st.StateRoot)
	}

	if _, err := os.Stat(spec.StateDir); errors.Is(err, os.ErrNotExist) {
		sb.st.OwnsStateDir = true
	}
	// An image quota is known in full before it is made: the intent holds
	// it from the start, written once (a second write is a second file).
	planned := r.plannedDisk(spec.StateDir, spec.Resources.DiskMB, seed)
	sb.st.Disk = planned
	// Before anything is made: a node that crashes from here on can still
	// Delete this ID without a Handle.
	if err := r.writeIntent(sb.st, spec.ID); err != nil {
		return runtime.Handle{}, err
	}
	if err := os.MkdirAll(spec.StateDir, 0o700); err != nil {
		return runtime.Handle{}, fmt.Errorf("create state dir: %w", err)
	}
	// The state dir is what keeps host users away from the upper layer
	// (the sandbox's root can make setuid-root files there).
	if err := os.Chmod(spec.StateDir, 0o700); err != nil {
		return runtime.Handle{}, fmt.Errorf("chmod state dir: %w", err)
	}
	// On disk only tmp, the mount point of the bundle's tmpfs, and the
	// layer's image: every new inode there costs the host's file system
	// (on ext4 without a journal a scan of recently deleted inodes each,
	// ~0.25 ms of CPU), while the rest needs no disk (docs/ARCHITECTURE.md,
	// "Where a sandbox's files live").
	if err := os.Mkdir(filepath.Join(spec.StateDir, tmpDir), 0o700); err != nil {
		return runtime.Handle{}, fmt.Errorf("create %s dir: %w", tmpDir, err)
	}
	// One small tmpfs is the OCI bundle: config.json, the root's mount
	// point, run (opendsec-init, uid 0 in the sandbox, creates the agent
	// socket there; the node connects as root), log (the agent's stderr
	// cannot fill the disk), init.pid, and the layer image's mount point.
	// Every mount on the host is copied by each later `runc run`, so a
	// sandbox keeps as few there as it can.
	ociDir := sb.st.ociDir()
	if err := unix.Mount("tmpfs", ociDir, "tmpfs",
		unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, tmpTmpfsOpts); err != nil {
		return runtime.Handle{}, fmt.Errorf("mount %s tmpfs: %w", tmpDir, err)
	}
	for _, d := range []struct {
		name string
		mode os.FileMode
	}{{rootfsDir, 0o700}, {runDir, 0o755}, {logDir, 0o700}} {
		in := filepath.Join(ociDir, d.name)
		if err := os.Mkdir(in, d.mode); err != nil {
			return runtime.Handle{}, fmt.Errorf("create %s dir: %w", d.name, err)
		}
		if err := os.Chmod(in, d.mode); err != nil {
			return runtime.Handle{}, fmt.Errorf("chmod %s dir: %w", d.name, err)
		}
	}
	// The writable layer, with its quota in bytes and inodes.
	disk, err := r.prepareLayer(ctx, spec.ID, spec.StateDir, spec.Resources.DiskMB, seed)
	sb.st.Disk = disk
	if err != nil {
		return runtime.Handle{}, err
	}
	if disk != nil && (planned == nil || *disk != *planned) {
		// A crash from here on is undone with the quota known.
		if err := r.writeIntent(sb.st, spec.ID); err != nil {
			return runtime.Handle{}, err
		}
	}
	// The image store mounts EROFS layers for this sandbox (holder: its
	// ID); the node's release of the sandbox's image hold unmounts them.
	lower, err := spec.Rootfs.Dirs(ctx, spec.ID)
	if err != nil {
		return runtime.Handle{}, fmt.Errorf("mount image layers: %w", err)
	}
	// The shared mount point layer on top (mountpoints_linux.go); the
	// handle's Lower stays the image's layers.
	sb.st.MountPoints = r.mountPointsFor(ctx)
	root := filepath.Join(ociDir, rootfsDir)
	if err := r.mountRootOverlay(sb.st.MountPoints, lower, sb.st.upper(), sb.st.work(), func(opts string) error {
		if err := unix.Mount("overlay", root, "overlay", 0, opts); err != nil {
			return fmt.Errorf("mount overlay root: %w", err)
		}
		return nil
	}); err != nil {
		return runtime.Handle{}, err
	}
	sb.st.Lower = lower

	oci, err := ociSpec(&r.cfg, spec, st.CgroupPath)
	if err != nil {
		return runtime.Handle{}, err
	}
	// The seccomp filter, the code interpreter and resolv.conf: the node's
	// shared read-only copies (shared_linux.go), not files of the bundle.
	if err := r.useSharedFiles(oci, spec.Guest.Nameservers); err != nil {
		return runtime.Handle{}, err
	}
	b, err := json.Marshal(oci)
	if err != nil {
		return runtime.Handle{}, fmt.Errorf("encode config.json: %w", err)
	}
	if testHookConfigWrite != nil {
		if err := testHookConfigWrite(spec.ID); err != nil {
			return runtime.Handle{}, fmt.Errorf("write config.json: %w", err)
		}
	}
	if err := os.WriteFile(filepath.Join(ociDir, configFile), b, 0o600); err != nil {
		return runtime.Handle{}, fmt.Errorf("write config.json: %w", err)
	}
	hs, err := json.Marshal(sb.st)
	if err != nil {
		return runtime.Handle{}, fmt.Errorf("encode handle: %w", err)
	}
	log.G(ctx).Debug("sandbox created", "sandbox.id", spec.ID)
	return runtime.Handle{ID: spec.ID, Version: handleVersion, State: hs}, nil
}

// testHookConfigWrite, set by tests only, fails Create of the sandbox it
// returns an error for right before config.json is written (everything
// mounted): config.json is in a tmpfs Create mounts, so a test cannot put
// something in its way beforehand.
var testHookConfigWrite func(id string) error

// runcRun runs `runc run --detach` and returns init's host pid. Its stdio
// are files, never pipes, so runc and the container's init hold no pipe of
// ours (exec.Cmd.Wait would otherwise wait for the container to exit). stdin and stdout are /dev/null;
// stderr (the agent's log) goes to a file on a 1 MiB tmpfs, so neither the
// agent nor anything that gets hold of its stderr can fill the disk.
func (r *Runtime) runcRun(ctx context.Context, id, bundle, netNS string) (int, error) {
	return r.runcInit(ctx, id, bundle, netNS, false)
}

// runcInit runs `runc run --detach` (or, with prestart, `runc create` at
// CPU niceness prestartNice: everything but the exec of init) and returns
// init's host pid. See runcRun for its stdio and the agent socket. runc
// runs in a mount namespace holding only this sandbox's mounts
// (runcns_linux.go); netNS is the network namespace it joins.
func (r *Runtime) runcInit(ctx context.Context, id, bundle, netNS string, prestart bool) (int, error) {
	// crun moves its init into the cgroup before it forks there, so it
	// starts a container with no pid left under node.total_pids_limit
	// (runc fails), whose init then cannot start the agent: refuse first,
	// for both.
	if cur, limit, full := r.parentPidsFull(); full {
		return 0, errdefs.New(errdefs.ErrResourceExhausted, "the node's sandboxes hold %d of the %d processes node.total_pids_limit allows them together; stop some sandboxes and retry", cur, limit)
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return 0, fmt.Errorf("open /dev/null: %w", err)
	}
	defer devnull.Close()
	logf, err := os.OpenFile(filepath.Join(bundle, logDir, agentLog), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, fmt.Errorf("open agent log: %w", err)
	}
	defer logf.Close()
	// The agent's socket is bound and listening before the container
	// exists: from the moment runc returns, a connection waits in its
	// backlog until init's server accepts it, so nothing has to wait for
	// the agent's start. init inherits it as fd 3 (--preserve-fds 1); the
	// node keeps no copy, so a sandbox whose init died refuses connections.
	lfile, err := listenUnixAt(filepath.Join(bundle, runDir), agentSocketName)
	if err != nil {
		return 0, err
	}
	defer lfile.Close()
	rlog := filepath.Join(bundle, logDir, runcLog)
	sub := []string{"run", "--detach"}
	if prestart {
		sub = []string{"create"}
	}
	args := append([]string{"--root", r.cfg.StateRoot, "--log", rlog, "--log-format", "json"}, sub...)
	mk := func(exe string) *exec.Cmd {
		cmd := r.oci.commandFrom(ctx, exe, append(args, "--preserve-fds", "1", "--bundle", bundle, "--pid-file", filepath.Join(bundle, pidFile), id)...)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = devnull, devnull, logf
		cmd.ExtraFiles = []*os.File{lfile}
		// A new session: signals to the node's process group (Ctrl-C)
		// never reach the container.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		cmd.WaitDelay = 5 * time.Second
		return cmd
	}
	// The cgroup is config.json's: the handle's (a sandbox from before
	// node IDs were in the defaults keeps its old one).
	cgPath := r.cgroupPath(id)
	if sb, err := r.get(id); err == nil && sb.st.CgroupPath != "" {
		cgPath = sb.st.CgroupPath
	}
	if r.quietCpusets {
		r.cg.quietCpuset(cgPath)
	}
	cmd := mk(r.oci.exeNow(ctx))
	var startErr error
	runErr := r.inRuncNS(ctx, r.runPlan(bundle, netNS), r.oci, func() error {
		if r.cpuset != nil {
			// crun does not see the cpuset hierarchy: the container
			// starts in this thread's cpuset cgroup.
			if startErr = r.cpuset.join(); startErr != nil {
				return startErr
			}
		}
		startErr = cmd.Start()
		if startErr != nil && r.oci.execFailed(ctx, cmd, startErr) {
			cmd = mk(r.oci.path)
			startErr = cmd.Start()
		}
		if startErr != nil {
			return startErr
		}
		if prestart {
			// runc forks its init a few milliseconds into its run; the
			// children inherit this.
			_ = unix.Setpriority(unix.PRIO_PROCESS, cmd.Process.Pid, prestartNice)
		}
		return cmd.Wait()
	})
	if startErr != nil {
		return 0, fmt.Errorf("%s %s: %w", r.oci.kind, sub[0], startErr)
	}
	if err := runErr; err != nil {
		if cur, limit, full := r.parentPidsFull(); full {
			return 0, errdefs.New(errdefs.ErrResourceExhausted, "the node's sandboxes hold %d of the %d processes node.total_pids_limit allows them together; stop some sandboxes and retry (%s %s: %v: %s)", cur, limit, r.oci.kind, sub[0], err, runcLogError(rlog))
		}
		return 0, fmt.Errorf("%s %s: %w: %s", r.oci.kind, sub[0], err, runcLogError(rlog))
	}
	// Before the caller lets anything of the sandbox run.
	if err := r.oci.afterInit(r.cg, cgPath); err != nil {
		return 0, err
	}
	pb, err := os.ReadFile(filepath.Join(bundle, pidFile))
	if err != nil {
		return 0, fmt.Errorf("read init pid: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(pb)))
	if err != nil {
		return 0, fmt.Errorf("parse init pid: %w", err)
	}
	// The container's mount namespace holds its own copy of the root now
	// (runc pivoted into it): the host's is only a cost. Every mount in
	// the node's namespace is copied by each later `runc run` (clone with
	// CLONE_NEWNS, then the old root's unmount), so 1000 sandboxes' roots
	// slowed every create by tens of milliseconds. The writable layer and
	// its upper stay mounted on the host.
	if err := unix.Unmount(filepath.Join(bundle, rootfsDir), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		log.G(ctx).Warn("unmount the host's view of a started sandbox's root", "sandbox.id", id, "error", err)
	}
	return pid, nil
}

// parentPidsFull reports whether the sandboxes together hold so many pids
// that a new one cannot start: fewer than the smallest pids_limit are left
// under the cgroup parent's pids.max (node.total_pids_limit).
func (r *Runtime) parentPidsFull() (cur, limit int64, full bool) {
	dir := filepath.Dir(r.cg.pidsMaxFile(r.cfg.CgroupParent))
	cur, err := readInt(filepath.Join(dir, "pids.current"))
	if err != nil {
		return 0, 0, false
	}
	limit, err = readInt(filepath.Join(dir, "pids.max"))
	if err != nil || limit < 0 {
		return 0, 0, false
	}
	return cur, limit, limit-cur < minPids
}

// runcLogError returns the last error message in a runc JSON log.
func runcLogError(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(no runc log)"
	}
	msg := ""
	for _, line := range bytes.Split(b, []byte("\n")) {
		var e struct{ Level, Msg string }
		if json.Unmarshal(line, &e) == nil && (e.Level == "error" || e.Level == "fatal") {
			msg = e.Msg
		}
	}
	if msg == "" {
		msg = strings.TrimSpace(string(b))
	}
	return msg
}

// runcOut runs a runc subcommand and returns its stdout; runc's error message
// is in the error.
//
// It runs the runtime that made the container (ociFor): the container is
// the first argument after the subcommand that is not a flag.
func (r *Runtime) runcOut(ctx context.Context, root string, args ...string) ([]byte, error) {
	oci := r.ociFor(ctx, root, containerArg(args))
	var stderr bytes.Buffer
	mk := func(exe string) *exec.Cmd {
		cmd := oci.commandFrom(ctx, exe, append([]string{"--root", root}, args...)...)
		stderr.Reset()
		cmd.Stderr = &stderr
		cmd.WaitDelay = 5 * time.Second
		return cmd
	}
	var out []byte
	// In the runc namespace: no runc command but run and create needs a
	// sandbox's mount, and none should read the node's mount table.
	err := r.inRuncNS(ctx, runcNSPlan{same: []string{root}}, oci, func() error {
		cmd := mk(oci.exeNow(ctx))
		var err error
		out, err = cmd.Output()
		if err != nil && oci.execFailed(ctx, cmd, err) {
			out, err = mk(oci.path).Output()
		}
		return err
	})
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if oci.notFound(msg) {
			return nil, errdefs.New(errdefs.ErrNotFound, "%s %s: container not found: %s", oci.kind, args[0], msg)
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%s %s: %w", oci.kind, args[0], ctx.Err())
		}
		return nil, fmt.Errorf("%s %s: %w: %s", oci.kind, args[0], err, msg)
	}
	return out, nil
}

// containerArg is the container ID in a runtime command's arguments: the
// first after the subcommand that is not a flag ("" if none).
func containerArg(args []string) string {
	for _, a := range args[1:] {
		if !strings.HasPrefix(a, "-") {
			return a
		}
	}
	return ""
}

type runcStateJSON struct {
	Status string `json:"status"`
	Pid    int    `json:"pid"`
	Bundle string `json:"bundle"`
}

func (r *Runtime) runcState(ctx context.Context, root, id string) (runcStateJSON, error) {
	var s runcStateJSON
	out, err := r.runcOut(ctx, root, "state", id)
	if err != nil {
		return s, err
	}
	if err := json.Unmarshal(out, &s); err != nil {
		return s, fmt.Errorf("decode runc state: %w", err)
	}
	return s, nil
}

func (r *Runtime) get(id string) (*sandbox, error) {
	r.mu.Lock()
	sb, ok := r.sandboxes[id]
	r.mu.Unlock()
	if !ok || sb.deleted.Load() {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox %q not found", id)
	}
	return sb, nil
}

// lock returns the sandbox with its mu held, or ErrNotFound. A sandbox
// replaced while it waited (PauseFilesystem) is looked up again.
func (r *Runtime) lock(id string) (*sandbox, error) {
	for {
		sb, err := r.get(id)
		if err != nil {
			return nil, err
		}
		sb.op.Lock()
		if sb.replaced.Load() {
			sb.op.Unlock()
			continue
		}
		if sb.deleted.Load() {
			sb.op.Unlock()
			return nil, errdefs.New(errdefs.ErrNotFound, "sandbox %q not found", id)
		}
		return sb, nil
	}
}

// Start runs the agent: `runc run --detach` of the prepared bundle.
func (r *Runtime) Start(ctx context.Context, id string) error {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	switch sb.phase.Load() {
	case phaseStoppedUnstarted:
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is stopped and cannot be started again; create a new one", id)
	case phasePrepared:
		if sb.netNS != "" {
			if _, err := os.Stat(sb.netNS); err != nil {
				return errdefs.Invalid("network.netns", "network namespace of sandbox %s: %v; set it up before Start", id, err)
			}
		}
		pid, err := r.runcRun(ctx, id, sb.st.ociDir(), sb.netNS)
		if err != nil {
			// runc removes what it made of a container that failed to
			// run; make sure, so that Start can be retried.
			if _, derr := r.runcOut(context.WithoutCancel(ctx), sb.st.StateRoot, "delete", "--force", id); derr != nil && !errdefs.IsNotFound(derr) {
				log.G(ctx).Warn("remove container after failed run", "sandbox.id", id, "error", derr)
				sb.phase.Store(phaseLaunched)
			}
			return fmt.Errorf("start sandbox: %w", err)
		}
		sb.pid.Store(int64(pid))
		sb.phase.Store(phaseLaunched)
		r.watch(sb, pid)
		if err := r.applyCPUClass(sb); err != nil {
			return fmt.Errorf("start sandbox: %w", err)
		}
		log.G(ctx).Debug("sandbox started", "sandbox.id", id, "pid", pid)
		return nil
	}
	if sb.prestarted.Load() {
		return r.launch(ctx, sb, nil)
	}
	_, startErr := r.runcOut(ctx, sb.st.StateRoot, "start", id)
	if startErr == nil {
		return r.applyCPUClass(sb)
	}
	// Only on failure ask why: starting a running sandbox is a no-op.
	s, err := r.runcState(ctx, sb.st.StateRoot, id)
	if err != nil {
		return fmt.Errorf("start sandbox: %w", startErr)
	}
	switch s.Status {
	case "running", "paused", "pausing":
		return nil
	case "stopped":
		return errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %q is stopped and cannot be started again; create a new one", id)
	}
	return fmt.Errorf("start sandbox: %w", startErr)
}

// Stop sends SIGTERM to every process, then SIGKILL after opts.Timeout, and
// waits until init is gone.
func (r *Runtime) Stop(ctx context.Context, id string, opts runtime.StopOptions) error {
	sb, err := r.lock(id)
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	return r.stop(ctx, sb, opts.Timeout)
}

func (r *Runtime) stop(ctx context.Context, sb *sandbox, timeout time.Duration) error {
	sb.exit.stopping.Store(true)
	if sb.phase.Load() != phaseLaunched {
		// Nothing runs before `runc run`.
		sb.phase.Store(phaseStoppedUnstarted)
		sb.exit.once.Do(func() { r.ended(sb, "stopped before it started") })
		return nil
	}
	// Launched: init ran past `runc start`, so a live pid is a running
	// sandbox (or a paused one, which fastKill leaves to the path below).
	if timeout <= 0 && r.fastKill(sb) {
		return nil
	}
	s, err := r.runcState(ctx, sb.st.StateRoot, sb.id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("stop sandbox: %w", err)
	}
	if s.Status == "stopped" {
		return nil
	}
	if s.Status == "paused" {
		// Signals are not delivered to frozen tasks.
		if _, err := r.runcOut(ctx, sb.st.StateRoot, "resume", sb.id); err != nil {
			return fmt.Errorf("stop sandbox: %w", err)
		}
	}
	if timeout > 0 && s.Status != "created" {
		if err := r.kill(ctx, sb, "TERM"); err != nil {
			return err
		}
		if r.waitStopped(ctx, sb, timeout) {
			return nil
		}
	}
	if err := r.kill(ctx, sb, "KILL"); err != nil {
		return err
	}
	if !r.waitStopped(ctx, sb, 10*time.Second) {
		if ctx.Err() != nil {
			return fmt.Errorf("stop sandbox: %w", ctx.Err())
		}
		return errdefs.New(errdefs.ErrInternal, "sandbox %q still running 10s after SIGKILL", sb.id)
	}
	return nil
}

// fastKill ends a running, thawed sandbox without a `runc kill` and the
// `runc state` polls after it: SIGKILL to init (by pidfd), pid 1 of the
// sandbox's PID namespace, kills every process of the namespace, and init's
// pidfd turns readable once they are all gone. It reports false when the
// slow path must run: no pidfd, a cgroup not thawed (frozen tasks take no
// signal), a pid that is no longer in the sandbox's cgroup, or an init
// still there after 10 s.
func (r *Runtime) fastKill(sb *sandbox) bool {
	pid := int(sb.pid.Load())
	if pid <= 0 || !r.cg.thawed(sb.st.CgroupPath) {
		return false
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	// The pidfd pins the process: if it is still in the sandbox's cgroup
	// now, the signal goes to the sandbox, never to a reused pid.
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil || !bytes.Contains(cg, []byte(sb.st.CgroupPath)) {
		return false
	}
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil {
		return false
	}
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}} //nolint:gosec // an fd fits
	for {
		n, err := unix.Poll(fds, 10_000)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err == nil && n == 1
	}
}

func (r *Runtime) kill(ctx context.Context, sb *sandbox, sig string) error {
	_, err := r.runcOut(ctx, sb.st.StateRoot, "kill", "--all", sb.id, sig)
	if err != nil && !errdefs.IsNotFound(err) && !strings.Contains(err.Error(), "not running") {
		return fmt.Errorf("signal sandbox: %w", err)
	}
	return nil
}

// waitStopped polls until the init process is gone or d passes. It watches
// init's /proc entry (cheap, fine-grained); only when no pid is on record
// or it is still there does it ask `runc state`.
func (r *Runtime) waitStopped(ctx context.Context, sb *sandbox, d time.Duration) bool {
	deadline := time.Now().Add(d)
	pid := int(sb.pid.Load())
	for pid > 0 && pidAlive(pid) && time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(2 * time.Millisecond)
	}
	if initGone(sb) {
		return true // runc, too, would say "stopped"
	}
	for {
		s, err := r.runcState(ctx, sb.st.StateRoot, sb.id)
		if errdefs.IsNotFound(err) || err == nil && s.Status == "stopped" {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Delete removes the container, its mounts, cgroups and files. Idempotent.
func (r *Runtime) Delete(ctx context.Context, id string) error {
	sb, err := r.lock(id)
	if errdefs.IsNotFound(err) {
		return r.deleteUnknown(ctx, id)
	}
	if err != nil {
		return err
	}
	defer sb.op.Unlock()
	if err := r.cleanup(ctx, sb); err != nil {
		return fmt.Errorf("delete sandbox: %w", err)
	}
	sb.deleted.Store(true)
	sb.markGone()
	r.mu.Lock()
	if r.sandboxes[id] == sb {
		delete(r.sandboxes, id)
	}
	r.mu.Unlock()
	return nil
}

// cleanup removes everything Create may have made for sb. It tolerates any
// part being missing, so it serves both Delete and undoing a failed Create.
func (r *Runtime) cleanup(ctx context.Context, sb *sandbox) error {
	if sb.st.Bundle == "" {
		return nil
	}
	sb.exit.stopping.Store(true)
	// Kill first: `runc delete --force` of a running container sleeps 100 ms
	// before it looks again; ours polls /proc. When init is known to be gone
	// (a Stop ended it), runc would answer "stopped": no `runc state`.
	if initGone(sb) {
		log.G(ctx).Debug("init gone, no runc state before delete", "sandbox.id", sb.id)
	} else if s, err := r.runcState(ctx, sb.st.StateRoot, sb.id); err == nil && s.Status != "stopped" {
		if s.Status == "paused" {
			if _, err := r.runcOut(ctx, sb.st.StateRoot, "resume", sb.id); err != nil {
				return fmt.Errorf("resume before delete: %w", err)
			}
		}
		if err := r.kill(ctx, sb, "KILL"); err != nil {
			return err
		}
		r.waitStopped(ctx, sb, 10*time.Second)
	}
	// While runc may still have the container, its mounts and cgroups are in
	// use: stop here and let the caller retry.
	if _, err := r.runcOut(ctx, sb.st.StateRoot, "delete", "--force", sb.id); err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	if err := r.oci.dropHidden(sb.st.CgroupPath, r.cfg.CgroupParent); err != nil {
		log.G(ctx).Warn("crun's leftovers under the hidden cgroup2 mount point", log.SandboxID(sb.id), log.Err(err))
	}
	var errs []error
	if pid := int(sb.pid.Load()); pid > 0 {
		waitPidGone(ctx, pid, 10*time.Second)
	}
	if err := r.cg.remove(ctx, sb.st.CgroupPath); err != nil {
		errs = append(errs, err)
	}
	// run and log are symlinks into tmp (their own tmpfs in sandboxes
	// made before tmp): unmount never follows them (UMOUNT_NOFOLLOW).
	// The root and the layer in the tmpfs go before the tmpfs. The image
	// layer's upper and work go with its unmount.
	for _, d := range []string{filepath.Join(tmpDir, rootfsDir), rootfsDir, logDir, runDir} {
		if err := unmount(ctx, filepath.Join(sb.st.Bundle, d)); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		// Never remove files under a mount that is still there.
		return errors.Join(errs...)
	}
	if err := unmountLayer(ctx, sb.st.Bundle); err != nil {
		return err
	}
	if err := unmount(ctx, filepath.Join(sb.st.Bundle, tmpDir)); err != nil {
		return err
	}
	if sb.st.OwnsStateDir {
		if err := os.RemoveAll(sb.st.Bundle); err != nil {
			return fmt.Errorf("remove state dir: %w", err)
		}
	} else {
		names := []string{upperDir, workDir, layerDir, layerImage, rootfsDir, runDir, logDir, tmpDir, configFile, pidFile, seccompFile, interpreterFile, fsPausedFile, launchEnvFile}
		seeds, _ := filepath.Glob(filepath.Join(sb.st.Bundle, forkSeedPrefix+"*"))
		for _, s := range seeds {
			names = append(names, filepath.Base(s))
		}
		for _, name := range names {
			if err := os.RemoveAll(filepath.Join(sb.st.Bundle, name)); err != nil {
				errs = append(errs, fmt.Errorf("remove %s: %w", name, err))
			}
		}
	}
	if len(errs) == 0 {
		if err := r.releaseLayer(ctx, sb.id, sb.st.Bundle, sb.st.Disk); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		if err := os.Remove(r.intentPath(sb.id)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove intent: %w", err))
		}
	}
	return errors.Join(errs...)
}

// initGone reports whether sb's init is known to have ended: its watcher saw
// its pidfd turn readable, or its pid is gone or a zombie. runc's state of
// such a container is "stopped" (runc, too, looks only at init), so the
// caller needs no `runc state` to learn it. With no pid on record (never
// launched, or recovered stopped) it reports false: only runc knows then.
func initGone(sb *sandbox) bool {
	pid := int(sb.pid.Load())
	if pid <= 0 || sb.phase.Load() != phaseLaunched {
		return false
	}
	select {
	case <-sb.exit.Done():
		return true
	default:
	}
	return !pidAlive(pid)
}

// intentPath is where Create records what it is about to make for id, so a
// Delete without a Handle (the node crashed mid-create) finds it. Next to
// the state root, and like it on a tmpfs (under /run, or one New mounts
// for the default state root): an intent outlives the node, not the host.
// After a reboot the node's own removal of the sandbox's state dir takes
// what a half-made sandbox left on disk (its layer image); its mounts,
// loop device and cgroup went with the reboot.
func (r *Runtime) intentPath(id string) string {
	return filepath.Join(r.cfg.StateRoot+".intents", id+".json")
}

func (r *Runtime) writeIntent(st handleState, id string) error {
	b, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("encode intent: %w", err)
	}
	p := r.intentPath(id)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("create intent dir: %w", err)
	}
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write intent: %w", err)
	}
	if err := os.Rename(tmp, p); err != nil {
		return fmt.Errorf("write intent: %w", err)
	}
	return nil
}

// deleteUnknown removes a sandbox this instance has no record of: one whose
// Create was interrupted by a node crash before the node stored its Handle.
// It finds it through the intent Create wrote, or through runc's state.
func (r *Runtime) deleteUnknown(ctx context.Context, id string) error {
	if isBadID(id) {
		return nil // never a sandbox of ours; nothing to find
	}
	r.mu.Lock()
	if r.creating[id] || r.sandboxes[id] != nil {
		r.mu.Unlock()
		return nil // being created (or recovered) right now: not an orphan
	}
	r.creating[id] = true
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(r.creating, id)
		r.mu.Unlock()
	}()
	sb := &sandbox{id: id, exit: newExitWatch()}
	// A create interrupted before an upgrade put node IDs in the default
	// names left its intent and runc state under the old defaults.
	places := []struct{ root, cgroup string }{{r.cfg.StateRoot, r.cgroupPath(id)}}
	if r.cfg.legacyDefaults {
		places = append(places, struct{ root, cgroup string }{DefaultStateRoot, filepath.Join(DefaultCgroupParent, id)})
	}
	for _, pl := range places {
		if b, err := os.ReadFile(filepath.Join(pl.root+".intents", id+".json")); err == nil {
			if err := json.Unmarshal(b, &sb.st); err != nil {
				return fmt.Errorf("delete sandbox: decode intent: %w", err)
			}
		}
		if s, err := r.runcState(ctx, pl.root, id); err == nil {
			sb.pid.Store(int64(s.Pid))
			if sb.st.Bundle == "" {
				sb.st.Bundle = s.Bundle
				if filepath.Base(s.Bundle) == tmpDir {
					// The OCI bundle is the state dir's tmpfs.
					sb.st.Bundle, sb.st.OCIInTmp = filepath.Dir(s.Bundle), true
				}
			}
		}
		if sb.st.Bundle == "" {
			// Nothing on record here; at most an empty cgroup is left.
			if err := r.cg.remove(ctx, pl.cgroup); err != nil {
				return fmt.Errorf("delete sandbox: %w", err)
			}
			continue
		}
		sb.st.StateRoot = pl.root
		sb.st.CgroupPath = pl.cgroup
		break
	}
	if sb.st.Bundle == "" {
		return nil
	}
	log.G(ctx).Info("deleting sandbox left by an interrupted create", "sandbox.id", id, "bundle", sb.st.Bundle)
	if err := r.cleanup(ctx, sb); err != nil {
		return fmt.Errorf("delete sandbox: %w", err)
	}
	return nil
}

func isBadID(id string) bool {
	return id == "" || len(id) > 64 || !isIDChars(id)
}

// waitPidGone polls until pid no longer exists (or is a zombie of someone
// else) or d passes.
func waitPidGone(ctx context.Context, pid int, d time.Duration) {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if !pidAlive(pid) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func pidAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name in parentheses.
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}

// unmount unmounts path if it is a mount point, lazily if it is busy.
func unmount(ctx context.Context, path string) error {
	for range 50 {
		err := unix.Unmount(path, unix.UMOUNT_NOFOLLOW)
		if err == nil {
			continue // stacked mounts: unmount until nothing is left
		}
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
			return nil // not a mount point (any more)
		}
		if errors.Is(err, unix.EBUSY) {
			log.G(ctx).Warn("mount busy, detaching lazily", "path", path, "error", err)
			if err := unix.Unmount(path, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil {
				return fmt.Errorf("lazy unmount %s: %w", path, err)
			}
			continue
		}
		return fmt.Errorf("unmount %s: %w", path, err)
	}
	return fmt.Errorf("unmount %s: still mounted after 50 unmounts", path)
}

// Status reports the container's state from `runc state`.
func (r *Runtime) Status(ctx context.Context, id string) (runtime.Status, error) {
	sb, err := r.get(id)
	if err != nil {
		return runtime.Status{}, err
	}
	if sb.phase.Load() == phaseFSPaused {
		return runtime.Status{State: runtime.StatePaused, FilesystemPaused: true}, nil
	}
	s, err := r.runcState(ctx, sb.st.StateRoot, id)
	if errdefs.IsNotFound(err) && sb.deleted.Load() {
		return runtime.Status{}, errdefs.New(errdefs.ErrNotFound, "sandbox %q not found", id)
	}
	if errdefs.IsNotFound(err) {
		switch sb.phase.Load() {
		case phasePrepared:
			// Start has not run runc yet (or it failed and runc cleaned up).
			return runtime.Status{State: runtime.StateCreated}, nil
		}
		// Stopped before it started, or known to us but gone from runc
		// (its state dir was lost): nothing runs.
		return runtime.Status{State: runtime.StateStopped}, nil
	}
	if err != nil {
		return runtime.Status{}, fmt.Errorf("sandbox status: %w", err)
	}
	switch s.Status {
	case "created":
		return runtime.Status{State: runtime.StateCreated, Pid: s.Pid}, nil
	case "running":
		return runtime.Status{State: runtime.StateRunning, Pid: s.Pid}, nil
	case "paused", "pausing":
		return runtime.Status{State: runtime.StatePaused, Pid: s.Pid}, nil
	default:
		return runtime.Status{State: runtime.StateStopped}, nil
	}
}

// Recover re-registers a sandbox from its Handle after a node restart.
func (r *Runtime) Recover(ctx context.Context, h runtime.Handle) error {
	if h.ID == "" {
		return errdefs.Invalid("handle.id", "must not be empty")
	}
	if h.Version != handleVersion {
		return errdefs.Invalid("handle.version", "unsupported container handle version %d (want %d)", h.Version, handleVersion)
	}
	var st handleState
	if err := json.Unmarshal(h.State, &st); err != nil {
		return errdefs.Invalid("handle.state", "not a container backend handle: %v", err)
	}
	if st.StateRoot == "" || st.Bundle == "" || st.CgroupPath == "" {
		return errdefs.Invalid("handle.state", "missing state_root, bundle or cgroup_path")
	}
	sb := &sandbox{id: h.ID, st: st, exit: newExitWatch()}
	s, err := r.runcState(ctx, st.StateRoot, h.ID)
	fsPaused := r.recoverFSPaused(ctx, sb, s, err)
	switch {
	case fsPaused:
		sb.phase.Store(phaseFSPaused)
	case err == nil:
		sb.phase.Store(phaseLaunched)
		sb.pid.Store(int64(s.Pid))
		if s.Status == "stopped" {
			sb.pid.Store(0)
		}
	case errdefs.IsNotFound(err) && r.prepared(h.ID, st.Bundle):
		// Created but never started: runc has no record yet.
		sb.phase.Store(phasePrepared)
	case errdefs.IsNotFound(err):
		return errdefs.New(errdefs.ErrNotFound, "sandbox %q not found in runc state %s", h.ID, st.StateRoot)
	default:
		return fmt.Errorf("recover sandbox: %w", err)
	}
	r.mu.Lock()
	if sb, ok := r.sandboxes[h.ID]; ok && !sb.deleted.Load() {
		r.mu.Unlock()
		return nil
	}
	if r.creating[h.ID] {
		r.mu.Unlock()
		return errdefs.New(errdefs.ErrAlreadyExists, "sandbox %q is being created", h.ID)
	}
	// Published locked, so no operation runs before the thaw below.
	sb.op.Lock()
	defer sb.op.Unlock()
	r.sandboxes[h.ID] = sb
	r.mu.Unlock()
	if sb.phase.Load() == phaseLaunched {
		r.watch(sb, int(sb.pid.Load())) // pid 0: it ended while the node was down
	}
	if fsPaused {
		return nil
	}
	r.thawAfterDiff(ctx, sb)
	removeStaleSeeds(ctx, sb)
	if !r.cg.v2 {
		if err := r.restoreMemoryLimit(ctx, sb); err != nil {
			log.G(ctx).Error("restore the memory limit an interrupted reclaim lowered", log.SandboxID(h.ID), log.Err(err))
		}
	}
	return nil
}

// prepared reports whether bundle holds sandbox id as Create prepared it:
// Create's intent record for id names bundle, config.json is there and the
// root is still mounted (a reboot unmounts it).
func (r *Runtime) prepared(id, bundle string) bool {
	var in handleState
	if b, err := os.ReadFile(r.intentPath(id)); err != nil || json.Unmarshal(b, &in) != nil || in.Bundle != bundle {
		return false
	}
	oci := in.ociDir()
	if _, err := os.Stat(filepath.Join(oci, configFile)); err != nil {
		return false
	}
	var b, root unix.Stat_t
	if unix.Stat(oci, &b) != nil || unix.Stat(filepath.Join(oci, rootfsDir), &root) != nil {
		return false
	}
	return b.Dev != root.Dev
}

// AgentConn dials the agent's unix socket StateDir/run/agent.sock. Paths
// longer than sun_path (108 bytes) are reached through /proc/self/fd.
func (r *Runtime) AgentConn(ctx context.Context, id string) (net.Conn, error) {
	sb, err := r.get(id)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(sb.st.ociDir(), runDir)
	c, err := dialUnix(ctx, dir, agentSocketName)
	if err != nil {
		// Not started yet, stopped, or the agent is restarting: retryable.
		return nil, fmt.Errorf("dial agent: %w: %w", errdefs.ErrUnavailable, err)
	}
	return c, nil
}

// listenUnixAt makes the agent's listening socket dir/name (replacing a stale
// one from an earlier, failed start), mode 0600, through an O_PATH handle of
// dir so that its length never matters (sun_path holds 108 bytes). The
// caller passes the returned file to the sandbox and closes its copy.
func listenUnixAt(dir, name string) (*os.File, error) {
	dfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open agent socket dir: %w", err)
	}
	defer unix.Close(dfd)
	f, err := unixsock.ListenAt(dfd, name, agentBacklog)
	if err != nil {
		return nil, fmt.Errorf("agent socket: %w", err)
	}
	return f, nil
}

// agentBacklog is the agent socket's accept queue: requests wait there
// while init starts a server (the kernel caps it at net.core.somaxconn).
const agentBacklog = 4096

// dialUnix dials the unix socket dir/name. The sandbox can write to dir, so
// name is opened with O_PATH|O_NOFOLLOW and must be a socket: a symlink
// planted by the sandbox (say, to a host daemon's socket, which connect(2)
// would follow on the host) is refused. The connection goes through
// /proc/self/fd/<n>, which pins that very inode and also keeps the path short
// whatever the length of dir (sun_path holds 108 bytes).
func dialUnix(ctx context.Context, dir, name string) (net.Conn, error) {
	dfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open socket dir: %w", err)
	}
	defer unix.Close(dfd)
	fd, err := unix.Openat(dfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open socket: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("stat socket: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "%s is not a socket (mode %#o): refusing to follow it", filepath.Join(dir, name), st.Mode)
	}
	var d net.Dialer
	return d.DialContext(ctx, "unix", fmt.Sprintf("/proc/self/fd/%d", fd))
}

// applyCPUClass puts every thread of a best-effort sandbox under
// SCHED_IDLE: init and whatever it started already (runc returns once init
// runs, so the agent may be up), until none is left; what they start later
// (every exec) inherits the policy.
func (r *Runtime) applyCPUClass(sb *sandbox) error {
	if !sb.bestEffort || sb.pid.Load() <= 0 {
		return nil
	}
	dir := filepath.Join(r.cg.unified, r.cgroupPath(sb.id))
	if !r.cg.v2 {
		dir = filepath.Join(r.cg.v1["cpu"], r.cgroupPath(sb.id)) // its cpu.shares is set there too
	}
	err := sched.SetIdleAll(func() ([]int, error) {
		b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		if err != nil {
			return nil, err
		}
		var pids []int
		for _, f := range strings.Fields(string(b)) {
			if p, err := strconv.Atoi(f); err == nil {
				pids = append(pids, p)
			}
		}
		return pids, nil
	})
	if err != nil {
		return fmt.Errorf("cpu_class best_effort: %w: %w", errdefs.ErrInternal, err)
	}
	return nil
}
