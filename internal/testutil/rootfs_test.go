package testutil

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestBusyboxRootfs(t *testing.T) {
	RequiresRoot(t) // the rootfs has files owned by uid 1000
	dir := BusyboxRootfs(t)
	if again := BusyboxRootfs(t); again != dir {
		t.Fatalf("second call returned %s, want the cached %s", again, dir)
	}
	for _, p := range []string{"bin/busybox", "bin/sh", "bin/ls", "etc/passwd", "etc/group", "home/user", "tmp"} {
		if _, err := os.Lstat(filepath.Join(dir, p)); err != nil {
			t.Errorf("rootfs lacks %s: %v", p, err)
		}
	}
	if target, err := os.Readlink(filepath.Join(dir, "bin", "sh")); err != nil || target != "/bin/busybox" {
		t.Errorf("/bin/sh -> %q, %v; want /bin/busybox", target, err)
	}
	passwd, err := os.ReadFile(filepath.Join(dir, "etc", "passwd"))
	if err != nil || !strings.Contains(string(passwd), "user:x:1000:1000:") || !strings.HasPrefix(string(passwd), "root:x:0:0:") {
		t.Errorf("passwd %q, %v", passwd, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "tmp")); err != nil || fi.Mode()&os.ModeSticky == 0 {
		t.Errorf("/tmp is not sticky: %v", err)
	}
}

func TestBusyboxRootfsRebuildsWithoutStamp(t *testing.T) {
	RequiresRoot(t) // the rootfs has files owned by uid 1000
	// A private cache: the shared one may be a lower layer of running tests.
	cache := t.TempDir()
	dir := busyboxRootfsIn(t, cache)
	stamp := dir + ".stamp"
	if err := os.Remove(stamp); err != nil {
		t.Fatal(err)
	}
	marker := filepath.Join(dir, "stale-marker")
	if err := os.WriteFile(marker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got := busyboxRootfsIn(t, cache); got != dir {
		t.Fatalf("rebuilt at %s, want %s", got, dir)
	}
	if _, err := os.Stat(marker); err == nil {
		t.Fatalf("rootfs was not rebuilt after its stamp was removed")
	}
	if _, err := os.Stat(stamp); err != nil {
		t.Fatalf("stamp not rewritten: %v", err)
	}
}

func TestAgentBinary(t *testing.T) {
	p := AgentBinary(t)
	fi, err := os.Stat(p)
	if err != nil || fi.Mode()&0o111 == 0 {
		t.Fatalf("agent binary %s: %v mode %v", p, err, fi.Mode())
	}
	b, err := os.ReadFile(p)
	if err != nil || len(b) < 4 || string(b[:4]) != "\x7fELF" {
		t.Fatalf("agent binary is not an ELF file")
	}
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	sum, err := agentSourceHash(root)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(filepath.Dir(p), sum[:16]) {
		t.Fatalf("binary %s not keyed by the source hash %s", p, sum[:16])
	}
	ip := InitBinary(t)
	if filepath.Dir(ip) != filepath.Dir(p) {
		t.Fatalf("init %s is not next to the agent %s", ip, p)
	}
	if b, err := os.ReadFile(ip); err != nil || len(b) < 4 || string(b[:4]) != "\x7fELF" {
		t.Fatalf("init binary %s is not an ELF file: %v", ip, err)
	}
}
