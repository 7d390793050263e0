package vm

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/runtime/vmm"
)

// The agent channel on QEMU's command line, for each machine type: a
// vhost-vsock device of the machine's transport with the VM's CID and
// opendsec.agent=vsock, and no virtio-serial; or the serial port as before.
func TestArgsAgentChannel(t *testing.T) {
	spec := runtime.Spec{ID: "sb1", StateDir: "/s", Rootfs: runtime.Rootfs{Layers: []runtime.Layer{{Path: "/l/0.erofs"}}}}
	for _, tc := range []struct{ machine, dev string }{
		{"microvm", "vhost-vsock-device,id=vsock0,guest-cid=7"},
		{"q35", "vhost-vsock-pci,id=vsock0,guest-cid=7"},
	} {
		cfg := Config{Machine: tc.machine, AssetsDir: "/a"}
		if err := cfg.defaults(); err != nil {
			t.Fatal(err)
		}
		r := &Runtime{cfg: cfg, accel: "tcg"}
		args := r.args(spec, 1, 256, "/s/rw.ext4", "/m/sb1.mem", argOpts{cid: 7})
		a := strings.Join(args, " ")
		if !strings.Contains(a, "-device "+tc.dev) || !strings.Contains(a, " opendsec.agent=vsock") {
			t.Errorf("%s vsock args lack -device %s or opendsec.agent=vsock:\n%s", tc.machine, tc.dev, a)
		}
		if strings.Contains(a, "virtio-serial") || strings.Contains(a, "virtserialport") || strings.Contains(a, "id=agent") {
			t.Errorf("%s vsock args still have the serial port:\n%s", tc.machine, a)
		}
		if !argsVsock(args) {
			t.Errorf("%s: argsVsock false on vsock args", tc.machine)
		}
		serial := strings.Join(r.args(spec, 1, 256, "/s/rw.ext4", "/m/sb1.mem", argOpts{}), " ")
		wantSerial := "-device virtio-serial-device -chardev socket,id=agent,fd=4,server=on,wait=off -device virtserialport,chardev=agent,name=agent"
		if tc.machine == "q35" {
			wantSerial = strings.Replace(wantSerial, "virtio-serial-device", "virtio-serial-pci", 1)
		}
		if !strings.Contains(serial, wantSerial) || strings.Contains(serial, "vsock") {
			t.Errorf("%s serial args lack %q or have vsock:\n%s", tc.machine, wantSerial, serial)
		}
	}
}

// New decides the channel from /dev/vhost-vsock on this host: auto takes
// what is there, explicit vsock where it is not is refused naming the field.
func TestNewAgentChannelOnThisHost(t *testing.T) {
	ok, why := vhostVsock(vhostVsockPath)
	t.Logf("vhost-vsock here: %v (%s)", ok, why)
	rt, err := New(context.Background(), Config{Accel: "tcg", AssetsDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	ch, reason := rt.(*Runtime).AgentChannel()
	want := ChannelSerial
	if ok {
		want = ChannelVsock
	}
	if ch != want || !strings.Contains(reason, why) {
		t.Fatalf("auto channel %q (%s); want %q because %s", ch, reason, want, why)
	}
	_, err = New(context.Background(), Config{Accel: "tcg", AssetsDir: t.TempDir(), AgentChannel: "vsock"})
	if ok && err != nil {
		t.Fatalf("explicit vsock with vhost-vsock here: %v", err)
	}
	if !ok && (!errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "node.backends.vm.agent_channel") || !strings.Contains(err.Error(), why)) {
		t.Fatalf("explicit vsock without vhost-vsock: %v; want failed precondition naming node.backends.vm.agent_channel and %q", err, why)
	}
	if _, err := New(context.Background(), Config{Accel: "tcg", AgentChannel: "pipe"}); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "agent_channel") {
		t.Fatalf("agent_channel pipe: %v; want invalid argument naming agent_channel", err)
	}
}

// Recover keeps a VM's CID (its running QEMU has it): a new VM does not
// get it; after Delete it is free again.
func TestRecoverKeepsAgentCID(t *testing.T) {
	r := &Runtime{cfg: Config{NodeID: "cidtest", MemoryDir: t.TempDir()}, sbs: vmm.Table[sandbox]{Backend: Name}}
	sd := t.TempDir()
	if err := writeRunState(sd, runState{ID: "old"}); err != nil {
		t.Fatal(err)
	}
	st, _ := json.Marshal(handleState{StateDir: sd, AgentCID: 3, Args: []string{"-device", "vhost-vsock-device,id=vsock0,guest-cid=3"}})
	if err := r.Recover(context.Background(), runtime.Handle{ID: "old", Version: 1, State: st}); err != nil {
		t.Fatal(err)
	}
	if c := r.cids.alloc("new"); c != 4 {
		t.Fatalf("cid for a new VM beside a recovered one with 3: %d; want 4", c)
	}
	h, err := r.Handle("old")
	if err != nil {
		t.Fatal(err)
	}
	var got handleState
	if err := json.Unmarshal(h.State, &got); err != nil || got.AgentCID != 3 {
		t.Fatalf("recovered handle's cid %d (%v); want 3", got.AgentCID, err)
	}
	if err := r.Delete(context.Background(), "old"); err != nil {
		t.Fatal(err)
	}
	if got := r.cids.inUse(); !slices.Equal(got, []uint32{4}) {
		t.Fatalf("cids after Delete: %v; want [4]", got)
	}
}

// A vsock VM's AgentConn dials AF_VSOCK at its CID; a done context is
// refused before any connect (nothing is sent).
func TestAgentConnVsockHonoursContext(t *testing.T) {
	r := &Runtime{}
	r.sbs.Add("v", &sandbox{id: "v", st: handleState{AgentCID: 9}})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := r.AgentConn(ctx, "v")
	if !errors.Is(err, errdefs.ErrCanceled) || !strings.Contains(err.Error(), "vsock:9:1024") {
		t.Fatalf("AgentConn with a done context: %v; want canceled naming vsock:9:1024", err)
	}
}
