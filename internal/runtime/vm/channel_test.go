package vm

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// The agent channel decision for each setting, with vhost-vsock there and not.
func TestDecideChannel(t *testing.T) {
	const no = "no /dev/vhost-vsock: the vhost_vsock module is not loaded"
	for _, tc := range []struct {
		cfg     string
		ok      bool
		want    string
		wantErr error
	}{
		{"", true, ChannelVsock, nil},
		{"auto", true, ChannelVsock, nil},
		{"", false, ChannelSerial, nil},
		{"auto", false, ChannelSerial, nil},
		{"serial", true, ChannelSerial, nil},
		{"serial", false, ChannelSerial, nil},
		{"vsock", true, ChannelVsock, nil},
		{"vsock", false, "", errdefs.ErrFailedPrecondition},
		{"virtio", true, "", errdefs.ErrInvalidArgument},
	} {
		why := "/dev/vhost-vsock opens"
		if !tc.ok {
			why = no
		}
		got, reason, err := decideChannel(tc.cfg, tc.ok, why)
		if tc.wantErr != nil {
			if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), "node.backends.vm.agent_channel") {
				t.Errorf("%q (vsock %v): err %v; want %v naming node.backends.vm.agent_channel", tc.cfg, tc.ok, err, tc.wantErr)
			}
			if tc.cfg == "vsock" && !strings.Contains(err.Error(), no) {
				t.Errorf("%q without vhost-vsock: %v does not say why", tc.cfg, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%q (vsock %v): %q, %v; want %q", tc.cfg, tc.ok, got, err, tc.want)
		}
		if (tc.cfg == "" || tc.cfg == "auto") && !strings.Contains(reason, why) {
			t.Errorf("%q (vsock %v): reason %q lacks %q", tc.cfg, tc.ok, reason, why)
		}
	}
}

// CIDs are unique, start at 3, are used again after release, and a
// kept one (Recover) is not handed out; keeping another's is refused.
func TestCIDAllocator(t *testing.T) {
	var a cidAllocator
	c1, c2 := a.alloc("a"), a.alloc("b")
	if c1 != 3 || c2 != 4 {
		t.Fatalf("first cids %d, %d; want 3, 4", c1, c2)
	}
	if err := a.keep("r", 5); err != nil {
		t.Fatal(err)
	}
	if c := a.alloc("c"); c != 6 {
		t.Fatalf("cid after a kept 5: %d; want 6", c)
	}
	if err := a.keep("x", 4); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("keep of b's cid for x: %v; want already exists", err)
	}
	if err := a.keep("b", 4); err != nil {
		t.Fatalf("keep of b's own cid: %v", err)
	}
	a.release("x", 3) // not x's: stays a's
	if c := a.alloc("d"); c != 7 {
		t.Fatalf("cid after a release by the wrong sandbox: %d; want 7", c)
	}
	a.release("a", 3)
	if c := a.alloc("e"); c != 3 {
		t.Fatalf("cid after a's release: %d; want 3 again", c)
	}
	if got := a.inUse(); !slices.Equal(got, []uint32{3, 4, 5, 6, 7}) {
		t.Fatalf("in use %v", got)
	}
}

// A restore's command line gets its own guest-cid; nothing else changes.
func TestSetArgsCID(t *testing.T) {
	src := []string{"-name", "opendsec-a", "-device", "vhost-vsock-device,id=vsock0,guest-cid=3", "-device", "virtio-blk-device,drive=rw", "-append", "x guest-cid=3"}
	got := setArgsCID(src, 12)
	want := []string{"-name", "opendsec-a", "-device", "vhost-vsock-device,id=vsock0,guest-cid=12", "-device", "virtio-blk-device,drive=rw", "-append", "x guest-cid=3"}
	if !slices.Equal(got, want) {
		t.Fatalf("setArgsCID:\n%q\nwant\n%q", got, want)
	}
	if src[3] != "vhost-vsock-device,id=vsock0,guest-cid=3" {
		t.Fatalf("setArgsCID changed its input: %q", src[3])
	}
	if !argsVsock(src) || argsVsock(src[4:]) {
		t.Fatal("argsVsock")
	}
	if got := setArgsCID([]string{"-device", "vhost-vsock-pci,guest-cid=3,id=v"}, 9); got[1] != "vhost-vsock-pci,guest-cid=9,id=v" {
		t.Fatalf("setArgsCID mid-string: %q", got[1])
	}
}

// A CID another program's VM holds on the host is skipped.
func TestCIDAllocatorSkipsTakenOnHost(t *testing.T) {
	a := cidAllocator{taken: func(c uint32) bool { return c == 3 || c == 5 }}
	if c1, c2, c3 := a.alloc("a"), a.alloc("b"), a.alloc("c"); c1 != 4 || c2 != 6 || c3 != 7 {
		t.Fatalf("cids %d %d %d beside 3 and 5 taken elsewhere; want 4 6 7", c1, c2, c3)
	}
}
