//go:build linux

// Command fcstandin stands in for Firecracker's jailer and firecracker
// binaries in the microvm backend's process tests, on hosts where no guest
// boots. Run as "jailer" it does what the jailer does with the arguments
// the backend gives (copies --exec-file into <chroot-base>/<name>/<id>/root,
// joins --netns, makes the --cgroup settings under --parent-cgroup/<id>,
// makes dev/kvm and dev/net/tun there, chroots in a new mount namespace,
// writes /<name>.pid, drops to --uid/--gid and execs the copy). Run as
// "firecracker" it serves fcfake's API on --api-sock; at InstanceStart (or
// a load that resumes) it serves the vsock socket like Firecracker's muxer
// with a stand-in agent behind port 1024 (GET /health, POST
// /opendsec/identity, GET /standin); SendCtrlAltDel ends it with 0 (the
// guest powered off) and a failed InstanceStart with 1, as Firecracker.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/runtime/microvm/fcfake"
)

func main() {
	var err error
	if filepath.Base(os.Args[0]) == "jailer" {
		err = jailer(os.Args[1:])
	} else {
		err = firecracker(os.Args[1:])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fcstandin:", err)
		os.Exit(1)
	}
}

func jailer(args []string) error {
	opt := map[string]string{}
	var cgroups, extra []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			extra = args[i+1:]
			break
		}
		if !strings.HasPrefix(a, "--") || i+1 >= len(args) {
			return fmt.Errorf("jailer: argument %q", a)
		}
		if a == "--cgroup" {
			cgroups = append(cgroups, args[i+1])
		} else {
			opt[a[2:]] = args[i+1]
		}
		i++
	}
	for _, k := range []string{"id", "exec-file", "uid", "gid", "cgroup-version"} {
		if opt[k] == "" {
			return fmt.Errorf("jailer: --%s is required", k)
		}
	}
	uid, _ := strconv.Atoi(opt["uid"])
	gid, _ := strconv.Atoi(opt["gid"])
	name := filepath.Base(opt["exec-file"])
	base := opt["chroot-base-dir"]
	if base == "" {
		base = "/srv/jailer"
	}
	root := filepath.Join(base, name, opt["id"], "root")
	if err := os.MkdirAll(root, 0o700); err != nil {
		return err
	}
	b, err := os.ReadFile(opt["exec-file"])
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(root, name), b, 0o755); err != nil {
		return err
	}
	goruntime.LockOSThread() // namespaces below are this thread's, and exec keeps them
	if ns := opt["netns"]; ns != "" {
		f, err := os.Open(ns)
		if err != nil {
			return err
		}
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("join netns %s: %w", ns, err)
		}
		_ = f.Close()
	}
	parent := opt["parent-cgroup"]
	if parent == "" {
		parent = name
	}
	if err := setupCgroups(opt["cgroup-version"], parent, opt["id"], cgroups); err != nil {
		return err
	}
	if err := unix.Unshare(unix.CLONE_NEWNS | unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("mount slave: %w", err)
	}
	if err := unix.Chroot(root); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	for _, d := range []string{"/", "/dev", "/dev/net", "/run"} {
		_ = os.MkdirAll(d, 0o700)
		if err := os.Chown(d, uid, gid); err != nil {
			return err
		}
	}
	for _, dev := range []struct {
		path         string
		major, minor uint32
	}{{"/dev/kvm", 10, 232}, {"/dev/net/tun", 10, 200}} {
		if err := unix.Mknod(dev.path, unix.S_IFCHR|0o600, int(unix.Mkdev(dev.major, dev.minor))); err != nil && err != unix.EEXIST {
			return fmt.Errorf("mknod %s: %w", dev.path, err)
		}
		if err := os.Chown(dev.path, uid, gid); err != nil {
			return err
		}
	}
	pf, err := os.OpenFile("/"+name+".pid", os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	_, _ = fmt.Fprint(pf, os.Getpid())
	_ = pf.Close()
	if err := syscall.Setgroups(nil); err != nil {
		return err
	}
	if err := syscall.Setresgid(gid, gid, gid); err != nil {
		return err
	}
	if err := syscall.Setresuid(uid, uid, uid); err != nil {
		return err
	}
	argv := append([]string{"/" + name, "--id", opt["id"], "--start-time-us", "0", "--start-time-cpu-us", "0", "--parent-cpu-time-us", "0"}, extra...)
	return syscall.Exec("/"+name, argv, os.Environ())
}

