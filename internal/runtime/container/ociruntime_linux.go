package container

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/osthread"
)

// ociRuntime is the OCI runtime binary that runs the containers: runc or
// crun. Both take the same command line for everything the backend does
// (run/create --detach --preserve-fds --pid-file --bundle, state, start,
// kill --all, resume, delete --force, the global --root, --log and
// --log-format json) and print OCI-compatible `state` JSON; both keep a
// container's state in <root>/<id>. What differs is here:
//
//   - the message of a container that does not exist (runc: "container
//     does not exist"; crun: "error opening file `<root>/<id>/status`: No
//     such file or directory");
//   - the exec fifo of a created container (startCreated): runc's init
//     writes to it and `runc start` reads it; crun's init reads it and
//     `crun start` writes one byte and removes it;
//   - cgroups: crun refuses a hybrid host (cgroup v1 controllers plus a
//     cgroup2 mount at /sys/fs/cgroup/unified: "cgroups in hybrid mode not
//     supported"), so on such a host it runs in a mount namespace where
//     that mount is gone (hideUnified) and sees plain cgroup v1.
type ociRuntime struct {
	// kind is OCIRuntimeRunc or OCIRuntimeCrun.
	kind string
	// path is the binary.
	path string
	// exe is what the node executes: for crun a sealed memfd copy of path
	// (/proc/self/fd/<n>, sealedexe_linux.go), else path.
	exe string
	// exeErr says why crun runs from path, not a sealed copy (nil: it
	// does, or the runtime is runc).
	exeErr error
	// sealed is the sealed copy exe names (nil: none); once it is lost
	// (sealedFile.lost) commands run from path.
	sealed *sealedFile
	// version is the binary's version ("1.8.1").
	version string
	// reason says in one sentence why this runtime runs the containers.
	reason string
	// hideUnified is the hybrid host's cgroup2 mount point (usually
	// /sys/fs/cgroup/unified) when the runtime is crun: every crun command
	// runs where it is unmounted. Empty: nothing hidden.
	hideUnified string
	// hidden is the directory under hideUnified's mount, where crun
	// leaves files (hiddencg_linux.go); nil: none.
	hidden *os.File
	// view is the /sys/fs/cgroup crun runs with (cgview_linux.go); the
	// zero value for runc.
	view cgroupView
	// preload is the libsystemd.so.0 without systemd crun runs with
	// (crunpreload_linux.go); "": none. preloadErr says why one next to
	// the agent is not used.
	preload    string
	preloadErr error
	// env is the runtime's whole environment (crunEnv); nil: the node's.
	env []string
}

// command runs the runtime with args: exe executed (path once the sealed
// copy is lost), path its argv[0].
func (o *ociRuntime) command(ctx context.Context, args ...string) *exec.Cmd {
	return o.commandFrom(ctx, o.exeNow(ctx), args...)
}

// commandFrom runs exe (exe or path) as the runtime with args.
func (o *ociRuntime) commandFrom(ctx context.Context, exe string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Args[0] = o.path
	cmd.Env = o.env
	if o.preload != "" && exe != o.exe {
		// The binary at path may not be the one whose imports the preload
		// was checked against (an upgrade since): as installed.
		cmd.Env = crunEnv("")
	}
	return cmd
}

// exeNow is what to execute now: exe while the sealed copy is intact,
// else path.
func (o *ociRuntime) exeNow(ctx context.Context) string {
	if o.sealed == nil {
		return o.exe
	}
	if o.sealed.lost.Load() {
		return o.path
	}
	if err := o.sealed.check(); err != nil {
		o.loseSealed(ctx, err)
		return o.path
	}
	return o.exe
}

