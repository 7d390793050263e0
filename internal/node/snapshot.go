package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
	"github.com/kernflux/opendsec/internal/trajectory"
)

// Snapshots. A snapshot saves a running or paused sandbox under a name
// its caller owns; creates start new sandboxes from it (Spec.Snapshot).
// How it is saved depends on the backend, decided in one place
// (saveSnapshot): a backend that implements runtime.Snapshotter (the VM
// backends, later) writes its own snapshot, memory included where it can,
// into a directory on this node, and creates from it Restore there; every
// other backend that hands out its root filesystem's changes
// (runtime.RootfsDiffer: containers) has them packed into a new image,
// snapshot/<id>, on the source's image's layers in the shared store
// (pack_diff), so any node sharing the store starts it; its sandboxes
// start their init again on the saved files.
//
// The node that ran the source keeps the record: one JSON file per
// snapshot under <state dir>/snapshots, written before the snapshot is
// taken (pending) and again once it is complete, so a node that dies in
// between removes what the half-made snapshot left at its next start.

// snapshotRecord is one snapshot, as stored on disk.
type snapshotRecord struct {
	ID      string `json:"id"`
	Name    string `json:"name"`
	Owner   string `json:"owner,omitempty"`
	Project string `json:"project,omitempty"`
	// Source is the sandbox it was taken from, Backend that sandbox's.
	Source  string `json:"source_sandbox_id"`
	Backend string `json:"backend"`
	// Image is the snapshot's image in the store (pack_diff), ImageID its
	// content ID; empty for a backend snapshot (Dir).
	Image   string `json:"image,omitempty"`
	ImageID string `json:"image_id,omitempty"`
	// Spec is the source's normalized spec: the defaults of a create
	// from the snapshot.
	Spec specRecord `json:"spec"`
	// Memory: the backend saved memory and processes too.
	Memory    bool  `json:"memory"`
	SizeBytes int64 `json:"size_bytes"`
	// Dir holds a backend snapshot (runtime.Snapshotter) on this node.
	Dir       string    `json:"dir,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	// Pending: the snapshot is being taken (or was, when the node died).
	Pending bool `json:"pending,omitempty"`
}

// snapshotImages is what pack_diff snapshots need of the image store;
// *image.Store implements it.
type snapshotImages interface {
	PackDiff(ctx context.Context, req image.PackDiffRequest) (image.Image, error)
	Remove(ctx context.Context, name string) error
}

// snapshots is the node's snapshot table: the records in memory, each
// mirrored by a file.
type snapshots struct {
	dir string

	mu    sync.Mutex
	byID  map[string]*snapshotRecord // complete ones; guarded by mu
	names map[string]string          // owner key → ID, pending ones too; guarded by mu
}

func nameKey(owner, project, name string) string { return owner + "\x00" + project + "\x00" + name }

// openSnapshots loads the table in stateDir and removes what snapshots
// that never completed left (their image, their directory, their record).
func openSnapshots(ctx context.Context, stateDir string, imgs ImageResolver) (*snapshots, error) {
	s := &snapshots{dir: filepath.Join(stateDir, "snapshots"), byID: map[string]*snapshotRecord{}, names: map[string]string{}}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return nil, fmt.Errorf("make snapshot dir: %w", err)
	}
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("read snapshot dir: %w", err)
	}
	for _, e := range ents {
		name := e.Name()
		if !strings.HasSuffix(name, ".json") {
			if strings.HasSuffix(name, ".tmp") {
				_ = os.Remove(filepath.Join(s.dir, name))
			}
			continue
		}
		b, err := os.ReadFile(filepath.Join(s.dir, name))
		if err != nil {
			return nil, fmt.Errorf("read snapshot record: %w", err)
		}
		r := new(snapshotRecord)
		if err := json.Unmarshal(b, r); err != nil {
			return nil, fmt.Errorf("decode snapshot record %s: %w", name, err)
		}
		if r.Pending {
			log.G(ctx).Warn("removing snapshot that was being taken when the node stopped", "snapshot_id", r.ID, log.SandboxID(r.Source))
			if err := s.discard(ctx, imgs, r); err != nil {
				return nil, err
			}
			continue
		}
		s.byID[r.ID] = r
		s.names[nameKey(r.Owner, r.Project, r.Name)] = r.ID
	}
	// Directories of backend snapshots and log copies without a record are
	// leftovers.
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".d"); ok && e.IsDir() && s.byID[id] == nil {
			_ = os.RemoveAll(filepath.Join(s.dir, e.Name()))
		}
		if id, ok := strings.CutSuffix(e.Name(), ".trajectory.log"); ok && !e.IsDir() && s.byID[id] == nil {
			_ = os.Remove(filepath.Join(s.dir, e.Name()))
		}
	}
	return s, nil
}

func (s *snapshots) recordPath(id string) string { return filepath.Join(s.dir, id+".json") }

// logPath is snapshot id's copy of its source's trajectory log.
func (s *snapshots) logPath(id string) string { return filepath.Join(s.dir, id+".trajectory.log") }

// dataDir is where a backend snapshot id is written.
func (s *snapshots) dataDir(id string) string { return filepath.Join(s.dir, id+".d") }

// write stores r durably (a new file renamed over the old one).
func (s *snapshots) write(r *snapshotRecord) error {
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("encode snapshot record: %w", err)
	}
	tmp := s.recordPath(r.ID) + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("write snapshot record: %w", err)
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, s.recordPath(r.ID))
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write snapshot record: %w", err)
	}
	return syncDir(s.dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}

// discard removes everything of r: its image, its directory, its record.
// The image goes first: a record that stays names what is left to remove.
func (s *snapshots) discard(ctx context.Context, imgs ImageResolver, r *snapshotRecord) error {
	if r.Image != "" {
		if st, ok := imgs.(snapshotImages); ok {
			if err := st.Remove(ctx, r.Image); err != nil && !errdefs.IsNotFound(err) {
				return fmt.Errorf("remove image of snapshot %s: %w", r.ID, err)
			}
		}
	}
	if err := os.RemoveAll(s.dataDir(r.ID)); err != nil {
		return fmt.Errorf("remove snapshot %s: %w", r.ID, err)
	}
	if err := os.Remove(s.logPath(r.ID)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove trajectory log of snapshot %s: %w", r.ID, err)
	}
	if err := os.Remove(s.recordPath(r.ID)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove snapshot record %s: %w", r.ID, err)
	}
	return nil
}

// reserve claims name for owner, or fails with already_exists; release
// gives it back unless the snapshot completed.
func (s *snapshots) reserve(owner, project, name, id string) (release func(keep bool), err error) {
	k := nameKey(owner, project, name)
	s.mu.Lock()
	defer s.mu.Unlock()
	if prev, ok := s.names[k]; ok {
		return nil, errdefs.New(errdefs.ErrAlreadyExists, "name: you already have a snapshot named %q (%s); choose another name or delete that one", name, prev)
	}
	s.names[k] = id
	return func(keep bool) {
		if keep {
			return
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.names[k] == id {
			delete(s.names, k)
		}
	}, nil
}

// ownsSnapshot reports whether c may see and use snapshot r.
func (c caller) ownsSnapshot(r *snapshotRecord) bool {
	return c.all || (r.Owner != "" && r.Owner == c.principal && r.Project == c.project)
}

// getSnapshotFor returns snapshot id if the caller in ctx owns it, and
// not_found (naming field) otherwise.
func (n *Node) getSnapshotFor(ctx context.Context, field, id string) (*snapshotRecord, error) {
	if err := sandboxspec.CheckSnapshotID(field, id); err != nil {
		return nil, err
	}
	c := callerOf(ctx)
	n.snaps.mu.Lock()
	r, ok := n.snaps.byID[id]
	n.snaps.mu.Unlock()
	if !ok || !c.ownsSnapshot(r) {
		return nil, errdefs.New(errdefs.ErrNotFound, "%s: snapshot %s not found (list yours with `opendsecctl snapshot list`)", field, id)
	}
	return r, nil
}

// CreateSnapshot saves the caller's sandbox sandboxID as snapshot name
// (empty: "<sandbox id>-<UTC time>"). The sandbox keeps running: it is
// frozen only while its changes are copied. Bad input, or a sandbox that
// is not running or paused, changes nothing.
func (n *Node) CreateSnapshot(ctx context.Context, sandboxID, name string) (*snapshotRecord, error) {
	end, err := n.begin("snapshot sandbox " + sandboxID)
	if err != nil {
		return nil, err
	}
	defer end()
	if sandboxID == "" {
		return nil, errdefs.Invalid("sandbox_id", "is empty; give the ID of a running or paused sandbox of yours")
	}
	if name == "" {
		name = sandboxID + "-" + time.Now().UTC().Format("20060102t150405.000")
	}
	if err := sandboxspec.CheckSnapshotName("name", name); err != nil {
		return nil, err
	}
	sb, dead, err := n.getOrDeadFor(ctx, sandboxID)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox_id: sandbox %s not found", sandboxID)
	}
	if dead || sb.died.Load() {
		reason, _ := sb.reason.Load().(string)
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox_id: sandbox %s failed (%s); snapshot a running or paused sandbox", sandboxID, reason)
	}
	if err := waitStarted(ctx, sb); err != nil {
		return nil, err
	}
	n.mu.Lock()
	src := *sb.rec
	n.mu.Unlock()
	if src.State != stateRunning && src.State != statePaused {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox_id: sandbox %s is %s; snapshot a running or paused sandbox", sandboxID, src.State)
	}
	owner, project := ownerOf(ctx)
	id := sandboxid.New(n.cfg.ID)
	release, err := n.snaps.reserve(owner, project, name, id)
	if err != nil {
		return nil, err
	}
	done := false
	defer func() { release(done) }()
	snap := &snapshotRecord{
		ID: id, Name: name, Owner: owner, Project: project, Source: src.ID, Backend: src.Backend,
		Spec: src.Spec, CreatedAt: time.Now().UTC(), Pending: true,
	}
	if err := n.snaps.write(snap); err != nil {
		return nil, err
	}
	t0 := time.Now()
	err = n.exportSnapshotLog(snap)
	if err == nil {
		err = n.saveSnapshot(ctx, snap, src)
	}
	if err == nil {
		err = n.shareSnapshotLog(ctx, snap)
	}
	if err != nil {
		if derr := n.snaps.discard(context.WithoutCancel(ctx), n.cfg.Images, snap); derr != nil {
			log.G(ctx).Error("remove failed snapshot; the next node start retries", "snapshot_id", id, log.Err(derr))
		}
		return nil, err
	}
	snap.Pending = false
	if err := n.snaps.write(snap); err != nil {
		if derr := n.snaps.discard(context.WithoutCancel(ctx), n.cfg.Images, snap); derr != nil {
			log.G(ctx).Error("remove failed snapshot; the next node start retries", "snapshot_id", id, log.Err(derr))
		}
		return nil, err
	}
	n.snaps.mu.Lock()
	n.snaps.byID[id] = snap
	n.snaps.mu.Unlock()
	done = true
	log.G(ctx).Info("snapshot taken", "snapshot_id", id, log.SandboxID(src.ID), "name", name, "memory", snap.Memory,
		"bytes", snap.SizeBytes, "ms", ms(time.Since(t0)))
	return snap, nil
}

// saveSnapshot takes snapshot snap of sandbox src: the one place that
// decides how (see the top of this file).
func (n *Node) saveSnapshot(ctx context.Context, snap *snapshotRecord, src record) error {
	be, ok := n.cfg.Backends[src.Backend]
	if !ok {
		return errdefs.New(errdefs.ErrInternal, "sandbox %s: backend %q is not configured on this node", src.ID, src.Backend)
	}
	if s, ok := be.(runtime.Snapshotter); ok {
		dir := n.snaps.dataDir(snap.ID)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("make snapshot dir: %w", err)
		}
		info, err := s.Snapshot(ctx, src.ID, dir)
		if err != nil {
			return fmt.Errorf("snapshot sandbox %s: %w", src.ID, err)
		}
		snap.Dir, snap.Memory, snap.SizeBytes = dir, info.Memory, info.Bytes
		return nil
	}
	store, ok := n.cfg.Images.(snapshotImages)
	if !ok {
		return errdefs.New(errdefs.ErrUnimplemented, "node %s's image store cannot hold snapshots", n.cfg.ID)
	}
	snap.Image = sandboxspec.SnapshotImage(snap.ID)
	img, err := n.packDiff(ctx, store, src.ID, snap.Image, nil)
	if err != nil {
		return err
	}
	snap.ImageID = img.ID
	if len(img.Layers) > 0 {
		snap.SizeBytes = img.Layers[len(img.Layers)-1].Size
	}
	return nil
}

// GetSnapshot returns the caller's snapshot id.
func (n *Node) GetSnapshot(ctx context.Context, id string) (*snapshotRecord, error) {
	return n.getSnapshotFor(ctx, "id", id)
}

// ListSnapshots returns the caller's snapshots (an admin's: all), oldest
// first.
func (n *Node) ListSnapshots(ctx context.Context) []*snapshotRecord {
	c := callerOf(ctx)
	n.snaps.mu.Lock()
	out := make([]*snapshotRecord, 0, len(n.snaps.byID))
	for _, r := range n.snaps.byID {
		if c.ownsSnapshot(r) {
			out = append(out, r)
		}
	}
	n.snaps.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if !out[i].CreatedAt.Equal(out[j].CreatedAt) {
			return out[i].CreatedAt.Before(out[j].CreatedAt)
		}
		return out[i].ID < out[j].ID
	})
	return out
}

// DeleteSnapshot removes the caller's snapshot id: its record and its
// image or directory. Sandboxes started from it keep running (they hold
// the image's layers; the store's gc frees them once none does).
func (n *Node) DeleteSnapshot(ctx context.Context, id string) error {
	end, err := n.begin("delete snapshot " + id)
	if err != nil {
		return err
	}
	defer end()
	r, err := n.getSnapshotFor(ctx, "id", id)
	if err != nil {
		return err
	}
	n.snaps.mu.Lock()
	if n.snaps.byID[id] != r {
		n.snaps.mu.Unlock()
		return errdefs.New(errdefs.ErrNotFound, "id: snapshot %s not found", id)
	}
	delete(n.snaps.byID, id)
	n.snaps.mu.Unlock()
	if err := n.snaps.discard(ctx, n.cfg.Images, r); err != nil {
		n.snaps.mu.Lock()
		n.snaps.byID[id] = r
		n.snaps.mu.Unlock()
		return err
	}
	n.snaps.mu.Lock()
	if k := nameKey(r.Owner, r.Project, r.Name); n.snaps.names[k] == id {
		delete(n.snaps.names, k)
	}
	n.snaps.mu.Unlock()
	log.G(ctx).Info("snapshot deleted", "snapshot_id", id)
	return nil
}

// resolveSnapshot is the create pipeline's view of spec.Snapshot: a spec
// without an image takes the snapshot's (and its defaults) when this node
// keeps the snapshot and the caller owns it. A spec the apiserver already
// resolved names the snapshot's image. restore is the record when the
// sandbox is restored from a backend snapshot on this node.
func (n *Node) resolveSnapshot(ctx context.Context, spec specRecord) (_ specRecord, restore *snapshotRecord, err error) {
	if err := sandboxspec.CheckSnapshotID("snapshot", spec.Snapshot); err != nil {
		return spec, nil, err
	}
	if spec.Snapshot[:sandboxid.NodeIDLen] != n.cfg.ID {
		if spec.Image == "" {
			return spec, nil, errdefs.New(errdefs.ErrNotFound, "snapshot: snapshot %s is kept by node %s, not %s; create through the apiserver", spec.Snapshot, spec.Snapshot[:sandboxid.NodeIDLen], n.cfg.ID)
		}
		return spec, nil, nil
	}
	r, err := n.getSnapshotFor(ctx, "snapshot", spec.Snapshot)
	if err != nil {
		return spec, nil, err
	}
	if spec.Image == "" {
		if spec, err = sandboxspec.FromSnapshot(spec, r.Spec); err != nil {
			return spec, nil, err
		}
	}
	if r.Dir != "" {
		restore = r
	}
	return spec, restore, nil
}

// The trajectory log and snapshots. A snapshot keeps a copy of its
// source's log as it was just before the snapshot was taken (calls still
// running then are marked interrupted): <state dir>/snapshots/<id>.trajectory.log
// on the node that keeps the record, and, for a container snapshot
// (pack_diff, startable on any node sharing the image store), the same
// copy kept with its image in the store (imageFiles). A sandbox started
// from the snapshot starts its log with that copy, its parent the source.

// snapshotLogKey names the log copy among an image's files.
const snapshotLogKey = "trajectory.log"

// imageFiles is an image store that keeps files with an image, seen by
// every node sharing it; *image.Store implements it.
type imageFiles interface {
	PutFile(ctx context.Context, name, key, src string) error
	File(name, key string) (string, error)
}

// exportSnapshotLog writes snap's copy of its source's log.
func (n *Node) exportSnapshotLog(snap *snapshotRecord) error {
	if n.traj == nil {
		return nil
	}
	if err := n.traj.Export(snap.Source, n.snaps.logPath(snap.ID)); err != nil {
		return fmt.Errorf("copy the trajectory log of sandbox %s into snapshot %s: %w", snap.Source, snap.ID, err)
	}
	return nil
}

// shareSnapshotLog keeps the log copy of a container snapshot with its
// image, for sandboxes other nodes start from it.
func (n *Node) shareSnapshotLog(ctx context.Context, snap *snapshotRecord) error {
	if n.traj == nil || snap.Image == "" {
		return nil
	}
	st, ok := n.cfg.Images.(imageFiles)
	if !ok {
		return nil // a store only this node sees: the local copy serves
	}
	if err := st.PutFile(ctx, snap.Image, snapshotLogKey, n.snaps.logPath(snap.ID)); err != nil {
		return fmt.Errorf("keep the trajectory log of snapshot %s with its image: %w", snap.ID, err)
	}
	return nil
}

// restoreSnapshotLog starts the log of sb, made from snapshot spec.Snapshot,
// with the snapshot's copy of its source's log: the node's own copy when it
// keeps the snapshot, else the one kept with the snapshot's image. A
// snapshot without a copy (taken with the log off) starts an empty log.
func (n *Node) restoreSnapshotLog(ctx context.Context, rec *record, spec specRecord) {
	if n.traj == nil || spec.Snapshot == "" {
		return
	}
	p := n.snaps.logPath(spec.Snapshot)
	if _, err := os.Stat(p); err != nil {
		p = ""
		if st, ok := n.cfg.Images.(imageFiles); ok && spec.Image != "" {
			if fp, err := st.File(spec.Image, snapshotLogKey); err == nil {
				p = fp
			} else if !errdefs.IsNotFound(err) {
				log.G(ctx).Warn("find the trajectory log of snapshot", "snapshot_id", spec.Snapshot, log.SandboxID(rec.ID), log.Err(err))
			}
		}
	}
	if p == "" {
		return
	}
	if err := n.traj.Restore(p, rec.ID, trajectory.Meta{Owner: rec.Owner, Project: rec.Project}); err != nil {
		log.G(ctx).Warn("copy the trajectory log of snapshot", "snapshot_id", spec.Snapshot, log.SandboxID(rec.ID), log.Err(err))
	}
}
