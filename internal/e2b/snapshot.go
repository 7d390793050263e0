package e2b

import (
	"context"
	"fmt"
	"net/http"
	"regexp"
	"strconv"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// SnapshotAPI is the part of OpenDsec's snapshot service the gateway uses;
// opendsecv1connect.SnapshotServiceClient satisfies it.
type SnapshotAPI interface {
	CreateSnapshot(context.Context, *connect.Request[v1.CreateSnapshotRequest]) (*connect.Response[v1.CreateSnapshotResponse], error)
	GetSnapshot(context.Context, *connect.Request[v1.GetSnapshotRequest]) (*connect.Response[v1.GetSnapshotResponse], error)
	ListSnapshots(context.Context, *connect.Request[v1.ListSnapshotsRequest]) (*connect.Response[v1.ListSnapshotsResponse], error)
	DeleteSnapshot(context.Context, *connect.Request[v1.DeleteSnapshotRequest]) (*connect.Response[v1.DeleteSnapshotResponse], error)
}

// snapshotInfoJSON is E2B's SnapshotInfo.
type snapshotInfoJSON struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// snapshotIDRe: OpenDsec snapshot IDs, which E2B's templateID may name.
var snapshotIDRe = regexp.MustCompile(`^[a-z0-9]{20}$`)

// isSnapshotTemplate reports whether a create's templateID names a
// snapshot (an OpenDsec snapshot ID) rather than an image.
func (g *Gateway) isSnapshotTemplate(template string) bool {
	return g.cfg.Snapshots != nil && snapshotIDRe.MatchString(template)
}

func snapshotInfo(s *v1.Snapshot) snapshotInfoJSON {
	return snapshotInfoJSON{SnapshotID: s.GetId(), Names: []string{s.GetName()}}
}

// createSnapshot is POST /sandboxes/{id}/snapshots {name?} → 201
// SnapshotInfo: the sandbox's filesystem (memory where the backend can)
// saved under name; it keeps running.
func (g *Gateway) createSnapshot(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name   string `json:"name"`
		Memory *bool  `json:"memory"`
	}
	if err := decode(r, &req); err != nil {
		writeErr(w, err)
		return
	}
	if req.Memory != nil && *req.Memory {
		// Containers keep no memory in a snapshot; unset (the SDKs'
		// default) or false takes the filesystem-only snapshot.
		writeError(w, http.StatusBadRequest, "memory: true (a snapshot with memory) is not supported on OpenDsec's container backend; snapshots keep the filesystem: leave memory unset or use mode \"filesystem\"")
		return
	}
	id := sandboxID(r)
	if _, err := g.lookup(r.Context(), id); err != nil {
		writeErr(w, err)
		return
	}
	resp, err := g.cfg.Snapshots.CreateSnapshot(r.Context(), connect.NewRequest(&v1.CreateSnapshotRequest{SandboxId: id, Name: req.Name}))
	if err != nil {
		writeErr(w, fmt.Errorf("snapshot sandbox: %w", errdefs.FromConnect(err)))
		return
	}
	writeJSON(w, http.StatusCreated, snapshotInfo(resp.Msg.GetSnapshot()))
}

// listSnapshots is GET /snapshots?sandboxID=&name=&limit=&nextToken= →
// the caller's snapshots, oldest first, X-Next-Token while more remain.
func (g *Gateway) listSnapshots(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit := 100
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 100 {
			writeError(w, http.StatusBadRequest, "limit: %q must be a number from 1 to 100", s)
			return
		}
		limit = n
	}
	start := 0
	if s := q.Get("nextToken"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			writeError(w, http.StatusBadRequest, "nextToken: %q is not a token this server issued; pass X-Next-Token from the previous page", s)
			return
		}
		start = n
	}
	resp, err := g.cfg.Snapshots.ListSnapshots(r.Context(), connect.NewRequest(&v1.ListSnapshotsRequest{}))
	if err != nil {
		writeErr(w, fmt.Errorf("list snapshots: %w", errdefs.FromConnect(err)))
		return
	}
	out := []snapshotInfoJSON{}
	sandbox, name := q.Get("sandboxID"), q.Get("name")
	var matched []*v1.Snapshot
	for _, s := range resp.Msg.GetSnapshots() {
		if (sandbox == "" || s.GetSourceSandboxId() == sandbox) && (name == "" || s.GetName() == name || s.GetId() == name) {
			matched = append(matched, s)
		}
	}
	for i := start; i < len(matched) && len(out) < limit; i++ {
		out = append(out, snapshotInfo(matched[i]))
	}
	if next := start + len(out); next < len(matched) {
		w.Header().Set("X-Next-Token", strconv.Itoa(next))
	}
	writeJSON(w, http.StatusOK, out)
}

// deleteTemplate is DELETE /templates/{id} of a snapshot: E2B deletes
// snapshots this way (deleteBuiltTemplate deletes built templates); other
// IDs are not found.
func (g *Gateway) deleteTemplate(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !snapshotIDRe.MatchString(id) {
		writeError(w, http.StatusNotFound, "template %q not found: the gateway deletes your snapshots and the templates you built, not the templates it maps to images", id)
		return
	}
	if _, err := g.cfg.Snapshots.DeleteSnapshot(r.Context(), connect.NewRequest(&v1.DeleteSnapshotRequest{Id: id})); err != nil {
		err = errdefs.FromConnect(err)
		if errdefs.IsNotFound(err) || errdefs.IsInvalidArgument(err) {
			writeError(w, http.StatusNotFound, "snapshot %q not found", id)
			return
		}
		writeErr(w, fmt.Errorf("delete snapshot: %w", err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
