package vm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// holderOnce starts, once per run, a shell in the shared VM that holds a
// random value in its memory and counts; it writes "value count" to /c
// (the initramfs root: guest memory too) every 50 ms.
var holderOnce struct {
	once sync.Once
	err  error
}

func sharedHolder(t *testing.T) (*Runtime, string) {
	t.Helper()
	r, id := guestVM(t)
	holderOnce.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		res, err := runtimetest.Run(ctx, r, id, "", "/bin/sh", "-c",
			`(v=$(head -c8 /dev/urandom | od -An -tx1 | tr -d ' \n'); i=0; while :; do i=$((i+1)); echo "$v $i" > /c.tmp && mv /c.tmp /c; sleep 0.05; done) >/dev/null 2>&1 </dev/null &`)
		if err == nil && res.ExitCode != 0 {
			err = errors.New("exit " + strconv.Itoa(res.ExitCode) + ": " + res.Stderr)
		}
		holderOnce.err = err
	})
	if holderOnce.err != nil {
		t.Fatalf("start the holder: %v", holderOnce.err)
	}
	return r, id
}

// waitCounter polls the holder's /c until its count is at least n.
func waitCounter(t testing.TB, r *Runtime, id string, n int) (string, int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	var last string
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		res, err := runtimetest.Run(ctx, r, id, "", "cat", "/c")
		cancel()
		if err == nil && res.ExitCode == 0 {
			last = strings.TrimSpace(res.Stdout)
			if v, c, ok := strings.Cut(last, " "); ok {
				if k, err := strconv.Atoi(c); err == nil && k >= n {
					return v, k
				}
			}
		}
		time.Sleep(50 * time.Millisecond) // polling the guest's counter, not synchronising with it
	}
	t.Fatalf("counter of %s did not reach %d in 60 s (last %q)", id, n, last)
	return "", 0
}

func guestRun(t testing.TB, r *Runtime, id, script string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := runtimetest.Run(ctx, r, id, "", "/bin/sh", "-c", script)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%s in %s: %v, exit %d, stderr %q", script, id, err, res.ExitCode, res.Stderr)
	}
	return strings.TrimSpace(res.Stdout)
}

// TestGuestPauseResumeKeepsCounter: a paused VM does not count, and counts
// on from where it was after resume.
func TestGuestPauseResumeKeepsCounter(t *testing.T) {
	r, id := sharedHolder(t)
	ctx := t.Context()
	v0, n0 := waitCounter(t, r, id, 3)
	if err := r.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	if st, err := r.Status(ctx, id); err != nil || st.State != runtime.StatePaused {
		t.Fatalf("status after pause: %+v %v", st, err)
	}
	// A snapshot of the paused VM unbinds its balloon driver (the guest
	// runs for the call) and binds it again.
	if _, err := r.Snapshot(ctx, id, t.TempDir()); err != nil {
		t.Fatalf("snapshot of the paused VM: %v", err)
	}
	if st, err := r.Status(ctx, id); err != nil || st.State != runtime.StatePaused {
		t.Fatalf("status after the snapshot of the paused VM: %+v %v", st, err)
	}
	if err := r.Resume(ctx, id); err != nil {
		t.Fatal(err)
	}
	if sb, _ := r.get(id); sb.st.Balloon && !balloonBound(t, r, id) {
		t.Error("the paused VM's balloon driver is not bound again after its snapshot")
	}
	v, n := waitCounter(t, r, id, n0+3)
	if v != v0 || n < n0+3 {
		t.Fatalf("after resume: value %q count %d; before pause %q %d", v, n, v0, n0)
	}
}

