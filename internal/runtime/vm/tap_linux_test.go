package vm

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/kernflux/opendsec/internal/runtime"
)

// QEMU runs in the sandbox's netns with the tap there as its NIC, with the
// attachment's MAC.
func TestQEMUInNetnsWithTap(t *testing.T) {
	rootOnly(t)
	r, _ := newTestRuntime(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ns := "odvmtest" + strconv.Itoa(os.Getpid())
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	run("netns", "add", ns)
	defer func() { _ = exec.Command("ip", "netns", "del", ns).Run() }()
	run("-n", ns, "tuntap", "add", "tap0", "mode", "tap")
	mac, _ := net.ParseMAC("02:0d:5e:00:00:21")
	nsPath := "/run/netns/" + ns
	h, err := r.Create(ctx, runtime.Spec{ID: "vm-tap", StateDir: t.TempDir(), Rootfs: haltRootfs(), Resources: haltRes(16),
		Network: runtime.NetworkAttachment{Mode: runtime.NetworkTap, NetNS: nsPath, Device: "tap0", MAC: mac}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Delete(context.Background(), h.ID) }()
	if err := r.Start(ctx, h.ID); err != nil {
		t.Fatal(err)
	}
	st, _ := r.Status(ctx, h.ID)
	var want, got os.FileInfo
	if want, err = os.Stat(nsPath); err != nil {
		t.Fatal(err)
	}
	if got, err = os.Stat(filepath.Join("/proc", strconv.Itoa(st.Pid), "ns", "net")); err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(want, got) {
		t.Fatalf("qemu %d is not in the sandbox's netns", st.Pid)
	}
	raw, err := r.sbs.Lookup(h.ID).qmp.Execute(ctx, "query-rx-filter", nil)
	if err != nil {
		t.Fatal(err)
	}
	var nics []struct {
		MainMAC string `json:"main-mac"`
	}
	if err := json.Unmarshal(raw, &nics); err != nil || len(nics) != 1 || nics[0].MainMAC != mac.String() {
		t.Fatalf("nics %s (%v), want one with %s", raw, err, mac)
	}
}
