//go:build linux

// Command probe runs inside a sandbox for test/security: it makes the
// system calls and connections a hostile process would and prints one line
// per attempt, "<name>: ok" or "<name>: <error>", so the test reads what the
// kernel (seccomp, capabilities, mounts) answered.
//
//	probe syscalls          unshare, keyctl, bpf, mount, module loading, ...
//	probe ptrace <pid>      PTRACE_ATTACH to pid (then detach)
//	probe agent [token]     HTTP to the agent's socket, as the node would
//	probe dial <addr>...    TCP connect to each addr (1 s each)
//	probe lookup <name>...  resolve through /etc/resolv.conf
//	probe dns-direct <server> <name>  one UDP query straight to server
package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: probe syscalls|ptrace <pid>|agent [token]|dial <addr>...")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "syscalls":
		syscalls()
	case "ptrace":
		pid, err := strconv.Atoi(os.Args[2])
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		report("ptrace", ptrace(pid))
	case "agent":
		tok := ""
		if len(os.Args) > 2 {
			tok = os.Args[2]
		}
		agent(tok)
	case "lookup":
		for _, n := range os.Args[2:] {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			addrs, err := net.DefaultResolver.LookupHost(ctx, n)
			cancel()
			if err == nil {
				fmt.Printf("lookup %s: %s\n", n, strings.Join(addrs, ","))
				continue
			}
			report("lookup "+n, err)
		}
	case "dns-direct":
		// A raw DNS query for name to server (host:port), bypassing
		// resolv.conf: does the server answer at all?
		report("dns-direct", dnsDirect(os.Args[2], os.Args[3]))
	case "dial":
		for _, a := range os.Args[2:] {
			c, err := net.DialTimeout("tcp", a, time.Second)
			if err == nil {
				c.Close()
			}
			report("dial "+a, err)
		}
	default:
		fmt.Fprintln(os.Stderr, "unknown probe", os.Args[1])
		os.Exit(2)
	}
}

func report(name string, err error) {
	if err == nil {
		fmt.Printf("%s: ok\n", name)
		return
	}
	fmt.Printf("%s: %v\n", name, err)
}

func errnoOf(_, _ uintptr, e unix.Errno) error {
	if e != 0 {
		return e
	}
	return nil
}

