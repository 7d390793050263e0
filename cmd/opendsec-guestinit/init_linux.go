package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/vmchan"
)

const agentSock = "/run/opendsec/agent.sock"

func run() int {
	for _, m := range []struct{ src, dst, fs string }{
		{"proc", "/proc", "proc"}, {"sysfs", "/sys", "sysfs"}, {"devtmpfs", "/dev", "devtmpfs"}, {"tmpfs", "/run", "tmpfs"},
	} {
		_ = os.MkdirAll(m.dst, 0o755)
		if err := unix.Mount(m.src, m.dst, m.fs, 0, ""); err != nil && err != unix.EBUSY {
			logf("mount " + m.dst + ": " + err.Error())
		}
	}
	// Terminals for the agent's PTY processes, and POSIX shared memory:
	// devtmpfs has /dev/ptmx but neither. They move into the sandbox's
	// root with /dev.
	for _, m := range []struct{ src, dst, fs, opts string }{
		{"devpts", "/dev/pts", "devpts", "ptmxmode=0666,mode=0620,gid=5"},
		{"shm", "/dev/shm", "tmpfs", "mode=1777"},
	} {
		_ = os.MkdirAll(m.dst, 0o755)
		if err := unix.Mount(m.src, m.dst, m.fs, unix.MS_NOSUID|unix.MS_NOEXEC, m.opts); err != nil && err != unix.EBUSY {
			logf("mount " + m.dst + ": " + err.Error())
		}
	}
	cl, _ := os.ReadFile("/proc/cmdline")
	args := parseCmdline(string(cl))
	loadModules("/lib/modules")
	if h := args["hostname"]; h != "" {
		if err := unix.Sethostname([]byte(h)); err != nil {
			logf("hostname: " + err.Error())
		}
	}
	if err := setupLoopback(); err != nil {
		logf("network: " + err.Error())
	}
	if args["ip"] != "" {
		if err := configureNet(args["mac"], args["ip"], args["gw"]); err != nil {
			logf("network: " + err.Error())
		}
	}
	var cfg vmchan.GuestConfig
	if d := args["config"]; d != "" {
		var err error
		if cfg, err = readConfig("/dev/" + d); err != nil {
			logf(err.Error())
		}
	}
	agentBin := "/bin/opendsec-agent"
	if n := args["layers"]; n != "" && n != "0" {
		if err := switchRoot(args); err != nil {
			// Without its image the sandbox is useless: say why and stop.
			logf("rootfs: " + err.Error())
			halt(args)
		}
		agentBin = agentInRoot
	}
	if err := writeResolvConf(cfg.Nameservers); err != nil {
		logf("resolv.conf: " + err.Error())
	}
	_ = os.MkdirAll("/run/opendsec", 0o755)
	sig := make(chan os.Signal, 4)
	// SIGINT is Ctrl-Alt-Del (Firecracker's SendCtrlAltDel) with the
	// kernel's C-A-D off.
	signal.Notify(sig, unix.SIGTERM, unix.SIGPWR, unix.SIGINT, unix.SIGCHLD)
	if err := startAgent(agentBin, cfg); err != nil {
		logf("agent: " + err.Error())
	} else {
		serve := serveAgentPort
		if args["agent"] == "vsock" {
			// The microvm backend (Firecracker): vsock, no virtio-serial.
			serve = serveAgentVsock
		}
		go func() {
			if err := serve(context.Background(), agentSock); err != nil {
				logf("agent port: " + err.Error())
			}
		}()
	}
	for s := range sig {
		if s == unix.SIGCHLD {
			reap()
			continue
		}
		halt(args)
	}
	return 0
}

// halt ends the VM: a power-off, or with opendsec.poweroff=reboot a
// reboot (Firecracker, started with reboot=k, exits on a guest reboot and
// has no power-off).
func halt(args bootArgs) {
	if args["poweroff"] == "reboot" {
		unix.Sync()
		_ = unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	}
	poweroff()
}

// startAgent makes the agent's listening socket and starts the agent on it
// (--listen-fd), so connections made before the agent serves wait in the
// socket's queue rather than fail.
func startAgent(bin string, cfg vmchan.GuestConfig) error {
	_ = os.Remove(agentSock)
	l, err := net.Listen("unix", agentSock)
	if err != nil {
		return fmt.Errorf("agent socket: %w", err)
	}
	ul := l.(*net.UnixListener)
	ul.SetUnlinkOnClose(false)
	f, err := ul.File()
	if err != nil {
		return fmt.Errorf("agent socket: %w", err)
	}
	_ = l.Close() // f is a dup; the socket stays open through it
	user := cfg.User
	if user == "" {
		user = "root"
	}
	argv := []string{"--listen-fd", "3", "--default-user", user}
	if cfg.Workdir != "" {
		argv = append(argv, "--default-workdir", cfg.Workdir)
	}
	agent := exec.Command(bin, argv...)
	agent.Stdout, agent.Stderr = os.Stderr, os.Stderr
	agent.ExtraFiles = []*os.File{f}
	agent.Env = agentEnv(cfg.Env)
	err = agent.Start()
	_ = f.Close()
	return err
}

// agentEnv is the agent's environment: env, with PATH and HOME defaulted.
func agentEnv(env []string) []string {
	out := append([]string(nil), env...)
	for _, d := range []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"} {
		k, _, _ := strings.Cut(d, "=")
		if !slices.ContainsFunc(out, func(e string) bool { return strings.HasPrefix(e, k+"=") }) {
			out = append(out, d)
		}
	}
	return out
}

// loadModules loads dir/order's modules with finit_module(2), in order; one
// that is already there (EEXIST) is fine.
func loadModules(dir string) {
	b, err := os.ReadFile(dir + "/order")
	if err != nil {
		logf("modules: " + err.Error())
		return
	}
	for _, n := range strings.Fields(string(b)) {
		f, err := os.Open(dir + "/" + n + ".ko")
		if err != nil {
			logf("module " + n + ": " + err.Error())
			continue
		}
		if err := unix.FinitModule(int(f.Fd()), "", 0); err != nil && err != unix.EEXIST {
			logf("module " + n + ": " + err.Error())
		}
		_ = f.Close()
	}
}

func reap() {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}

func poweroff() {
	unix.Sync()
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
}
