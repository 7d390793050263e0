package vm

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
)

// guestBootTimeout is generous: a TCG boot takes ~2 s on an idle machine,
// far more with other helpers' VMs and builds on the same 2 cores.
const guestBootTimeout = 90 * time.Second

// guestAssets builds (or reuses) the real guest kernel and initramfs with
// scripts/build-guest-assets.sh; "" and the reason when they cannot be built.
var guestAssets = sync.OnceValues(func() (string, string) {
	cache := os.Getenv("OPENDSEC_GUEST_CACHE")
	if cache == "" {
		cache = "/var/cache/opendsec/guest"
	}
	cmd := exec.Command("scripts/build-guest-assets.sh", "--cache", cache)
	cmd.Dir = "../../.."
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", "the guest assets cannot be built (scripts/build-guest-assets.sh: " + err.Error() + "): " + vmm.LastLines(errb.Bytes(), 3)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	return lines[len(lines)-1], ""
})

// skipOrFail skips a guest test whose assets cannot be had, except in CI
// (CI set), where .ci/run installed everything they need: there it fails.
func skipOrFail(t testing.TB, why string) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatal(why + " (CI is set: .ci/run installs what the guest assets need, so this is a failure)")
	}
	t.Skip(why)
}

// guestRuntime is a vm backend on the real guest assets.
func guestRuntime(t testing.TB) *Runtime {
	t.Helper()
	on := true // the guest tests cover the balloon (they fork only their own guests)
	dir, why := guestAssets()
	if dir == "" {
		skipOrFail(t, why)
	}
	rt, err := New(context.Background(), Config{AssetsDir: dir, Accel: "tcg", MemoryMB: 256, NodeID: "test", BootTimeoutSec: int(guestBootTimeout / time.Second), FreePageReporting: &on})
	if err != nil {
		t.Fatal(err)
	}
	return rt.(*Runtime)
}

// sharedGuest is one booted VM for the package's guest tests (a boot costs
// seconds of TCG on 2 cores); TestMain deletes it.
var sharedGuest struct {
	once    sync.Once
	rt      *Runtime
	id, dir string
	ns      *tapNetNS
	boot    time.Duration
	err     error
	skip    string
}

func guestVM(t *testing.T) (*Runtime, string) {
	t.Helper()
	rootOnly(t)
	g := &sharedGuest
	g.once.Do(func() {
		dir, why := guestAssets()
		if dir == "" {
			g.skip = why
			return
		}
		g.rt = guestRuntime(t)
		g.id = "guest-shared"
		g.dir, g.err = os.MkdirTemp("", "opendsec-vm-guest-")
		if g.err != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), guestBootTimeout+10*time.Second)
		defer cancel()
		if g.ns, g.err = newTapNetNS("odvmshared" + strconv.Itoa(os.Getpid())); g.err != nil {
			return
		}
		if _, g.err = g.rt.Create(ctx, sharedGuestSpec(t, g.id, g.dir, g.ns)); g.err != nil {
			return
		}
		start := time.Now()
		g.err = g.rt.Start(ctx, g.id)
		g.boot = time.Since(start)
	})
	if g.skip != "" {
		skipOrFail(t, g.skip)
	}
	if g.err != nil {
		t.Fatalf("shared guest VM: %v", g.err)
	}
	return g.rt, g.id
}

func TestMain(m *testing.M) {
	code := m.Run()
	if g := &sharedGuest; g.rt != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		_ = g.rt.Delete(ctx, g.id)
		cancel()
		_ = os.RemoveAll(g.dir)
		if g.ns != nil {
			g.ns.close()
		}
	}
	if dir, err := testImageDir(); err == nil {
		_ = os.RemoveAll(dir)
	}
	os.Exit(code)
}

