package testutil

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// busyboxVersion names the rootfs layout. Bump it when BusyboxRootfs changes
// what it builds: a new version builds into a new directory, so a rootfs in
// use as a lower layer by a running test is never rebuilt underneath it.
const busyboxVersion = "v2"

// CacheDir returns the directory for fixtures that outlive one test process
// (/var/cache/opendsec/test when writable, else the user's cache dir).
func CacheDir(t testing.TB) string {
	t.Helper()
	dirs := []string{"/var/cache/opendsec/test"}
	if d, err := os.UserCacheDir(); err == nil {
		dirs = append(dirs, filepath.Join(d, "opendsec-test"))
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			continue
		}
		if f, err := os.CreateTemp(d, ".probe"); err == nil {
			f.Close()
			os.Remove(f.Name())
			return d
		}
	}
	t.Fatalf("no writable cache dir among %v", dirs)
	return ""
}

// withFileLock runs fn while holding an exclusive flock on path, so
// concurrent test processes build a cached fixture only once.
func withFileLock(t testing.TB, path string, fn func() error) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatalf("open lock file: %v", err)
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatalf("lock %s: %v", path, err)
	}
	defer syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	if err := fn(); err != nil {
		t.Fatal(err)
	}
}

// BusyboxRootfs returns a minimal root filesystem built from Debian's static
// busybox (/bin/busybox, package busybox-static): every applet as a symlink,
// /etc/passwd with root and user (uid 1000), /tmp, /home/user. It is built
// once and cached across test processes; treat it as read-only (use it as a
// lower layer).
func BusyboxRootfs(t testing.TB) string {
	t.Helper()
	return busyboxRootfsIn(t, CacheDir(t))
}

func busyboxRootfsIn(t testing.TB, cache string) string {
	t.Helper()
	dir := filepath.Join(cache, "busybox-rootfs-"+busyboxVersion)
	stamp := dir + ".stamp"
	want := "busybox-rootfs " + busyboxVersion + "\n"
	withFileLock(t, filepath.Join(cache, "busybox-rootfs.lock"), func() error {
		if b, err := os.ReadFile(stamp); err == nil && string(b) == want {
			if _, err := os.Stat(filepath.Join(dir, "bin", "busybox")); err == nil {
				return nil
			}
		}
		os.Remove(stamp)
		if err := os.RemoveAll(dir); err != nil {
			return fmt.Errorf("remove stale busybox rootfs: %w", err)
		}
		tmp := dir + ".tmp"
		os.RemoveAll(tmp)
		if err := buildBusyboxRootfs(tmp); err != nil {
			os.RemoveAll(tmp)
			return fmt.Errorf("build busybox rootfs: %w", err)
		}
		if err := os.Rename(tmp, dir); err != nil {
			return fmt.Errorf("install busybox rootfs: %w", err)
		}
		return os.WriteFile(stamp, []byte(want), 0o644)
	})
	return dir
}

func buildBusyboxRootfs(dir string) error {
	const src = "/bin/busybox"
	if _, err := os.Stat(src); err != nil {
		return fmt.Errorf("static busybox missing (apt-get install busybox-static): %w", err)
	}
	for _, d := range []string{"bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "home/user",
		"proc", "sys", "dev", "run", "mnt", "var/tmp"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "tmp"), 0o755); err != nil {
		return err
	}
	if err := os.Chmod(filepath.Join(dir, "tmp"), os.ModeSticky|0o777); err != nil {
		return err
	}
	if err := os.Chmod(filepath.Join(dir, "root"), 0o700); err != nil {
		return err
	}
	if err := copyFile(src, filepath.Join(dir, "bin", "busybox"), 0o755); err != nil {
		return err
	}
	out, err := exec.Command(src, "--list-full").Output()
	if err != nil {
		return fmt.Errorf("list busybox applets: %w", err)
	}
	for _, p := range strings.Fields(string(out)) {
		if p == "bin/busybox" {
			continue
		}
		dst := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		if err := os.Symlink("/bin/busybox", dst); err != nil && !os.IsExist(err) {
			return fmt.Errorf("link applet %s: %w", p, err)
		}
	}
	files := map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"etc/group":  "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n",
		"etc/hosts":  "127.0.0.1 localhost\n::1 localhost\n",
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			return err
		}
	}
	return os.Chown(filepath.Join(dir, "home", "user"), 1000, 1000)
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

var agentBuild struct {
	mu   sync.Mutex
	path string // guarded by mu; set once built in this process
}

