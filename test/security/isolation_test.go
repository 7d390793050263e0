//go:build linux

package security

import (
	"crypto/sha256"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/test/harness"
)

// The paper's incident: `grep -r /` read /proc/kpagecgroup and crashed the
// kernel. Kernel memory and page tables read as nothing in a sandbox, as
// root, through exec and through the file API (which runs as root in the
// sandbox), a `grep -r` over /proc's page files ends, and kernel settings
// cannot be written. Package test: internal/runtime/container
// TestSandboxIsolation/CannotReadKernelMemory.
func checkKernelMemoryProc(t *testing.T, e *env) {
	id := e.create(t, nil)
	for _, p := range []string{"/proc/kpagecgroup", "/proc/kpageflags", "/proc/kpagecount", "/proc/kcore", "/proc/keys"} {
		if n := strings.TrimSpace(e.sh(t, id, "head -c 4096 "+p+" 2>/dev/null | wc -c")); n != "0" {
			t.Errorf("exec read %s bytes of %s", n, p)
		}
		var buf strings.Builder
		if _, err := e.c.ReadFile(t.Context(), id, p, &buf); err == nil && buf.Len() > 0 {
			t.Errorf("file API read %d bytes of %s", buf.Len(), p)
		}
	}
	e.Shell(t, id, "grep -r x /proc/kpagecgroup /proc/kpageflags /proc/kcore >/dev/null 2>&1")
	e.sh(t, id, "true") // the sandbox (and the kernel) are still there
	for _, w := range []string{"echo 1 > /proc/sys/kernel/panic", "echo c > /proc/sysrq-trigger", "echo 3 > /proc/sys/vm/drop_caches"} {
		e.fails(t, id, w)
	}
}

// Held in the red-team pass: every process of a sandbox runs under the
// seccomp filter (PID 1 included) with no_new_privs, and the syscalls that
// reach the kernel's attack surface or other namespaces are refused with
// EPERM. Package tests: internal/runtime/container TestCompileSeccomp,
// TestSandboxIsolation/SeccompFilterActive.
func checkSeccomp(t *testing.T, e *env) {
	id := e.create(t, nil)
	for _, who := range []string{"self", "1"} {
		st := e.sh(t, id, "cat /proc/"+who+"/status")
		for _, want := range []string{"Seccomp:\t2", "NoNewPrivs:\t1"} {
			if !strings.Contains(st, want) {
				t.Errorf("/proc/%s/status has no %q", who, want)
			}
		}
	}
	e.withProbe(t, id)
	got := e.runProbe(t, id, "", "syscalls")
	for _, sc := range []string{"unshare-user", "unshare-mount", "unshare-net", "setns", "keyctl", "add_key", "bpf",
		"perf_event_open", "kexec_load", "open_by_handle_at", "init_module", "finit_module", "delete_module",
		"reboot", "swapon", "pivot_root", "iopl", "settimeofday", "socket-vsock"} {
		if got[sc] != "operation not permitted" {
			t.Errorf("%s as root: %q, want operation not permitted", sc, got[sc])
		}
	}
	e.fails(t, id, "unshare -U true")
}

// dockerCaps is Docker's default capability set (docs/security.md):
// CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID SETPCAP
// NET_BIND_SERVICE NET_RAW SYS_CHROOT MKNOD AUDIT_WRITE SETFCAP.
const dockerCaps = 0x00000000a80425fb

// Held in the red-team pass: root in a sandbox has exactly Docker's default
// capabilities (no SYS_ADMIN, SYS_MODULE, SYS_PTRACE, SYS_RAWIO, NET_ADMIN,
// SYS_RESOURCE), nothing inheritable or ambient; a user process has none.
// Package tests: internal/runtime/container TestOCISpecHardening,
// TestSandboxIsolation/CannotLoadModules.
func checkCapabilities(t *testing.T, e *env) {
	id := e.create(t, nil)
	caps := func(user string) map[string]uint64 {
		t.Helper()
		r, err := e.Exec(t.Context(), execAs(id, user, "grep ^Cap /proc/self/status"))
		if err != nil || r.Exit.GetExitCode() != 0 {
			t.Fatalf("read caps as %q: %+v %v", user, r, err)
		}
		m := map[string]uint64{}
		for _, l := range strings.Split(strings.TrimSpace(r.Stdout), "\n") {
			f := strings.Fields(l)
			v, err := strconv.ParseUint(f[1], 16, 64)
			if err != nil {
				t.Fatalf("%q: %v", l, err)
			}
			m[strings.TrimSuffix(f[0], ":")] = v
		}
		return m
	}
	root := caps("root")
	for k, want := range map[string]uint64{"CapEff": dockerCaps, "CapPrm": dockerCaps, "CapBnd": dockerCaps, "CapInh": 0, "CapAmb": 0} {
		if root[k] != want {
			t.Errorf("root %s = %#x, want %#x", k, root[k], want)
		}
	}
	user := caps("user")
	for _, k := range []string{"CapEff", "CapPrm", "CapInh", "CapAmb"} {
		if user[k] != 0 {
			t.Errorf("user %s = %#x, want 0", k, user[k])
		}
	}
}