// forkSpecs are n sandboxes, each in its own namespace with a tap.
func forkSpecs(t *testing.T, prefix string, n int) []runtime.Spec {
	t.Helper()
	var specs []runtime.Spec
	for i := range n {
		ns, err := newTapNetNS(prefix + strconv.Itoa(i) + "-" + strconv.Itoa(os.Getpid()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ns.close)
		id := prefix + strconv.Itoa(i)
		specs = append(specs, runtime.Spec{ID: id, StateDir: filepath.Join(t.TempDir(), "sb"), Rootfs: guestRootfs(t), Resources: guestRes(16),
			Network: ns.attachment(), Guest: runtime.Guest{Hostname: "host-" + id}})
	}
	return specs
}

// TestGuestForkKeepsMemory is issue 13's acceptance on the vm backend: a
// process holding a random value in memory, fork(count=3): each fork
// reports the same value and counts on, has its own hostname and RNG
// output, a write in one fork is invisible to the others, and the source
// runs on. The forks' RAM is the snapshot's file mapped private.
func TestGuestForkKeepsMemory(t *testing.T) {
	r, src := sharedHolder(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	v0, n0 := waitCounter(t, r, src, 3)
	specs := forkSpecs(t, "fork", 3)
	res, err := r.Fork(ctx, src, specs)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	for _, s := range specs {
		t.Cleanup(func() { _ = r.Delete(context.Background(), s.ID) })
	}
	if len(res) != 3 {
		t.Fatalf("%d forks, want 3", len(res))
	}
	for i, fr := range res {
		if !fr.MemoryPreserved || fr.SourceFrozen <= 0 || fr.Handle.ID != specs[i].ID {
			t.Fatalf("fork %d: %+v; want memory preserved, a source pause, id %s", i, fr, specs[i].ID)
		}
	}
	t.Logf("source frozen %s", res[0].SourceFrozen)
	for _, s := range specs {
		start := time.Now()
		if err := r.Start(ctx, s.ID); err != nil {
			t.Fatalf("start fork %s: %v", s.ID, err)
		}
		t.Logf("fork %s: restore to identity set %s", s.ID, time.Since(start))
	}
	rngs := map[string]string{guestRun(t, r, src, "head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n'"): src}
	for _, s := range specs {
		v, n := waitCounter(t, r, s.ID, n0)
		if v != v0 {
			t.Fatalf("fork %s holds value %q, the source %q", s.ID, v, v0)
		}
		if v, n2 := waitCounter(t, r, s.ID, n+3); v != v0 || n2 < n0 {
			t.Fatalf("fork %s: %q %d after %d", s.ID, v, n2, n0)
		}
		if h := guestRun(t, r, s.ID, "hostname"); h != s.Guest.Hostname {
			t.Errorf("fork %s hostname %q, want %q", s.ID, h, s.Guest.Hostname)
		}
		if srcSB, _ := r.get(src); srcSB.st.Balloon {
			// The forks map the snapshot's RAM file private: a page they
			// reported free would be punched out of it.
			if b := balloonBound(t, r, s.ID); b {
				t.Errorf("fork %s has its balloon driver bound: it would report free pages into the snapshot's RAM file", s.ID)
			}
			if !balloonBound(t, r, src) {
				t.Errorf("the source's balloon driver is not bound again after the fork")
			}
		}
		rnd := guestRun(t, r, s.ID, "head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n'")
		if other, dup := rngs[rnd]; dup {
			t.Errorf("fork %s read the same random bytes as %s: %s (the RNG was not reseeded)", s.ID, other, rnd)
		}
		rngs[rnd] = s.ID
		if out := guestRun(t, r, s.ID, "ip -4 -o addr show dev eth0; ip route"); !strings.Contains(out, testGuestAddr.String()) || !strings.Contains(out, "default via "+testGateway.String()) {
			t.Errorf("fork %s network: %s", s.ID, out)
		}
		sb, _ := r.get(s.ID)
		if smaps, err := os.ReadFile("/proc/" + strconv.Itoa(sb.st.Pid) + "/smaps_rollup"); err == nil {
			t.Logf("fork %s qemu smaps_rollup: %s", s.ID, compactSmaps(smaps))
		}
	}
	if err := runtimetest.WriteFile(ctx, r, specs[0].ID, "/only-here", []byte("x")); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{specs[1].ID, specs[2].ID, src} {
		if _, err := runtimetest.ReadFile(ctx, r, id, "/only-here"); !errors.Is(err, runtimetest.ErrNoFile) {
			t.Errorf("a file written in fork %s is visible in %s (read: %v)", specs[0].ID, id, err)
		}
	}
	if _, n := waitCounter(t, r, src, n0+3); n < n0+3 {
		t.Fatalf("source counter stuck at %d", n)
	}
	// A fork's Delete leaves nothing: no QEMU, no RAM file, no files.
	sb, _ := r.get(specs[2].ID)
	pid, mem := sb.st.Pid, sb.st.MemPath
	if err := r.Delete(ctx, specs[2].ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(mem); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("fork's RAM file %s after delete: %v", mem, err)
	}
	runtimetest.AssertNoLeftovers(t, specs[2].StateDir, pid)
}

func compactSmaps(b []byte) string {
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		for _, k := range []string{"Rss:", "Pss:", "Shared_Clean:", "Shared_Dirty:", "Private_Clean:", "Private_Dirty:"} {
			if strings.HasPrefix(l, k) {
				out = append(out, strings.Join(strings.Fields(l), " "))
			}
		}
	}
	return strings.Join(out, ", ")
}

// TestGuestSnapshotRestoreAndRefusals: a snapshot restores into a sandbox
// that counts on; a truncated or corrupted file, or a snapshot of another
// accelerator kind, is refused by Restore with the cause named and nothing
// made (no files, RAM file, cgroup or sandbox).
func TestGuestSnapshotRestoreAndRefusals(t *testing.T) {
	r, src := sharedHolder(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	v0, n0 := waitCounter(t, r, src, 3)
	dir := t.TempDir()
	info, err := r.Snapshot(ctx, src, dir)
	if err != nil {
		t.Fatal(err)
	}
	if !info.Memory || info.Bytes <= 0 {
		t.Fatalf("snapshot info %+v", info)
	}
	bad := func(name string, mutate func(dir string), want string, cat error) {
		t.Helper()
		d := filepath.Join(t.TempDir(), "snap")
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
		for _, f := range []string{manifestFile, snapStateFile, snapMemFile, "rw.ext4", "config.img"} {
			if err := copySparse(filepath.Join(dir, f), filepath.Join(d, f)); err != nil {
				t.Fatal(err)
			}
		}
		mutate(d)
		spec := forkSpecs(t, "bad-"+name, 1)[0]
		_, err := r.Restore(ctx, spec, d)
		if err == nil || !errors.Is(err, cat) || !strings.Contains(err.Error(), want) {
			t.Fatalf("%s: Restore = %v; want %v naming %q", name, err, cat, want)
		}
		if _, err := r.get(spec.ID); err == nil {
			t.Errorf("%s: the refused sandbox is known", name)
		}
		if _, err := os.Stat(r.memPath(spec.ID)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: RAM file left: %v", name, err)
		}
		if ents, _ := os.ReadDir(spec.StateDir); len(ents) > 0 {
			t.Errorf("%s: files left in the state dir: %v", name, ents)
		}
		if _, err := os.Stat(filepath.Join(cgroupRoot, "memory", r.cgroupPath(spec.ID))); err == nil {
			t.Errorf("%s: cgroup left", name)
		}
	}
	bad("truncated", func(d string) {
		if err := os.Truncate(filepath.Join(d, snapStateFile), 100); err != nil {
			t.Fatal(err)
		}
	}, "truncated", errdefs.ErrInvalidArgument)
	bad("corrupted", func(d string) {
		f, err := os.OpenFile(filepath.Join(d, snapStateFile), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 1)
		_, _ = f.ReadAt(b, 1000)
		b[0] ^= 0xff
		_, _ = f.WriteAt(b, 1000)
		_ = f.Close()
	}, "corrupted", errdefs.ErrInvalidArgument)
	bad("memory", func(d string) {
		if err := os.Truncate(filepath.Join(d, snapMemFile), 1<<20); err != nil {
			t.Fatal(err)
		}
	}, "file memory is 1048576 bytes", errdefs.ErrInvalidArgument)
	bad("accel", func(d string) {
		b, _ := os.ReadFile(filepath.Join(d, manifestFile))
		b = bytes.Replace(b, []byte(`"accel": "tcg"`), []byte(`"accel": "kvm"`), 1)
		if err := os.WriteFile(filepath.Join(d, manifestFile), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}, "taken under -accel kvm", errdefs.ErrFailedPrecondition)
	bad("manifest", func(d string) {
		if err := os.WriteFile(filepath.Join(d, manifestFile), []byte("{"), 0o600); err != nil {
			t.Fatal(err)
		}
	}, "manifest", errdefs.ErrInvalidArgument)

	// The good one restores and counts on from the snapshot.
	spec := forkSpecs(t, "restored", 1)[0]
	if _, err := r.Restore(ctx, spec, dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Delete(context.Background(), spec.ID) })
	if err := r.Start(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if v, _ := waitCounter(t, r, spec.ID, n0+3); v != v0 {
		t.Fatalf("restored value %q, source %q", v, v0)
	}
	var m snapshotManifest
	b, _ := os.ReadFile(filepath.Join(dir, manifestFile))
	_ = json.Unmarshal(b, &m)
	t.Logf("snapshot: frozen %s, state %d bytes, memory file %d bytes (apparent)", time.Duration(m.FrozenNS), m.Files[snapStateFile].Size, m.Files[snapMemFile].Size)
}
