package sandboxspec

import (
	"maps"
	"regexp"
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Snapshots. A snapshot's files are an image in the shared store named
// SnapshotImage(id); its record (on the node that made it) keeps the
// source's spec, the defaults of a create from it. A create names the
// snapshot in Spec.Snapshot, never its image: FromSnapshot turns the one
// into the other (with the record's defaults), so that who may start a
// snapshot is decided by who owns its record.

// MaxSnapshotNameLen bounds a snapshot's name.
const MaxSnapshotNameLen = 128

// SnapshotImagePrefix starts the name of every snapshot's image.
const SnapshotImagePrefix = "snapshot/"

var (
	snapshotNameRe = regexp.MustCompile(`^[A-Za-z0-9._-]{1,128}$`)
	snapshotIDRe   = regexp.MustCompile(`^[a-z0-9]{20}$`)
)

// SnapshotImage is the image name of snapshot id.
func SnapshotImage(id string) string { return SnapshotImagePrefix + id }

// CheckSnapshotName validates a snapshot name (field names it in errors):
// 1 to 128 characters of [A-Za-z0-9._-].
func CheckSnapshotName(field, name string) error {
	if len(name) > MaxSnapshotNameLen {
		return errdefs.Invalid(field, "is %d characters; a snapshot name has 1 to %d characters of [A-Za-z0-9._-] (no '/')", len(name), MaxSnapshotNameLen)
	}
	if !snapshotNameRe.MatchString(name) {
		return errdefs.Invalid(field, "%q is not a snapshot name: use 1 to %d characters of [A-Za-z0-9._-] (no '/' or spaces), e.g. \"after-setup.v2\"", name, MaxSnapshotNameLen)
	}
	return nil
}

// CheckSnapshotID validates the shape of a snapshot ID.
func CheckSnapshotID(field, id string) error {
	if !snapshotIDRe.MatchString(id) {
		return errdefs.Invalid(field, "%q is not a snapshot ID (20 characters of [a-z0-9]); list snapshots with `opendsecctl snapshot list`", id)
	}
	return nil
}

// checkSnapshotSource is Normalize's check of where a sandbox starts from:
// a snapshot is resolved (its image is the snapshot's), and no image of a
// snapshot is asked for by name.
func checkSnapshotSource(s Spec) error {
	if s.Snapshot == "" {
		if strings.HasPrefix(s.Image, SnapshotImagePrefix) {
			return errdefs.Invalid("image", "%q is a snapshot's image; start from the snapshot with snapshot=%q instead", s.Image, strings.TrimPrefix(s.Image, SnapshotImagePrefix))
		}
		return nil
	}
	if err := CheckSnapshotID("snapshot", s.Snapshot); err != nil {
		return err
	}
	if s.Image != SnapshotImage(s.Snapshot) {
		return BothImageAndSnapshot(s.Image)
	}
	return nil
}

// BothImageAndSnapshot is the error of a create that names both.
func BothImageAndSnapshot(image string) error {
	return errdefs.Invalid("snapshot", "is set together with image %q; give either image or snapshot, not both", image)
}

// FromSnapshot resolves a caller's spec s that names snapshot s.Snapshot,
// whose record keeps the source's spec src: the snapshot's image becomes
// the image, and every field s leaves unset takes src's value (cpu,
// memory_mb, pids_limit, disk_mb, env, user, workdir, network, labels,
// backend and its options, allow_privilege_escalation, cpu_class); env and labels are
// merged, s's keys winning.
// Lifetimes, task and auto-pause are the new sandbox's own. s must not
// name an image too. The result is for Normalize.
func FromSnapshot(s, src Spec) (Spec, error) {
	if s.Image != "" && s.Image != SnapshotImage(s.Snapshot) {
		return Spec{}, BothImageAndSnapshot(s.Image)
	}
	if err := CheckSnapshotID("snapshot", s.Snapshot); err != nil {
		return Spec{}, err
	}
	s.Image = SnapshotImage(s.Snapshot)
	if s.Backend == "" {
		s.Backend = src.Backend
	}
	if s.CPU == 0 {
		s.CPU = src.CPU
	}
	if s.MemoryMB == 0 {
		s.MemoryMB = src.MemoryMB
	}
	if s.PidsLimit == 0 {
		s.PidsLimit = src.PidsLimit
	}
	if s.DiskMB == 0 {
		s.DiskMB = src.DiskMB
	}
	if s.User == "" {
		s.User = src.User
	}
	if s.Workdir == "" {
		s.Workdir = src.Workdir
	}
	if s.CPUClass == "" {
		s.CPUClass = src.CPUClass
	}
	if s.Network == nil {
		s.Network = src.Network
	}
	// A bool has no "unset": the source's setting holds unless this one
	// asks for it (its files may need sudo to work as they did).
	s.AllowPrivilegeEscalation = s.AllowPrivilegeEscalation || src.AllowPrivilegeEscalation
	s.Env = mergeMaps(src.Env, s.Env)
	s.Labels = mergeMaps(src.Labels, s.Labels)
	if len(s.BackendOptions) == 0 && s.Backend == src.Backend {
		s.BackendOptions = src.BackendOptions
	}
	return s, nil
}

// mergeMaps is base with over's entries on top, in a new map (nil when
// both are empty).
func mergeMaps(base, over map[string]string) map[string]string {
	if len(base) == 0 && len(over) == 0 {
		return over
	}
	out := make(map[string]string, len(base)+len(over))
	maps.Copy(out, base)
	maps.Copy(out, over)
	return out
}