// TestGuestAgentRunsCommand boots the real kernel + initramfs (the guest
// init bridges the agent onto the virtio-serial port) and runs a command
// through AgentConn: Start returned only once /health answered.
func TestGuestAgentRunsCommand(t *testing.T) {
	r, id := guestVM(t)
	t.Logf("exec to agent ready: %s", sharedGuest.boot)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := runtimetest.Run(ctx, r, id, "", "/bin/sh", "-c", "echo hi; hostname")
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 0 || res.Stdout != "hi\n"+id+"\n" {
		t.Fatalf("echo hi; hostname: exit %d stdout %q stderr %q; want 0, %q", res.ExitCode, res.Stdout, res.Stderr, "hi\n"+id+"\n")
	}
	console, err := os.ReadFile(filepath.Join(sharedGuest.dir, "console.log"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(console, []byte("opendsec: agent ready")) {
		t.Fatalf("console.log lacks the ready line:\n%s", console)
	}
}

// TestGuestAgentConcurrentStreams runs commands on several AgentConns at once
// over the one serial port.
func TestGuestAgentConcurrentStreams(t *testing.T) {
	r, id := guestVM(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const n = 4
	errs := make(chan error, n)
	outs := make(chan string, n)
	for i := range n {
		go func() {
			res, err := runtimetest.Run(ctx, r, id, "", "/bin/sh", "-c", "echo $0", string(rune('a'+i)))
			errs <- err
			outs <- res.Stdout
		}()
	}
	var got []string
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
		got = append(got, <-outs)
	}
	slices.Sort(got)
	if want := []string{"a\n", "b\n", "c\n", "d\n"}; !slices.Equal(got, want) {
		t.Fatalf("outputs %q, want %q", got, want)
	}
}

// TestGuestStartTimesOutWithConsole: a guest whose agent never answers (the
// halting stand-in kernel) makes Start fail at the boot timeout with the
// console in the error, and leaves no QEMU running.
func TestGuestStartTimesOutWithConsole(t *testing.T) {
	rootOnly(t)
	r, _ := newTestRuntime(t)
	r.cfg.noAgentWait = false
	r.cfg.BootTimeoutSec = 1
	ctx := context.Background()
	if _, err := r.Create(ctx, runtime.Spec{ID: "noagent", StateDir: t.TempDir(), Rootfs: haltRootfs(), Resources: haltRes(16)}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Delete(context.Background(), "noagent") })
	err := r.Start(ctx, "noagent")
	if err == nil || !strings.Contains(err.Error(), "did not answer within 1s") || !strings.Contains(err.Error(), "console:") {
		t.Fatalf("Start = %v, want a boot timeout naming the console", err)
	}
	st, err := r.Status(ctx, "noagent")
	if err != nil {
		t.Fatal(err)
	}
	if st.State == runtime.StateRunning {
		t.Fatalf("status %v after a failed start, want not running", st.State)
	}
}

// TestGuestImageLayersAreRoot boots with two EROFS layers: the guest init
// mounts them under an overlay with the writable ext4 disk and switches
// into it, so the agent sees the image's files (the topmost layer wins) and
// writes land on the writable layer.
func TestGuestImageLayersAreRoot(t *testing.T) {
	rootOnly(t)
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		skipOrFail(t, "mkfs.erofs (erofs-utils) makes the test's layers: "+err.Error())
	}
	r := guestRuntime(t)
	tmp := t.TempDir()
	var layers []runtime.Layer
	for i, files := range []map[string]string{
		{"etc/marker": "top\n"},
		{"etc/marker": "bottom\n", "etc/only-bottom": "lower\n"},
	} {
		dir := filepath.Join(tmp, "l"+string(rune('0'+i)))
		for p, c := range files {
			if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, p)), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		img := dir + ".erofs"
		if out, err := exec.Command("mkfs.erofs", "--quiet", img, dir).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.erofs: %v: %s", err, out)
		}
		layers = append(layers, runtime.Layer{Digest: "sha256:test" + string(rune('0'+i)), Format: runtime.LayerEROFS, Path: img})
	}
	ctx, cancel := context.WithTimeout(context.Background(), guestBootTimeout+30*time.Second)
	defer cancel()
	const id = "guest-layers"
	if _, err := r.Create(ctx, runtime.Spec{ID: id, StateDir: filepath.Join(tmp, "state"), Rootfs: runtime.Rootfs{Layers: layers}, Resources: guestRes(16)}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Delete(context.Background(), id) })
	if err := r.Start(ctx, id); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{"/etc/marker": "top\n", "/etc/only-bottom": "lower\n"} {
		b, err := runtimetest.ReadFile(ctx, r, id, p)
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != want {
			t.Errorf("%s = %q, want %q", p, b, want)
		}
	}
	if _, err := runtimetest.ReadFile(ctx, r, id, "/bin/opendsec-agent"); !errors.Is(err, runtimetest.ErrNoFile) {
		t.Errorf("/bin/opendsec-agent (initramfs only) read: %v, want %v: the root is still the initramfs", err, runtimetest.ErrNoFile)
	}
	if err := runtimetest.WriteFile(ctx, r, id, "/etc/written", []byte("rw\n")); err != nil {
		t.Fatal(err)
	}
	if b, err := runtimetest.ReadFile(ctx, r, id, "/etc/written"); err != nil || string(b) != "rw\n" {
		t.Fatalf("/etc/written = %q, %v; want \"rw\\n\"", b, err)
	}
}