// AgentBinary builds ./cmd/opendsec-agent (static, CGO_ENABLED=0) and
// opendsec-init (C, scripts/build-init.sh) once per test process, side by side in one
// directory (the container backend finds opendsec-init next to the agent),
// and returns the agent's path. The pair is cached across processes in a
// directory keyed by a hash of every source file they are built from, so
// they are rebuilt after any change to either or the packages they import.
func AgentBinary(t testing.TB) string {
	t.Helper()
	agentBuild.mu.Lock()
	defer agentBuild.mu.Unlock()
	if agentBuild.path != "" {
		return agentBuild.path
	}
	root, err := moduleRoot()
	if err != nil {
		t.Fatalf("find module root: %v", err)
	}
	sum, err := agentSourceHash(root)
	if err != nil {
		t.Fatalf("hash agent sources: %v", err)
	}
	cache := CacheDir(t)
	dir := filepath.Join(cache, "agent-"+sum[:16])
	withFileLock(t, filepath.Join(cache, "opendsec-agent.lock"), func() error {
		if _, err := os.Stat(dir); err == nil {
			return nil
		}
		tmp := dir + ".tmp"
		os.RemoveAll(tmp)
		cmd := exec.Command("go", "build", "-trimpath", "-o", filepath.Join(tmp, "opendsec-agent"), "./cmd/opendsec-agent")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			os.RemoveAll(tmp)
			return fmt.Errorf("build opendsec-agent: %w\n%s", err, out)
		}
		if err := BuildInit(root, filepath.Join(tmp, "opendsec-init")); err != nil {
			os.RemoveAll(tmp)
			return err
		}
		if err := os.Rename(tmp, dir); err != nil {
			return err
		}
		pruneAgents(cache, dir)
		return nil
	})
	agentBuild.path = filepath.Join(dir, "opendsec-agent")
	return agentBuild.path
}

// BuildInit builds opendsec-init (C, cmd/opendsec-init/init.c) of the
// repository at root into out, and the crun libsystemd without systemd
// beside it, as make agent does.
func BuildInit(root, out string) error {
	cmd := exec.Command("bash", filepath.Join(root, initBuildScript), out, root)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build opendsec-init: %w\n%s", err, b)
	}
	return nil
}

// InitBinary returns the opendsec-init built with AgentBinary, next to it.
func InitBinary(t testing.TB) string {
	t.Helper()
	return filepath.Join(filepath.Dir(AgentBinary(t)), "opendsec-init")
}

// pruneAgents removes agent builds of older sources, once they are an hour
// old (a running sandbox keeps its bind-mounted copy alive anyway).
func pruneAgents(cache, keep string) {
	old, _ := filepath.Glob(filepath.Join(cache, "opendsec-agent-*"))
	dirs, _ := filepath.Glob(filepath.Join(cache, "agent-*"))
	for _, p := range append(old, dirs...) {
		fi, err := os.Stat(p)
		if p == keep || strings.HasSuffix(p, ".tmp") || err != nil || time.Since(fi.ModTime()) < time.Hour {
			continue
		}
		os.RemoveAll(p)
	}
}

func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod above the working directory")
		}
		dir = parent
	}
}

// initBuildScript builds opendsec-init from initSources.
const initBuildScript = "scripts/build-init.sh"

// initSources are the files opendsec-init and, beside it, the crun
// libsystemd without systemd are built from.
var initSources = []string{"cmd/opendsec-init/init.c", initBuildScript,
	"internal/runtime/container/crunlib/libsystemd.c", "internal/runtime/container/crunlib/libsystemd.map"}

// agentSourceHash hashes go.mod, go.sum, the Go files of every package of
// this module that the agent imports, and init's sources.
func agentSourceHash(root string) (string, error) {
	cmd := exec.Command("go", "list", "-deps", "-f",
		`{{if .Module}}{{if .Module.Main}}{{.Dir}}{{range .GoFiles}} {{.}}{{end}}{{range .EmbedFiles}} {{.}}{{end}}{{end}}{{end}}`,
		"./cmd/opendsec-agent")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		return "", fmt.Errorf("list agent packages (is cmd/opendsec-agent committed?): %w: %s", err, stderr)
	}
	files := []string{filepath.Join(root, "go.mod"), filepath.Join(root, "go.sum")}
	for _, f := range initSources {
		files = append(files, filepath.Join(root, f))
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		for _, name := range f[1:] {
			files = append(files, filepath.Join(f[0], name))
		}
	}
	sort.Strings(files)
	h := sha256.New()
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil && !os.IsNotExist(err) {
			return "", err
		}
		fmt.Fprintf(h, "%s %d\n", f, len(b))
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
