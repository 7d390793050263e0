package vm

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Agent channels (Config.AgentChannel).
const (
	ChannelAuto   = "auto"
	ChannelSerial = "serial"
	ChannelVsock  = "vsock"
)

// AgentVsockPort is the guest port the guest init serves the agent on
// with opendsec.agent=vsock (cmd/opendsec-guestinit).
const AgentVsockPort = 1024

// firstGuestCID is the lowest CID a guest can have (0-2 are the
// hypervisor, the loopback and the host).
const firstGuestCID = 3

// decideChannel is the agent channel of the backend's booted VMs: the
// configured one ("" and "auto": vsock where the host has vhost-vsock,
// else serial), and why. Explicit vsock without vhost-vsock is refused,
// naming the field and the reason (vsockWhy).
func decideChannel(configured string, vsockOK bool, vsockWhy string) (string, string, error) {
	switch configured {
	case "", ChannelAuto:
		if vsockOK {
			return ChannelVsock, "auto: " + vsockWhy, nil
		}
		return ChannelSerial, "auto: " + vsockWhy, nil
	case ChannelSerial:
		return ChannelSerial, "configured", nil
	case ChannelVsock:
		if !vsockOK {
			return "", "", fmt.Errorf("node.backends.vm.agent_channel %q: %w: %s; load vhost_vsock or set agent_channel to %q or %q",
				configured, errdefs.ErrFailedPrecondition, vsockWhy, ChannelAuto, ChannelSerial)
		}
		return ChannelVsock, "configured: " + vsockWhy, nil
	}
	return "", "", fmt.Errorf("node.backends.vm.agent_channel %q: %w: use %q (default), %q or %q",
		configured, errdefs.ErrInvalidArgument, ChannelAuto, ChannelSerial, ChannelVsock)
}

// cidAllocator hands out guest CIDs, unique among the backend's VMs: the
// lowest free one, so a deleted VM's CID is used again.
type cidAllocator struct {
	mu   sync.Mutex
	used map[uint32]string // CID -> sandbox ID
	// taken, if set, says whether a CID is held outside this backend
	// (another node's VM on the host): such a CID is skipped.
	taken func(cid uint32) bool
}

// maxCIDProbes bounds the CIDs alloc skips as taken elsewhere.
const maxCIDProbes = 4096

// alloc gives id a CID of its own.
func (a *cidAllocator) alloc(id string) uint32 {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.used == nil {
		a.used = map[uint32]string{}
	}
	skipped := 0
	for c := uint32(firstGuestCID); ; c++ {
		if _, ok := a.used[c]; ok {
			continue
		}
		if a.taken != nil && skipped < maxCIDProbes && a.taken(c) {
			skipped++
			continue
		}
		a.used[c] = id
		return c
	}
}

// keep records cid as id's (Recover). A CID another sandbox holds is an
// error: the two QEMUs could not both have it.
func (a *cidAllocator) keep(id string, cid uint32) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.used == nil {
		a.used = map[uint32]string{}
	}
	if o, ok := a.used[cid]; ok && o != id {
		return fmt.Errorf("vm %s guest cid %d: %w: sandbox %s has it", id, cid, errdefs.ErrAlreadyExists, o)
	}
	a.used[cid] = id
	return nil
}

// release frees id's cid (Delete, a failed Create).
func (a *cidAllocator) release(id string, cid uint32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.used[cid] == id {
		delete(a.used, cid)
	}
}

// inUse lists the allocated CIDs, sorted (tests).
func (a *cidAllocator) inUse() []uint32 {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]uint32, 0, len(a.used))
	for c := range a.used {
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// vsockDevice is the vhost-vsock device for machine ("microvm":
// virtio-mmio; "q35": PCI) with guest CID cid.
func vsockDevice(machine string, cid uint32) string {
	dev := "vhost-vsock-device"
	if machine == "q35" {
		dev = "vhost-vsock-pci"
	}
	return dev + ",id=vsock0,guest-cid=" + strconv.FormatUint(uint64(cid), 10)
}

// argsVsock says whether a QEMU command line has a vhost-vsock device.
func argsVsock(args []string) bool {
	for i, a := range args {
		if a == "-device" && i+1 < len(args) && strings.HasPrefix(args[i+1], "vhost-vsock-") {
			return true
		}
	}
	return false
}

// setArgsCID is args with the vhost-vsock device's guest-cid set to cid
// (a restore: guest-cid is a device property, not migrated state, so the
// clone's -incoming command line gives it its own CID; the guest driver
// reads the new one at the transport reset QEMU sends after the load).
func setArgsCID(args []string, cid uint32) []string {
	out := make([]string, len(args))
	for i, a := range args {
		if i > 0 && args[i-1] == "-device" && strings.HasPrefix(a, "vhost-vsock-") {
			if j := strings.Index(a, ",guest-cid="); j >= 0 {
				rest := a[j+len(",guest-cid="):]
				k := strings.IndexByte(rest, ',')
				tail := ""
				if k >= 0 {
					tail = rest[k:]
				}
				a = a[:j] + ",guest-cid=" + strconv.FormatUint(uint64(cid), 10) + tail
			}
		}
		out[i] = a
	}
	return out
}