// Held in the red-team pass: the masked /proc and /sys paths read as
// nothing and the read-only ones refuse writes. Package tests:
// internal/runtime/container TestOCISpecHardening, TestSandboxIsolation.
func checkMaskedProc(t *testing.T, e *env) {
	id := e.create(t, nil)
	for _, p := range []string{"/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
		"/proc/sched_debug", "/proc/kpagecgroup", "/proc/kpagecount", "/proc/kpageflags"} {
		if n := strings.TrimSpace(e.sh(t, id, "if [ -e "+p+" ]; then cat "+p+" 2>/dev/null | wc -c; else echo 0; fi")); n != "0" {
			t.Errorf("%s: read %s bytes, want it masked", p, n)
		}
	}
	for _, d := range []string{"/proc/acpi", "/proc/asound", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap"} {
		if n := strings.TrimSpace(e.sh(t, id, "ls -A "+d+" 2>/dev/null | wc -l")); n != "0" {
			t.Errorf("%s lists %s entries, want it masked", d, n)
		}
	}
	for _, w := range []string{"echo 1 > /proc/sys/kernel/sysrq", "touch /sys/x", "echo 1 > /sys/kernel/mm/ksm/run", "touch /proc/fs/x", "echo 1 > /proc/irq/default_smp_affinity"} {
		e.fails(t, id, w)
	}
}

// Held in the red-team pass: mounting, loading kernel modules and tracing
// processes the sandbox does not own are refused; another sandbox's and
// the host's processes are not even visible. Package tests:
// internal/runtime/container TestSandboxIsolation/CannotMount,
// CannotLoadModules, OnlySandboxProcesses.
func checkMountModulePtrace(t *testing.T, e *env) {
	a, b := e.create(t, nil), e.create(t, nil)
	e.withProbe(t, a)
	got := e.runProbe(t, a, "", "syscalls")
	for _, sc := range []string{"mount", "mount-proc", "remount-root", "umount-proc", "init_module", "finit_module"} {
		if got[sc] != "operation not permitted" {
			t.Errorf("%s as root: %q, want operation not permitted", sc, got[sc])
		}
	}
	// The device cgroup refuses to open a disk node root made.
	if got["open-disk"] != "operation not permitted" && got["open-disk"] != "permission denied" {
		t.Errorf("open a block device node as root: %q, want it refused", got["open-disk"])
	}
	e.fails(t, a, "mount -t tmpfs x /mnt")
	e.fails(t, a, "head -c 4096 /dev/urandom > /tmp/x.ko && insmod /tmp/x.ko")
	if m := e.sh(t, a, "grep ' /mnt ' /proc/self/mountinfo || true"); m != "" {
		t.Errorf("/mnt got mounted: %s", m)
	}
	// A user process cannot trace the agent.
	if r := e.runProbe(t, a, "user", "ptrace", "1"); r["ptrace"] != "operation not permitted" {
		t.Errorf("ptrace of PID 1 as user: %q, want operation not permitted", r["ptrace"])
	}
	// The host's processes and b's are not there to trace.
	for name, pid := range map[string]int{"the test process": os.Getpid(), "b's init": harness.InitPid(t, b)} {
		if r := e.runProbe(t, a, "", "ptrace", strconv.Itoa(pid)); r["ptrace"] != "no such process" {
			t.Errorf("ptrace of %s (host pid %d) from a: %q, want no such process", name, pid, r["ptrace"])
		}
	}
	e.sh(t, b, "echo marker-b > /tmp/m")
	if out := e.sh(t, a, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"); strings.Contains(out, "marker-b") || strings.Contains(out, "opendsec up") {
		t.Errorf("sandbox a sees processes outside it: %q", out)
	}
}

// Held in the red-team pass: the agent and init binaries in the sandbox are
// the host's, bind-mounted read-only: writing, appending, removing, moving
// or chmod-ing them fails and the host's files are unchanged. Package test:
// internal/runtime/container TestSandboxIsolation/CannotWriteAgent.
func checkAgentReadOnly(t *testing.T, e *env) {
	id := e.create(t, nil)
	for inSandbox, host := range map[string]string{"/.opendsec/agent": "opendsec-agent", "/.opendsec/init": "opendsec-init"} {
		host = filepath.Join(harness.BinDir(), host)
		before := hashFile(t, host)
		for _, line := range []string{"echo x > " + inSandbox, "echo x >> " + inSandbox, "rm -f " + inSandbox,
			"mv " + inSandbox + " /tmp/moved", "chmod 777 " + inSandbox, "touch " + inSandbox} {
			e.fails(t, id, line)
		}
		if hashFile(t, host) != before {
			t.Errorf("%s on the host changed", host)
		}
		if m := e.sh(t, id, "grep ' "+inSandbox+" ' /proc/self/mountinfo"); !strings.Contains(strings.Fields(m)[5], "ro") {
			t.Errorf("%s is not mounted read-only: %s", inSandbox, m)
		}
	}
	e.sh(t, id, "true")
}

func hashFile(t *testing.T, p string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}