func setupCgroups(version, parent, id string, settings []string) error {
	for _, s := range settings {
		file, value, ok := strings.Cut(s, "=")
		if !ok || value == "" {
			return fmt.Errorf("jailer: --cgroup %q", s)
		}
		ctrl, _, _ := strings.Cut(file, ".")
		dir := filepath.Join("/sys/fs/cgroup", parent, id)
		if version == "1" {
			dir = filepath.Join("/sys/fs/cgroup", ctrl, parent, id)
		} else {
			_ = os.MkdirAll(filepath.Dir(dir), 0o755)
			_ = os.WriteFile(filepath.Join("/sys/fs/cgroup", "cgroup.subtree_control"), []byte("+"+ctrl), 0o644)
			_ = os.WriteFile(filepath.Join(filepath.Dir(dir), "cgroup.subtree_control"), []byte("+"+ctrl), 0o644)
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, file), []byte(value), 0o644); err != nil {
			return fmt.Errorf("cgroup %s: %w", s, err)
		}
		// cgroup.procs, not v1's tasks as the (single-threaded) jailer:
		// this process has threads, and the one that execs must move too.
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
			return fmt.Errorf("cgroup %s join: %w", dir, err)
		}
	}
	return nil
}

func firecracker(args []string) error {
	opt := map[string]string{}
	for i := 0; i+1 < len(args); i += 2 {
		opt[strings.TrimPrefix(args[i], "--")] = args[i+1]
	}
	sock := opt["api-sock"]
	if sock == "" {
		return fmt.Errorf("firecracker: --api-sock is required")
	}
	_ = os.Remove(sock)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	s := fcfake.NewServer(opt["id"])
	a := &agent{}
	s.OnStart = a.serve
	s.OnStartFailed = func() { os.Exit(1) }
	s.OnCtrlAltDel = func() { os.Exit(0) }
	// A hostile VMM: with /hostile-snapshot in its chroot, it swaps the
	// memory file it wrote for a symlink to the path that file names.
	s.OnSnapshot = func(_, mem string) {
		if target, err := os.ReadFile("/hostile-snapshot"); err == nil {
			_ = os.Remove(mem)
			_ = os.Symlink(strings.TrimSpace(string(target)), mem)
		}
	}
	return http.Serve(ln, s)
}

// agent is the guest side of the vsock device: Firecracker's host socket
// muxer ("CONNECT <port>\n" answered "OK <port>\n") with a stand-in agent
// on port 1024.
type agent struct {
	mem      []byte
	mu       sync.Mutex
	hostname string
	started  bool
}

// dirtyPages are the guest pages a loaded stand-in writes: its own
// copies, the rest of the memory file's pages it only reads (shared).
const dirtyPages = 256

func (a *agent) serve(st fcfake.VMState) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if st.MemFile != "" && a.mem == nil {
		// As Firecracker's File backend: the memory file mapped private.
		// The stand-in guest reads all of it and writes dirtyPages.
		f, err := os.Open(st.MemFile)
		if err != nil {
			return err
		}
		mem, err := unix.Mmap(int(f.Fd()), 0, int(st.MemMiB<<20), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
		_ = f.Close()
		if err != nil {
			return fmt.Errorf("map guest memory: %w", err)
		}
		var sum byte
		for i := 0; i < len(mem); i += 4096 {
			sum += mem[i]
		}
		for i := range dirtyPages {
			mem[i*4096] = sum + 1
		}
		a.mem = mem
	}
	if st.VsockUDS == "" || a.started {
		return nil
	}
	_ = os.Remove(st.VsockUDS)
	ln, err := net.Listen("unix", st.VsockUDS)
	if err != nil {
		return err
	}
	a.started = true
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	mux.HandleFunc("POST /opendsec/identity", func(w http.ResponseWriter, r *http.Request) {
		var id struct {
			Hostname string `json:"hostname"`
		}
		if err := json.NewDecoder(r.Body).Decode(&id); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		a.mu.Lock()
		a.hostname = id.Hostname
		a.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("GET /standin", func(w http.ResponseWriter, _ *http.Request) {
		a.mu.Lock()
		defer a.mu.Unlock()
		_ = json.NewEncoder(w).Encode(map[string]any{"uid": os.Getuid(), "gid": os.Getgid(), "hostname": a.hostname, "tap": st.Tap, "mem_mib": st.MemMiB})
	})
	conns := make(chan net.Conn)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				br := bufio.NewReader(c)
				line, err := br.ReadString('\n')
				if err != nil || strings.TrimSpace(line) != "CONNECT 1024" {
					_ = c.Close() // no listener on that port in the guest
					return
				}
				if _, err := io.WriteString(c, "OK 1073741824\n"); err != nil {
					_ = c.Close()
					return
				}
				conns <- &bufConn{Conn: c, r: br}
			}()
		}
	}()
	go func() { _ = http.Serve(&chanListener{c: conns, addr: ln.Addr()}, mux) }()
	return nil
}

type bufConn struct {
	net.Conn
	r *bufio.Reader
}

func (b *bufConn) Read(p []byte) (int, error) { return b.r.Read(p) }

type chanListener struct {
	c    chan net.Conn
	addr net.Addr
}

func (l *chanListener) Accept() (net.Conn, error) { return <-l.c, nil }
func (l *chanListener) Close() error              { return nil }
func (l *chanListener) Addr() net.Addr            { return l.addr }
