package netpolicy

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/testutil"
)

// TestNSSysctlPerNamespace checks that writeNSSysctl, through the node's
// detached procfs mounts (replaced every procSysUses writes, so several of
// them here), sets the value of the calling thread's namespace and of no
// other: namespaces set up in between keep their own, one never set keeps
// the default, and every one reads the same through the host's /proc.
func TestNSSysctlPerNamespace(t *testing.T) {
	testutil.RequiresRoot(t)
	const key = "net/ipv6/conf/all/disable_ipv6"
	dir := t.TempDir()
	read := func(p string) string {
		t.Helper()
		var v []byte
		must(t, inNetNS(p, func() (err error) {
			v, err = os.ReadFile("/proc/sys/" + key)
			return err
		}))
		return strings.TrimSpace(string(v))
	}
	control := filepath.Join(dir, "control")
	must(t, createNetNS(control, nil))
	t.Cleanup(func() { removeNetNS(control) })
	n := 3*procSysUses + 1
	paths := make([]string, n)
	for i := range n {
		paths[i] = filepath.Join(dir, fmt.Sprint(i))
		// Every other one 1, the rest 0 written explicitly.
		v := fmt.Sprint(1 - i%2)
		must(t, createNetNS(paths[i], func() error { return writeNSSysctl(key, v) }))
		t.Cleanup(func() { removeNetNS(paths[i]) })
	}
	if procSys.off.Load() {
		t.Fatal("no detached procfs mount could be made: the writes went through /proc")
	}
	for i, p := range paths {
		if got, want := read(p), fmt.Sprint(1-i%2); got != want {
			t.Fatalf("namespace %d: %s = %s, want %s", i, key, got, want)
		}
	}
	if got := read(control); got != "0" {
		t.Fatalf("a namespace nobody wrote to: %s = %s, want 0", key, got)
	}
}
