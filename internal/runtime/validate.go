package runtime

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// SpecRules are what one backend accepts in a Spec, for ValidateSpec.
type SpecRules struct {
	// Backend is the backend's name, for messages.
	Backend string
	// MinMemoryMB and MemoryWhy: resources.memory_mb must be at least
	// MinMemoryMB, because MemoryWhy ("the agent alone needs a few MiB").
	MinMemoryMB int64
	MemoryWhy   string
	// MinCPU is the least resources.cpu (cores, more than 0).
	MinCPU float64
	// MinPids, DefaultPids: a non-zero resources.pids_limit is at least
	// MinPids; 0 means DefaultPids. MaxPids, when set, is the most one
	// sandbox may have on this node (node.max_pids_limit).
	MinPids, DefaultPids, MaxPids int64
	// Networks are the attachment modes the backend takes besides
	// NetworkNone, and NetworkHint says which to give and why.
	Networks    []NetworkMode
	NetworkHint string
	// LayerDisks: the backend hands EROFS layers to its guest as disks
	// itself (a VM), so it needs no Rootfs.Mounter.
	LayerDisks bool
}

// ValidateSpec checks what every backend checks in a Spec before it makes
// anything: the ID, the layers (absolute paths without ':' or ',', of a
// known format, a mounter for EROFS), the state dir, the limits, the guest
// settings and the network mode (a namespace path for every mode but
// NetworkNone). Errors are errdefs.Invalid naming the field and the fix.
// A backend checks what only it needs after it.
func ValidateSpec(s Spec, r SpecRules) error {
	switch {
	case s.ID == "":
		return errdefs.Invalid("id", "must not be empty")
	case len(s.ID) > 64 || strings.ContainsFunc(s.ID, func(c rune) bool {
		return !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_')
	}):
		return errdefs.Invalid("id", "%q must be 1-64 characters of [a-zA-Z0-9_-]", s.ID)
	case len(s.Rootfs.Layers) == 0:
		return errdefs.Invalid("rootfs.layers", "must list at least one layer")
	case s.StateDir == "" || !filepath.IsAbs(s.StateDir):
		return errdefs.Invalid("state_dir", "must be an absolute directory path, got %q", s.StateDir)
	case s.Resources.MemoryMB < r.MinMemoryMB:
		return errdefs.Invalid("resources.memory_mb", "must be at least %d (%s), got %d", r.MinMemoryMB, r.MemoryWhy, s.Resources.MemoryMB)
	case s.Resources.CPU <= 0 || s.Resources.CPU < r.MinCPU:
		return errdefs.Invalid("resources.cpu", "must be at least %v cores (e.g. 0.5 or 2), got %v", max(r.MinCPU, 0.01), s.Resources.CPU)
	case s.CPUClass != "" && s.CPUClass != CPULatency && s.CPUClass != CPUBestEffort:
		return errdefs.Invalid("cpu_class", "%q is not a CPU class; give %q (the default) or %q", s.CPUClass, CPULatency, CPUBestEffort)
	case s.Resources.DiskMB < 0:
		return errdefs.Invalid("resources.disk_mb", "must be 0 (no quota) or a size in MiB, got %d", s.Resources.DiskMB)
	case s.Resources.PidsLimit < 0 || s.Resources.PidsLimit > 0 && s.Resources.PidsLimit < r.MinPids:
		return errdefs.Invalid("resources.pids_limit", "must be 0 (the default %d) or at least %d (the agent's own threads count), got %d", r.DefaultPids, max(r.MinPids, 1), s.Resources.PidsLimit)
	case r.MaxPids > 0 && s.Resources.PidsLimit > r.MaxPids:
		return errdefs.Invalid("resources.pids_limit", "%d processes exceeds the %d one sandbox may have on this node (node.max_pids_limit); ask for at most %d", s.Resources.PidsLimit, r.MaxPids, r.MaxPids)
	case len(s.Guest.Hostname) > 64:
		return errdefs.Invalid("guest.hostname", "must be at most 64 characters")
	}
	switch {
	case s.Network.Mode == NetworkNone:
		if s.Network.NetNS != "" {
			return errdefs.Invalid("network.mode", "is empty (no network) but network.netns is %q; %s", s.Network.NetNS, r.NetworkHint)
		}
	case slices.Contains(r.Networks, s.Network.Mode):
		if !filepath.IsAbs(s.Network.NetNS) {
			return errdefs.Invalid("network.netns", "must be an absolute path of a network namespace, got %q", s.Network.NetNS)
		}
	default:
		return errdefs.Invalid("network.mode", "%q is not supported by the %s backend; %s", s.Network.Mode, r.Backend, r.NetworkHint)
	}
	for i, ns := range s.Guest.Nameservers {
		if _, err := netip.ParseAddr(ns); err != nil {
			return errdefs.Invalid(fmt.Sprintf("guest.nameservers[%d]", i), "%q is not an IP address", ns)
		}
	}
	for i, l := range s.Rootfs.Layers {
		field := fmt.Sprintf("rootfs.layers[%d]", i)
		if !filepath.IsAbs(l.Path) || strings.ContainsAny(l.Path, ":,") {
			return errdefs.Invalid(field, "must be an absolute path without ':' or ',', got %q", l.Path)
		}
		fi, err := os.Stat(l.Path)
		switch l.Format {
		case LayerDir:
			if err != nil || !fi.IsDir() {
				return errdefs.Invalid(field, "%q is not a directory", l.Path)
			}
		case LayerEROFS:
			if err != nil || !fi.Mode().IsRegular() {
				return errdefs.Invalid(field, "%q is not an EROFS file", l.Path)
			}
			if s.Rootfs.Mounter == nil && !r.LayerDisks {
				return errdefs.Invalid("rootfs.mounter", "is missing: EROFS layers need the image store to mount them")
			}
		default:
			return errdefs.Invalid(field, "format %q is unknown (want %s or %s)", l.Format, LayerDir, LayerEROFS)
		}
	}
	for i, e := range s.Guest.Env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" || strings.ContainsRune(e, 0) {
			return errdefs.Invalid("guest.env", "entry %d %q must be KEY=VALUE", i, e)
		}
	}
	return nil
}
