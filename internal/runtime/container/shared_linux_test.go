package container

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kernflux/opendsec/internal/interpreter"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/runtimetest"
)

// TestSharedFilesReadOnly: the seccomp filter, the code interpreter and
// resolv.conf are one node-wide file each, not files of the bundle; root
// in a sandbox can neither change, replace, chmod nor unmount them, and
// another sandbox reads them unchanged.
func TestSharedFilesReadOnly(t *testing.T) {
	f := newFactory(t)
	rt, tmpl := f(t)
	tmpl.Guest.Nameservers = []string{"192.0.2.53"}
	a, _ := runtimetest.StartSandbox(t, rt, tmpl)
	b, _ := runtimetest.StartSandbox(t, rt, tmpl)

	shared := map[string]string{} // path in sandbox -> host source
	for _, sb := range []runtime.Spec{a, b} {
		for _, name := range []string{seccompFile, interpreterFile, resolvFile} {
			if _, err := os.Lstat(filepath.Join(sb.StateDir, name)); err == nil {
				t.Errorf("bundle of %s has its own %s", sb.ID, name)
			}
		}
		raw, err := os.ReadFile(filepath.Join(sb.StateDir, tmpDir, configFile))
		if err != nil {
			t.Fatal(err)
		}
		var sp specs.Spec
		if err := json.Unmarshal(raw, &sp); err != nil {
			t.Fatal(err)
		}
		for _, m := range sp.Mounts {
			switch m.Destination {
			case seccompInSandbox, interpreter.PathInSandbox, "/etc/resolv.conf":
			default:
				continue
			}
			for _, o := range []string{"ro", "nosuid", "nodev", "noexec"} {
				if !strings.Contains(","+strings.Join(m.Options, ",")+",", ","+o+",") {
					t.Errorf("%s: mount of %s lacks %s: %v", sb.ID, m.Destination, o, m.Options)
				}
			}
			if prev, ok := shared[m.Destination]; ok && prev != m.Source {
				t.Errorf("%s comes from %s in one sandbox and %s in another", m.Destination, prev, m.Source)
			}
			shared[m.Destination] = m.Source
		}
	}
	if len(shared) != 3 {
		t.Fatalf("shared mounts %v, want the filter, the interpreter and resolv.conf", shared)
	}
	want := map[string][]byte{}
	for dest, src := range shared {
		if !strings.HasPrefix(src, rt.(*Runtime).cfg.sharedDir()+"/") {
			t.Errorf("%s comes from %s, outside the node's shared dir", dest, src)
		}
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		want[dest] = b
	}
	if !bytes.Equal(want[seccompInSandbox], rt.(*Runtime).seccomp) || !bytes.Equal(want[interpreter.PathInSandbox], interpreter.Source) ||
		string(want["/etc/resolv.conf"]) != "nameserver 192.0.2.53\n" {
		t.Fatalf("shared files do not hold the filter, the interpreter and resolv.conf")
	}

	for dest := range shared {
		for _, attack := range []string{
			"echo x >> " + dest,
			"echo x > " + dest,
			"chmod 666 " + dest,
			"chown 1000 " + dest,
			"touch " + dest,
			"rm -f " + dest,
			"mv " + dest + " " + dest + ".moved",
			"mount -o remount,rw " + dest,
			"mount -o remount,rw,bind " + dest,
			"umount " + dest,
			"umount -l " + dest,
		} {
			res := sh(t, rt, a.ID, attack+" 2>&1")
			if res.ExitCode == 0 {
				t.Errorf("root in the sandbox ran %q: %s", attack, res.Stdout)
			}
		}
	}
	for dest, src := range shared {
		got, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[dest]) {
			t.Errorf("the node's %s changed", src)
		}
		sum := sha256.Sum256(want[dest])
		for _, id := range []string{a.ID, b.ID} {
			res := sh(t, rt, id, "sha256sum "+dest)
			if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, hex.EncodeToString(sum[:])) {
				t.Errorf("%s in sandbox %s: %q (exit %d), want sha256 %x", dest, id, res.Stdout, res.ExitCode, sum)
			}
		}
	}
}