// execFailed reports whether err, from starting cmd, is the kernel
// refusing to execute the sealed copy: nothing ran, so the caller makes
// the command again from path (commandFrom) and starts it once more. A
// copy whose fd is no longer the copy is lost for good; an intact one
// stays in use (this kernel refuses about one exec of it in a thousand
// with EACCES, the fd unchanged).
func (o *ociRuntime) execFailed(ctx context.Context, cmd *exec.Cmd, err error) bool {
	var pe *fs.PathError
	if o.sealed == nil || cmd.Path != o.exe || !errors.As(err, &pe) || pe.Op != "fork/exec" {
		return false
	}
	if cerr := o.sealed.check(); cerr != nil {
		o.loseSealed(ctx, fmt.Errorf("execute %s: %w (%w)", o.exe, pe.Err, cerr))
		return true
	}
	log.G(ctx).Warn("the kernel refused to execute crun's sealed copy; this command runs from the path", "exe", o.exe, "path", o.path, "fd", o.sealed.describe(), log.Err(pe.Err))
	return true
}

// loseSealed makes every later command run from path, and says so once.
func (o *ociRuntime) loseSealed(ctx context.Context, err error) {
	if o.sealed.lost.CompareAndSwap(false, true) {
		log.G(ctx).Warn("crun runs from its path from now on, not from its sealed memfd copy: every crun command copies itself first, which costs CPU on each create", "path", o.path, log.Err(err))
	}
}

// String is the runtime's name and version, as in Info ("crun 1.8.1").
func (o *ociRuntime) String() string { return o.kind + " " + o.version }

// notFound reports whether msg (the runtime's stderr) says the container
// does not exist.
func (o *ociRuntime) notFound(msg string) bool {
	if o.kind == OCIRuntimeCrun {
		return strings.Contains(msg, "/status`: No such file or directory") || strings.Contains(msg, "does not exist")
	}
	return strings.Contains(msg, "does not exist") || strings.Contains(msg, "not exist")
}

// startCreated lets the created container whose state dir is dir and whose
// init is pid run, without starting the runtime's binary: what `runc
// start` or `crun start` does with the exec fifo. errNoExecFifo: dir has
// none (the caller runs `<runtime> start`).
func (o *ociRuntime) startCreated(ctx context.Context, dir string, pid int) error {
	if o.kind == OCIRuntimeCrun {
		return crunStartViaExecFifo(dir, pid)
	}
	return startViaExecFifo(ctx, dir, pid)
}

// crunStartViaExecFifo does what `crun start` does (libcrun's
// libcrun_status_write_exec_fifo): crun's init holds the exec fifo open for
// reading and waits for a byte; the writer removes the fifo, which is what
// makes `crun state` report the container running. The open does not
// block: with no reader (init gone, or started already) it fails.
func crunStartViaExecFifo(dir string, pid int) error {
	path := filepath.Join(dir, execFifo)
	if st, err := os.Lstat(path); err != nil || st.Mode()&os.ModeNamedPipe == 0 {
		return errNoExecFifo
	}
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENXIO) {
		return errdefs.New(errdefs.ErrFailedPrecondition, "container init (pid %d) is gone or already started", pid)
	}
	if err != nil {
		return fmt.Errorf("open exec fifo: %w", err)
	}
	defer unix.Close(fd)
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("remove exec fifo: %w", err)
	}
	for {
		_, err := unix.Write(fd, []byte{0})
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("write exec fifo: %w", err)
		}
		return nil
	}
}

// ociSpecVersion is config.json's ociVersion. The spec the backend writes
// uses nothing past runtime-spec 1.0.2, which runc 1.1 implements; crun
// 1.8 refuses the Go module's own version (1.2.x: "unknown version
// specified").
const ociSpecVersion = "1.0.2"

// crunExtraDevices are the device rules crun adds to every container's
// devices cgroup that runc does not: /dev/console (c 5:1), which in a
// container without a terminal is the host's system console (a root
// sandbox process with CAP_MKNOD could make the node, write to the host's
// console and read what is typed there). runc allows /dev/net/tun (c
// 10:200) instead, which is useless without CAP_NET_ADMIN.
var crunExtraDevices = []string{"c 5:1 rwm"}

