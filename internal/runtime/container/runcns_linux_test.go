package container

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/osthread"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// runcMountsWrapper returns a wrapper of the tests' OCI runtime (runc or
// crun: kind) that logs, for every call, its subcommand and how many
// mounts /proc/self/mountinfo has where it runs, and a function returning
// (and clearing) those lines.
func runcMountsWrapper(t *testing.T) (wrapper, kind string, calls func() []string) {
	t.Helper()
	kind = testOCIKind(t)
	real, err := exec.LookPath(kind)
	if err != nil {
		t.Fatalf("%s: %v", kind, err)
	}
	dir := t.TempDir()
	logf := filepath.Join(dir, "runc-mounts.log")
	wrapper = filepath.Join(dir, kind)
	// Each call logs the size of the mount table it runs with, and how
	// many of those mounts are this test's (under its temp dirs: the
	// sandboxes' and the netns pins'), which other work on the host does
	// not change.
	ours := filepath.Dir(dir) + "/"
	script := "#!/bin/sh\necho \"$(wc -l </proc/self/mountinfo) $(grep -c ' " + ours + "' /proc/self/mountinfo) $*\" >>" + logf + "\nexec " + real + " \"$@\"\n"
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil { //nolint:gosec // an executable
		t.Fatal(err)
	}
	return wrapper, kind, func() []string {
		b, err := os.ReadFile(logf)
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		if err := os.Truncate(logf, 0); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		var out []string
		for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			if l != "" && !strings.HasSuffix(l, " --version") && !isProbeCall(l) {
				out = append(out, l)
			}
		}
		return out
	}
}

// mountsOf returns the mount counts of the logged calls whose arguments
// contain sub.
func mountsOf(t *testing.T, lines []string, sub string) []int {
	return mountCounts(t, lines, sub, false)
}

// oursOf is mountsOf counting only the test's own mounts.
func oursOf(t *testing.T, lines []string, sub string) []int {
	return mountCounts(t, lines, sub, true)
}

func mountCounts(t *testing.T, lines []string, sub string, ours bool) []int {
	t.Helper()
	var out []int
	for _, l := range lines {
		n, rest, _ := strings.Cut(l, " ")
		o, args, _ := strings.Cut(rest, " ")
		if !strings.Contains(" "+args+" ", sub) {
			continue
		}
		if ours {
			n = o
		}
		v, err := strconv.Atoi(n)
		if err != nil {
			t.Fatalf("wrapper log line %q: %v", l, err)
		}
		out = append(out, v)
	}
	return out
}

// mountsUnder counts the node's mounts at one of the paths in ours, or
// below one ending in "/".
func mountsUnder(t *testing.T, ours []string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/thread-self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 5 {
			continue
		}
		for _, o := range ours {
			if f[4] == o || strings.HasSuffix(o, "/") && strings.HasPrefix(f[4], o) {
				n++
				break
			}
		}
	}
	return n
}

func nodeMounts(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/thread-self/mountinfo") // not the main thread's: a test may leave it elsewhere
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "\n")
}

// pinNetNS makes a network namespace pinned by a bind mount at a new file,
// as netpolicy does for a sandbox, and returns the file.
func pinNetNS(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(p, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	osthread.Throwaway(func() { // the thread ends in the new namespace
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			done <- err
			return
		}
		done <- unix.Mount("/proc/thread-self/ns/net", p, "", unix.MS_BIND, "")
	})
	if err := <-done; err != nil {
		t.Fatalf("pin a network namespace: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(p, unix.MNT_DETACH) })
	return p
}

func inode(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestRuncSeesOnlyItsSandboxMounts checks that runc runs in a mount
// namespace without the other sandboxes' mounts: the mount table each
// `runc run` sees stays the same size while the node's grows by every
// sandbox's layer and tmpfs (and its network namespace pin), also in a
// runtime started after them (a node restart). In the node's namespace
// (the code before) it grows with them. Each sandbox joins the network
// namespace pinned for it.
func TestRuncSeesOnlyItsSandboxMounts(t *testing.T) {
	const n = 5
	for _, tc := range []struct {
		name   string
		nodeNS bool
	}{{"RuncNamespace", false}, {"NodeNamespace", true}} {
		t.Run(tc.name, func(t *testing.T) {
			wrapper, kind, calls := runcMountsWrapper(t)
			f := newFactoryWith(t, func(c *Config) { withOCIBinary(c, kind, wrapper); c.runcInNodeNS = tc.nodeNS })
			rt, tmpl := f(t)
			var ids, ours []string // ours: the sandboxes' bundles and netns pins
			for range n {
				spec := tmpl
				pin := pinNetNS(t)
				ours = append(ours, pin)
				spec.Network = runtime.NetworkAttachment{Mode: runtime.NetworkVeth, NetNS: pin, Device: "eth0"}
				spec, _ = runtimetest.StartSandbox(t, rt, spec)
				ids, ours = append(ids, spec.ID), append(ours, spec.StateDir+"/")
				st, err := rt.Status(t.Context(), spec.ID)
				if err != nil {
					t.Fatal(err)
				}
				if got, want := inode(t, fmt.Sprintf("/proc/%d/ns/net", st.Pid)), inode(t, pin); got != want {
					t.Fatalf("sandbox %s is in network namespace %d, want the pinned %d", spec.ID, got, want)
				}
			}
			// Only these sandboxes' mounts count: other tests' leftovers may
			// come and go in the node's table meanwhile.
			if got := mountsUnder(t, ours); got < 3*n {
				t.Fatalf("node's mount table has %d mounts of %d sandboxes; want at least %d (layer, tmpfs, netns pin each)", got, n, 3*n)
			}
			lines := calls()
			runs := mountsOf(t, lines, " run --detach ")
			if len(runs) != n {
				t.Fatalf("runc run calls: %q; want %d", lines, n)
			}
			growth := runs[n-1] - runs[0]
			if tc.nodeNS {
				// The test's own mounts only: other work on the host may
				// unmount meanwhile (a bench tearing down its sandboxes
				// once shrank the whole table by 36 during the five).
				o := oursOf(t, lines, " run --detach ")
				if o[n-1]-o[0] < 2*(n-1) {
					t.Fatalf("in the node's namespace runc run saw %v of the test's mounts (%v in all); want it to grow by every sandbox's (the test measures nothing)", o, runs)
				}
				return
			}
			if growth != 0 || runs[0] >= nodeMounts(t) {
				t.Fatalf("runc run saw %v mounts (node: %d); want the same small table every time", runs, nodeMounts(t))
			}
			// The other runc commands run in the runc namespace too.
			if _, err := rt.Status(t.Context(), ids[0]); err != nil {
				t.Fatal(err)
			}
			if states := mountsOf(t, calls(), " state "); len(states) != 1 || states[0] >= runs[0] {
				t.Fatalf("runc state saw %v mounts; want one call with fewer than runc run's %d", states, runs[0])
			}

			// A runtime made while the sandboxes run (a node restart)
			// leaves their mounts out of its runc namespace.
			rt2, tmpl2 := f(t)
			spec, _ := runtimetest.StartSandbox(t, rt2, tmpl2)
			if got := mountsOf(t, calls(), " run --detach "); len(got) != 1 || got[0] > runs[0] {
				t.Fatalf("after a restart with %d sandboxes, runc run of %s saw %v mounts; want at most %d", n, spec.ID, got, runs[0])
			}
		})
	}
}
