//go:build linux

package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/test/harness"
)

// vmGuestAssets is the vm backend's guest kernel and initramfs, built (or
// found in their cache) by scripts/build-guest-assets.sh, as the vm
// package's tests do; "" and why when they cannot be had.
var vmGuestAssets = sync.OnceValues(func() (string, string) {
	cache := os.Getenv("OPENDSEC_GUEST_CACHE")
	if cache == "" {
		cache = "/var/cache/opendsec/guest"
	}
	cmd := exec.Command("scripts/build-guest-assets.sh", "--cache", cache)
	cmd.Dir = harness.RepoRoot()
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", "the guest assets cannot be built (scripts/build-guest-assets.sh: " + err.Error() + "): " + harness.LastLines(errb.String(), 3)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	return lines[len(lines)-1], ""
})

// newVMSystem is a system whose node has the container and vm backends
// (QEMU under TCG, as on these machines; guest RAM files in a memory dir
// of its own, so the test can tell that none is left).
func newVMSystem(t *testing.T) (*system, string) {
	assets, why := vmGuestAssets()
	if assets == "" {
		if os.Getenv("CI") != "" {
			t.Fatal(why)
		}
		t.Skip(why)
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Fatalf("qemu-system-x86_64 is needed for the vm backend: %v", err)
	}
	memDir := filepath.Join("/dev/shm", "odvm-e2e-"+strconv.Itoa(os.Getpid()))
	t.Cleanup(func() { _ = os.Remove(memDir) })
	s := &system{harness.NewWith(t, harness.Options{Config: func(cfg map[string]any) {
		harness.Set(cfg, "node.backends", map[string]any{
			"container": map[string]any{},
			"vm":        map[string]any{"assets_dir": assets, "accel": "tcg", "memory_dir": memDir, "boot_timeout_sec": 120},
		})
	}})}
	return s, memDir
}

// qemuOf lists the pids of QEMU processes of sandbox id (its -name).
func qemuOf(id string) []int {
	var pids []int
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		for i, a := range args {
			if a == "-name" && i+1 < len(args) && args[i+1] == "opendsec-"+id {
				pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
				pids = append(pids, pid)
			}
		}
	}
	return pids
}

// holderLoop keeps a random value (drawn once, held only in the shell's
// memory) and a counter, and writes both to /tmp/held every 100 ms.
const holderLoop = `(v=$(head -c8 /dev/urandom | od -An -tx1 | tr -d ' \n'); i=0; while :; do i=$((i+1)); echo "$v $i" > /tmp/held.tmp && mv /tmp/held.tmp /tmp/held; sleep 0.1; done) >/dev/null 2>&1 </dev/null &`

// held reads the holder's value and count in id, after removing /tmp/held
// first when fresh is set: what comes back then was written by the
// running process, from its memory, not copied with the disk.
func (s *system) held(t *testing.T, id string, fresh bool) (string, int) {
	t.Helper()
	line := "cat /tmp/held"
	if fresh {
		line = "rm -f /tmp/held; for i in $(seq 100); do [ -s /tmp/held ] && exec cat /tmp/held; sleep 0.1; done; exit 1"
	}
	var r harness.ExecResult
	for deadline := time.Now().Add(30 * time.Second); ; {
		r = s.Shell(t, id, line)
		if r.Exit.GetExitCode() == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: read the holder's value: %+v", id, r)
		}
		time.Sleep(100 * time.Millisecond) // polling: the loop starts
	}
	f := strings.Fields(r.Stdout)
	if len(f) != 2 {
		t.Fatalf("%s: holder wrote %q", id, r.Stdout)
	}
	n, _ := strconv.Atoi(f[1])
	return f[0], n
}