// afterInit runs once the runtime made the container, before anything of
// the sandbox runs (its init waits on the exec fifo, or has not been
// given a request yet): for crun on cgroup v1 it takes back the device
// rules crun adds to runc's (crunExtraDevices), so both give a sandbox the
// same devices. On cgroup v2 crun compiles its rules into an eBPF program
// whose defaults win over config.json's: there the sandboxes' parent
// cgroup carries a program refusing /dev/console, which the kernel runs
// beside crun's (crunOn, bpfdevice_linux.go).
func (o *ociRuntime) afterInit(cg cgroupMounts, cgroupPath string) error {
	if o.kind != OCIRuntimeCrun || cg.v2 {
		return nil
	}
	mnt := cg.v1["devices"]
	if mnt == "" {
		return nil
	}
	f := filepath.Join(mnt, cgroupPath, "devices.deny")
	for _, rule := range crunExtraDevices {
		if err := os.WriteFile(f, []byte(rule), 0); err != nil {
			return fmt.Errorf("deny %q in the devices cgroup crun made: %w", rule, err)
		}
	}
	return nil
}

// minCrunVersion is the oldest crun the backend uses (Debian 12's).
var minCrunVersion = [2]int{1, 8}

var crunVersionRE = regexp.MustCompile(`(?m)^crun version (\d+)\.(\d+)(\.\d+)?`)

// chooseOCIRuntime picks the OCI runtime from the config: runc or crun as
// named, or with auto crun where it is installed and its probe passes,
// else runc. cg is the host's cgroups. An explicit crun that cannot work
// is an error naming container.oci_runtime and the fix.
func chooseOCIRuntime(cfg *Config, cg cgroupMounts) (*ociRuntime, error) {
	hybrid := ""
	if !cg.v2 {
		hybrid = cg.unified
	}
	switch cfg.OCIRuntime {
	case OCIRuntimeRunc:
		return runcRuntime(cfg, "container.oci_runtime is runc")
	case OCIRuntimeCrun:
		o, err := crunOn(cfg, cg, hybrid)
		if err != nil {
			return nil, errdefs.New(errdefs.ErrFailedPrecondition,
				"container.oci_runtime is crun but crun cannot run containers here: %v; install it (apt-get install crun, version %d.%d or later), set container.crun_path, or set container.oci_runtime to auto or runc", err, minCrunVersion[0], minCrunVersion[1])
		}
		o.reason = "container.oci_runtime is crun"
		return o, nil
	}
	o, err := crunOn(cfg, cg, hybrid)
	if err == nil {
		o.reason = "container.oci_runtime auto: crun " + o.version + " is installed and ran a probe container (a create costs about a third of runc's CPU)"
		return o, nil
	}
	return runcRuntime(cfg, "container.oci_runtime auto: crun is not usable ("+err.Error()+")")
}

// crunOn is probeCrun on this host's cgroups: on cgroup v2 the sandboxes'
// parent first gets the device program that refuses /dev/console
// (denyConsoleBPF), which crun's own device program allows, so the probe
// runs under it as the sandboxes will.
func crunOn(cfg *Config, cg cgroupMounts, hybrid string) (*ociRuntime, error) {
	if cg.v2 {
		if _, err := crunRuntime(cfg, ""); err != nil {
			return nil, err // not installed: nothing to attach for
		}
		if err := denyConsoleBPF(filepath.Join(cg.unified, cfg.CgroupParent)); err != nil {
			return nil, fmt.Errorf("crun allows /dev/console in every container and the node cannot refuse it on cgroup v2: %w", err)
		}
	}
	return probeCrun(cfg, cg, hybrid)
}

// runcRuntime is runc at cfg.RuncPath.
func runcRuntime(cfg *Config, reason string) (*ociRuntime, error) {
	path, err := exec.LookPath(cfg.RuncPath)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition,
			"container.runc_path: runc binary %q not found (install it: apt-get install runc): %v", cfg.RuncPath, err)
	}
	out, err := exec.Command(path, "--version").Output()
	if err != nil {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "container.runc_path: run %s --version: %w", path, err)
	}
	version := strings.TrimPrefix(strings.SplitN(string(out), "\n", 2)[0], "runc version ")
	return &ociRuntime{kind: OCIRuntimeRunc, path: path, exe: path, version: version, reason: reason, env: crunEnv("")}, nil
}