func syscalls() {
	report("unshare-user", unix.Unshare(unix.CLONE_NEWUSER))
	report("unshare-mount", unix.Unshare(unix.CLONE_NEWNS))
	report("unshare-net", unix.Unshare(unix.CLONE_NEWNET))
	report("setns", func() error {
		fd, err := unix.Open("/proc/1/ns/mnt", unix.O_RDONLY, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return unix.Setns(fd, unix.CLONE_NEWNS)
	}())
	_, err := unix.KeyctlJoinSessionKeyring("probe")
	report("keyctl", err)
	_, err = unix.AddKey("user", "probe", []byte("x"), unix.KEY_SPEC_PROCESS_KEYRING)
	report("add_key", err)
	// BPF_MAP_CREATE with an empty attribute: EINVAL if the kernel gets to
	// look at it, EPERM if seccomp or capabilities stop it first.
	var attr [64]byte
	report("bpf", errnoOf(unix.Syscall(unix.SYS_BPF, 0, uintptr(unsafe.Pointer(&attr[0])), uintptr(len(attr)))))
	pa := unix.PerfEventAttr{Type: unix.PERF_TYPE_SOFTWARE, Config: unix.PERF_COUNT_SW_CPU_CLOCK}
	pa.Size = uint32(unsafe.Sizeof(pa))
	fd, err := unix.PerfEventOpen(&pa, 0, -1, -1, 0)
	if err == nil {
		unix.Close(fd)
	}
	report("perf_event_open", err)
	report("mount", unix.Mount("tmpfs", "/mnt", "tmpfs", 0, ""))
	report("mount-proc", unix.Mount("proc", "/mnt", "proc", 0, ""))
	report("remount-root", unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND, ""))
	report("umount-proc", unix.Unmount("/proc", unix.MNT_DETACH))
	report("pivot_root", unix.PivotRoot("/tmp", "/tmp"))
	report("chroot-escape", unix.Chroot("/"))
	mod := make([]byte, 4096)
	report("init_module", unix.InitModule(mod, ""))
	report("finit_module", func() error {
		f, err := os.CreateTemp("", "x*.ko")
		if err != nil {
			return err
		}
		defer os.Remove(f.Name())
		defer f.Close()
		if _, err := f.Write(mod); err != nil {
			return err
		}
		return unix.FinitModule(int(f.Fd()), "", 0)
	}())
	report("delete_module", unix.DeleteModule("ext4", 0))
	report("kexec_load", errnoOf(unix.Syscall6(unix.SYS_KEXEC_LOAD, 0, 0, 0, 0, 0, 0)))
	report("reboot", unix.Reboot(unix.LINUX_REBOOT_CMD_CAD_OFF))
	report("swapon", errnoOf(unix.Syscall(unix.SYS_SWAPON, uintptr(unsafe.Pointer(&[]byte("/tmp/none\x00")[0])), 0, 0)))
	report("open_by_handle_at", errnoOf(unix.Syscall6(unix.SYS_OPEN_BY_HANDLE_AT, 0, 0, 0, 0, 0, 0)))
	// Root may make a device node (CAP_MKNOD, as in Docker); the device
	// cgroup refuses to open it.
	report("open-disk", func() error {
		if err := unix.Mknod("/tmp/sda", unix.S_IFBLK|0o600, int(unix.Mkdev(8, 0))); err != nil && err != unix.EEXIST {
			return fmt.Errorf("mknod: %w", err)
		}
		defer os.Remove("/tmp/sda")
		fd, err := unix.Open("/tmp/sda", unix.O_RDONLY, 0)
		if err == nil {
			unix.Close(fd)
		}
		return err
	}())
	report("iopl", errnoOf(unix.Syscall(unix.SYS_IOPL, 3, 0, 0)))
	report("settimeofday", unix.Settimeofday(&unix.Timeval{Sec: 1}))
	report("sethostname", unix.Sethostname([]byte("probe")))
	vs, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM, 0)
	if err == nil {
		unix.Close(vs)
	}
	report("socket-vsock", err)
}

func ptrace(pid int) error {
	if err := unix.PtraceAttach(pid); err != nil {
		return err
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(pid, &ws, unix.WALL, nil); err != nil {
		return fmt.Errorf("attached, then wait: %w", err)
	}
	return unix.PtraceDetach(pid)
}

// agent talks to the agent's socket as the node does: health, the envd
// process list and a file read.
func agent(tok string) {
	const sock = "/run/opendsec/agent.sock"
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	do := func(name, method, path, body string) {
		req, _ := http.NewRequest(method, "http://agent"+path, strings.NewReader(body))
		if body != "" {
			req.Header.Set("Content-Type", "application/json")
		}
		if tok != "" {
			req.Header.Set("X-Access-Token", tok)
		}
		resp, err := hc.Do(req)
		if err != nil {
			report(name, err)
			return
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
		resp.Body.Close()
		if resp.StatusCode >= 300 {
			report(name, fmt.Errorf("http %d %s", resp.StatusCode, strings.TrimSpace(string(b))))
			return
		}
		report(name, nil)
	}
	do("agent-list", http.MethodPost, "/process.Process/List", "{}")
	do("agent-read", http.MethodGet, "/files?path=/etc/hostname", "")
}

// dnsDirect sends one A query for name to server over UDP and waits 2 s
// for any answer.
func dnsDirect(server, name string) error {
	c, err := net.Dial("udp", server)
	if err != nil {
		return err
	}
	defer c.Close()
	q := []byte{0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0}
	for _, l := range strings.Split(strings.TrimSuffix(name, "."), ".") {
		q = append(q, byte(len(l)))
		q = append(q, l...)
	}
	q = append(q, 0, 0, 1, 0, 1)
	if _, err := c.Write(q); err != nil {
		return err
	}
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	b := make([]byte, 512)
	_, err = c.Read(b)
	return err
}