// TestVMForkAndNodeKill9 drives the vm backend through a node: a VM
// sandbox made through the API runs commands and a shell on a terminal
// (PTY: size, input, resize, exit status); a shell holding a random
// value in memory is forked into 2 through the node's fork API, and each
// fork's shell (the same process, restored) holds the value and counts on,
// with its own hostname. Then the node is killed with -9 and started
// again: the VM is still there (the same QEMU), its process still holds
// the value, and exec works. In the end no QEMU process, tap, RAM file,
// cgroup or mount of the sandboxes is left.
func TestVMForkAndNodeKill9(t *testing.T) {
	s, memDir := newVMSystem(t)
	s.Start()
	start := time.Now()
	src := s.create(t, &opendsecv1.SandboxSpec{Backend: "vm", Image: "root/busybox", Cpu: 1, MemoryMb: proto.Int64(256)})
	t.Logf("create to running: %s", time.Since(start))
	id := src.GetId()
	if r := s.Shell(t, id, "echo hi; hostname; ip -o link show eth0 >/dev/null && echo eth0"); r.Exit.GetExitCode() != 0 || !strings.HasPrefix(r.Stdout, "hi\n") || !strings.HasSuffix(r.Stdout, "eth0\n") {
		t.Fatalf("exec in the VM: %+v", r)
	}
	s.checkPTY(t, id)
	qemu := qemuOf(id)
	if len(qemu) != 1 {
		t.Fatalf("QEMU processes of %s: %v, want one", id, qemu)
	}
	if r := s.Shell(t, id, holderLoop); r.Exit.GetExitCode() != 0 {
		t.Fatalf("start the holder: %+v", r)
	}
	v0, n0 := s.held(t, id, true)
	host0 := strings.TrimSpace(s.Shell(t, id, "hostname").Stdout)

	start = time.Now()
	out, err := s.fork(t, id, 2)
	if err != nil {
		t.Fatalf("fork 2: %v", err)
	}
	t.Logf("fork 2: %s, source frozen %d µs", time.Since(start), out.GetSourceFrozenUs())
	if len(out.GetForks()) != 2 {
		t.Fatalf("%d forks, want 2", len(out.GetForks()))
	}
	hosts := map[string]string{host0: id}
	var forks []string
	for _, f := range out.GetForks() {
		fid := f.GetSandbox().GetId()
		forks = append(forks, fid)
		if !f.GetMemoryPreserved() {
			t.Errorf("fork %s: memory_preserved false on the vm backend", fid)
		}
		v, n := s.held(t, fid, true)
		if v != v0 || n < n0 {
			t.Errorf("fork %s: holder has %s %d, the source had %s %d: not the source's memory", fid, v, n, v0, n0)
		}
		host := strings.TrimSpace(s.Shell(t, fid, "hostname").Stdout)
		if other, dup := hosts[host]; dup || host == "" {
			t.Errorf("fork %s: hostname %q, the same as %s's", fid, host, other)
		}
		hosts[host] = fid
		t.Logf("fork %s: value %s count %d (source %d at the fork), hostname %s", fid, v, n, n0, host)
	}

	// What the leftover checks below look at is there while they run.
	if ents, _ := os.ReadDir(memDir); len(ents) < 3 {
		t.Fatalf("%d RAM files in %s with 3 VMs running: is node.backends.vm.memory_dir used?", len(ents), memDir)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.DataDir(), "netns")); len(ents) < 3 {
		t.Fatalf("%d network namespaces in %s with 3 VMs running", len(ents), filepath.Join(s.DataDir(), "netns"))
	}

	// The node dies with the VMs running, and comes back.
	s.Kill9()
	if got := qemuOf(id); len(got) != 1 || got[0] != qemu[0] {
		t.Fatalf("QEMU of %s after the node's kill -9: %v, want %v running on", id, got, qemu)
	}
	s.Start()
	g, err := s.Sandboxes().GetSandbox(t.Context(), connect.NewRequest(&opendsecv1.GetSandboxRequest{Id: id}))
	if err != nil {
		t.Fatalf("get %s after the restart: %v", id, err)
	}
	if st := g.Msg.GetSandbox().GetState(); st != opendsecv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("%s after the restart: %s, want running", id, st)
	}
	if r := s.Shell(t, id, "echo after; hostname"); r.Exit.GetExitCode() != 0 || r.Stdout != "after\n"+host0+"\n" {
		t.Fatalf("exec after the restart: %+v", r)
	}
	if got := qemuOf(id); len(got) != 1 || got[0] != qemu[0] {
		t.Fatalf("QEMU of %s after the restart: %v, want the same %v", id, got, qemu)
	}
	if v, n := s.held(t, id, true); v != v0 || n <= n0 {
		t.Fatalf("holder after the restart: %s %d, want %s counting on from %d", v, n, v0, n0)
	}
	for _, fid := range forks {
		if r := s.Shell(t, fid, "echo fork"); r.Exit.GetExitCode() != 0 || r.Stdout != "fork\n" {
			t.Errorf("exec in fork %s after the restart: %+v", fid, r)
		}
	}

	// Stop all: nothing of them is left.
	for _, sid := range append([]string{id}, forks...) {
		if _, err := s.Sandboxes().StopSandbox(t.Context(), connect.NewRequest(&opendsecv1.StopSandboxRequest{Id: sid})); err != nil {
			t.Fatalf("stop %s: %v", sid, err)
		}
	}
	s.waitTeardowns(t)
	for _, sid := range append([]string{id}, forks...) {
		if left := s.leftoversAfterStop(t, sid); len(left) > 0 {
			t.Errorf("%s left: %v", sid, left)
		}
		if pids := qemuOf(sid); len(pids) > 0 {
			t.Errorf("QEMU of %s still runs: %v", sid, pids)
		}
	}
	if ents, _ := os.ReadDir(memDir); len(ents) > 0 {
		t.Errorf("RAM files left in %s: %v", memDir, ents)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.DataDir(), "netns")); len(ents) > 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("network namespaces (and their taps) left: %v", names)
	}
	for _, ns := range []string{s.NodeNS()} {
		args := []string{"-o", "link", "show", "type", "tun"}
		cmd := exec.Command("ip", args...)
		if ns != "" {
			cmd = exec.Command("nsenter", append([]string{"--net=" + ns, "--", "ip"}, args...)...)
		}
		if b, err := cmd.Output(); err == nil && len(bytes.TrimSpace(b)) > 0 {
			t.Errorf("tap devices left (netns %q): %s", ns, b)
		}
	}
}