// probeCrun finds crun at cfg.CrunPath, checks its version and has it
// create (not start) a container of an empty root in a cgroup under
// cfg.CgroupParent, then removes it: what a sandbox's create needs of it
// (namespaces, mounts, pivot_root, cgroup v1 or v2 limits) on this host.
func probeCrun(cfg *Config, cg cgroupMounts, hybrid string) (*ociRuntime, error) {
	o, err := crunRuntime(cfg, hybrid)
	if err != nil {
		return nil, err
	}
	o.view = cg.crunCgroupView(hybrid)
	if hybrid != "" {
		if o.hidden, err = o.openHiddenDir(); err != nil {
			return nil, err
		}
	}
	o.sweepProbes(cfg, cg)
	if err := o.probe(cfg); err != nil {
		if o.preload == "" {
			return nil, err
		}
		// Then without it: crun may need more of libsystemd than the
		// symbols it names.
		o.preloadErr = fmt.Errorf("crun's probe failed with %s preloaded: %w", o.preload, err)
		o.preload, o.env = "", crunEnv("")
		if err := o.probe(cfg); err != nil {
			return nil, err
		}
	}
	return o, nil
}

// crunRuntime is crun at cfg.CrunPath, checked to be 1.8 or later, run
// from a sealed memfd copy where one can be made and runs (else from its
// path; exeErr says why).
func crunRuntime(cfg *Config, hybrid string) (*ociRuntime, error) {
	path, err := exec.LookPath(cfg.CrunPath)
	if err != nil {
		return nil, fmt.Errorf("crun binary %q not found: %w", cfg.CrunPath, err)
	}
	sealed, exeErr := sealedExe(path)
	exe := path
	var out []byte
	if exeErr == nil {
		exe = fdPath(sealed.f)
		cmd := exec.Command(exe, "--version")
		cmd.Args[0] = path
		if out, err = cmd.Output(); err != nil {
			exeErr = fmt.Errorf("run the sealed copy %s --version: %w", exe, err)
		}
	}
	if exeErr != nil {
		exe, sealed = path, nil
		if out, err = exec.Command(path, "--version").Output(); err != nil {
			return nil, fmt.Errorf("run %s --version: %w", path, err)
		}
	}
	m := crunVersionRE.FindStringSubmatch(string(out))
	if m == nil {
		return nil, fmt.Errorf("%s --version printed no crun version: %q", path, strings.SplitN(string(out), "\n", 2)[0])
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	version := strings.TrimPrefix(strings.Fields(strings.SplitN(string(out), "\n", 2)[0])[2], "v")
	if major < minCrunVersion[0] || major == minCrunVersion[0] && minor < minCrunVersion[1] {
		return nil, fmt.Errorf("crun %s is older than %d.%d", version, minCrunVersion[0], minCrunVersion[1])
	}
	o := &ociRuntime{kind: OCIRuntimeCrun, path: path, exe: exe, exeErr: exeErr, sealed: sealed, version: version, hideUnified: hybrid}
	if cfg.AgentPath != "" && sealed != nil {
		// Only for the sealed copy: the binary at path can change under
		// the node (see commandFrom).
		o.preload, o.preloadErr = crunPreload(path, filepath.Join(filepath.Dir(cfg.AgentPath), CrunLibsystemdName))
	}
	o.env = crunEnv(o.preload)
	return o, nil
}

// probe creates and deletes a container: a root of nothing but init's
// binary, a memory and pids limit in <CgroupParent>/<probe id>.
func (o *ociRuntime) probe(cfg *Config) error {
	// The node's pid in the name: a node that dies mid-probe leaves the
	// dir, and the next one's sweepProbes knows it for a dead node's.
	dir, err := os.MkdirTemp("", probeDirPrefix+strconv.Itoa(os.Getpid())+".")
	if err != nil {
		return fmt.Errorf("make probe bundle: %w", err)
	}
	defer os.RemoveAll(dir)
	id := probeIDPrefix + strconv.Itoa(os.Getpid())
	if err := writeProbeBundle(cfg, dir, id); err != nil {
		return err
	}
	root := filepath.Join(dir, "state")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	run := o.probeRunner(ctx, dir, root)
	createErr := run("create", "--bundle", dir, id)
	if err := run("delete", "--force", id); err != nil && createErr == nil {
		return fmt.Errorf("probe container: %w", err)
	}
	cgroupsPath := filepath.Join(filepath.Dir(cfg.CgroupParent), id)
	if err := o.dropHidden(cgroupsPath, filepath.Dir(cgroupsPath)); err != nil {
		return fmt.Errorf("probe container: %w", err)
	}
	if createErr != nil {
		return fmt.Errorf("probe container: %w", createErr)
	}
	return nil
}

// writeProbeBundle writes the probe container id's bundle into dir: a
// root of nothing but init's binary, a memory and pids limit in
// <CgroupParent's parent>/<id>.
func writeProbeBundle(cfg *Config, dir, id string) error {
	rootfs := filepath.Join(dir, "rootfs")
	for _, d := range []string{rootfs, filepath.Join(rootfs, "dev"), filepath.Join(rootfs, "proc")} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return fmt.Errorf("make probe bundle: %w", err)
		}
	}
	if err := os.WriteFile(filepath.Join(rootfs, "init"), nil, 0o755); err != nil { //nolint:gosec // the bind mount's target
		return fmt.Errorf("make probe bundle: %w", err)
	}
	limit, pids := int64(64<<20), int64(16)
	spec := map[string]any{
		"ociVersion": ociSpecVersion,
		"process": map[string]any{
			"args": []string{"/init"}, "cwd": "/", "user": map[string]int{"uid": 0, "gid": 0},
			"noNewPrivileges": true,
		},
		"root":     map[string]any{"path": rootfs, "readonly": true},
		"hostname": "probe",
		"mounts": []map[string]any{
			{"destination": "/proc", "type": "proc", "source": "proc"},
			{"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": []string{"nosuid", "mode=755", "size=64k"}},
			{"destination": "/init", "type": "bind", "source": cfg.InitPath, "options": []string{"bind", "ro"}},
		},
		"linux": map[string]any{
			// Beside the sandboxes' parent, not in it: the probe's killed
			// init stays a zombie until the host's PID 1 reaps it (seconds
			// on a loaded host), and a zombie counts in the pids.current of
			// every cgroup above its own, removed, one: in the parent it
			// would hold one of node.total_pids_limit's pids and show as a
			// sandbox's (TestSecurityPidsLimit saw 4 x 64 + 1).
			"cgroupsPath": filepath.Join(filepath.Dir(cfg.CgroupParent), id), // as cgroupsPath below
			"resources": map[string]any{
				"memory":  map[string]any{"limit": limit, "swap": limit},
				"pids":    map[string]any{"limit": pids},
				"devices": []map[string]any{{"allow": false, "access": "rwm"}},
			},
			"namespaces": []map[string]string{{"type": "pid"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"}, {"type": "network"}},
		},
	}
	b, err := json.Marshal(spec)
	if err != nil {
		return fmt.Errorf("encode probe config.json: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, configFile), b, 0o600); err != nil {
		return fmt.Errorf("write probe config.json: %w", err)
	}
	return nil
}

// probeRunner returns a function that runs the runtime with --root root
// and args, in the runtime's cgroup view, its output in a file under dir
// (files, not pipes: a created container's init would hold them).
func (o *ociRuntime) probeRunner(ctx context.Context, dir, root string) func(args ...string) error {
	return func(args ...string) error {
		out, err := os.CreateTemp(dir, "out.")
		if err != nil {
			return fmt.Errorf("make probe output file: %w", err)
		}
		defer out.Close()
		mk := func(exe string) *exec.Cmd {
			cmd := o.commandFrom(ctx, exe, append([]string{"--root", root}, args...)...)
			cmd.Stdout, cmd.Stderr = out, out
			cmd.WaitDelay = time.Second
			return cmd
		}
		return o.inCgroupView(func() error {
			cmd := mk(o.exeNow(ctx))
			err := cmd.Run()
			if err != nil && o.execFailed(ctx, cmd, err) {
				err = mk(o.path).Run()
			}
			if err != nil {
				b, _ := os.ReadFile(out.Name())
				return fmt.Errorf("%s %s: %w: %s", o.kind, args[0], err, strings.TrimSpace(string(b)))
			}
			return nil
		})
	}
}

// inCgroupView runs fn (which starts and waits for the runtime) where the
// runtime sees the cgroups it should: for crun on a cgroup v1 or hybrid
// host, on a thread in a private copy of the caller's mount namespace
// with crun's view of /sys/fs/cgroup (o.view: without the cgroup2 mount,
// which crun refuses, and the cpuset hierarchy); else where it is called.
func (o *ociRuntime) inCgroupView(fn func() error) error {
	if o.view.root == "" && o.view.unified == "" {
		return fn()
	}
	c := make(chan error, 1)
	osthread.Throwaway(func() {
		if err := unshareView(o.view); err != nil {
			c <- err
			return
		}
		c <- fn()
	})
	return <-c
}

// unshareView moves the calling (locked) thread into a private copy of
// its mount namespace with view applied.
func unshareView(view cgroupView) error {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare mount namespace: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mount namespace private: %w", err)
	}
	return view.apply()
}

// hideMount unmounts the cgroup2 mount unified in the calling thread's
// (private) mount namespace, so crun sees plain cgroup v1.
func hideMount(unified string) error {
	if err := unix.Unmount(unified, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s for crun: %w", unified, err)
	}
	return nil
}

// stateFileOf is the file runtime kind keeps a container's state in, in
// <state_root>/<id>.
func stateFileOf(kind string) string {
	if kind == OCIRuntimeCrun {
		return "status"
	}
	return "state.json"
}

// otherOCI is the runtime that is not the node's choice, for containers
// it made before container.oci_runtime changed (runc's from before crun
// was the default, or crun's after a change back to runc): made on first
// use.
type otherOCI struct {
	once sync.Once
	oci  *ociRuntime // nil: not usable here
}

// ociFor returns the runtime of container id under root: the node's
// choice, or the other one when the container's state dir holds the other
// one's state file (it made the container, and only it can read its
// state). Each container keeps the runtime that made it until it is
// deleted; new containers get the node's choice.
func (r *Runtime) ociFor(ctx context.Context, root, id string) *ociRuntime {
	if id == "" || strings.ContainsRune(id, '/') {
		return r.oci
	}
	dir := filepath.Join(root, id)
	if _, err := os.Lstat(filepath.Join(dir, stateFileOf(r.oci.kind))); err == nil {
		return r.oci
	}
	other := OCIRuntimeCrun
	if r.oci.kind == OCIRuntimeCrun {
		other = OCIRuntimeRunc
	}
	if _, err := os.Lstat(filepath.Join(dir, stateFileOf(other))); err != nil {
		return r.oci
	}
	r.other.once.Do(func() {
		var o *ociRuntime
		var err error
		if other == OCIRuntimeRunc {
			o, err = runcRuntime(&r.cfg, "made the container before container.oci_runtime chose "+r.oci.kind)
		} else {
			hide := ""
			if !r.cg.v2 {
				hide = r.cg.unified
			}
			o, err = crunRuntime(&r.cfg, hide)
			if o != nil {
				o.reason = "made the container before container.oci_runtime chose " + r.oci.kind
				// Unprobed here: as before the view and the preload,
				// only the cgroup2 mount hidden.
				o.view = cgroupView{unified: hide}
				o.preload, o.env = "", crunEnv("")
			}
		}
		if err != nil {
			log.G(ctx).Error("containers made by "+other+" are in the state root but "+other+" cannot run here: they cannot be stopped or deleted until it is installed", "state_root", root, log.Err(err))
			return
		}
		log.G(ctx).Info("containers made by "+other+" are in the state root: "+other+" handles them until they are deleted", "state_root", root, "version", o.version)
		r.other.oci = o
	})
	if r.other.oci == nil {
		return r.oci
	}
	return r.other.oci
}
