package e2b

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/auth"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// fakeSnapshots keeps snapshots by ID, each owned by the bearer that made
// it (as the node does), and creates from a snapshot start its image.
type fakeSnapshots struct {
	*fakeAPI
	smu   sync.Mutex
	snaps map[string]*v1.Snapshot
	owner map[string]string
}

func (f *fakeSnapshots) CreateSandbox(ctx context.Context, r *connect.Request[v1.CreateSandboxRequest]) (*connect.Response[v1.CreateSandboxResponse], error) {
	if id := r.Msg.GetSpec().GetSnapshot(); id != "" {
		f.smu.Lock()
		_, ok := f.snaps[id]
		f.smu.Unlock()
		if !ok || r.Msg.GetSpec().GetImage() != "" {
			return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "snapshot: snapshot %s not found", id))
		}
		m := proto.Clone(r.Msg).(*v1.CreateSandboxRequest)
		m.Spec.Image = "root/py:3.11"
		return f.fakeAPI.CreateSandbox(ctx, connect.NewRequest(m))
	}
	return f.fakeAPI.CreateSandbox(ctx, r)
}

func (f *fakeSnapshots) CreateSnapshot(ctx context.Context, r *connect.Request[v1.CreateSnapshotRequest]) (*connect.Response[v1.CreateSnapshotResponse], error) {
	if strings.Contains(r.Msg.GetName(), "/") {
		return nil, errdefs.ToConnect(errdefs.Invalid("name", "%q is not a snapshot name", r.Msg.GetName()))
	}
	f.smu.Lock()
	defer f.smu.Unlock()
	s := &v1.Snapshot{Id: sandboxid.New("n001"), Name: r.Msg.GetName(), SourceSandboxId: r.Msg.GetSandboxId()}
	if s.Name == "" {
		s.Name = r.Msg.GetSandboxId() + "-t"
	}
	f.snaps[s.Id], f.owner[s.Id] = s, auth.BearerFrom(ctx)
	return connect.NewResponse(&v1.CreateSnapshotResponse{Snapshot: s}), nil
}

func (f *fakeSnapshots) GetSnapshot(ctx context.Context, r *connect.Request[v1.GetSnapshotRequest]) (*connect.Response[v1.GetSnapshotResponse], error) {
	f.smu.Lock()
	defer f.smu.Unlock()
	s, ok := f.snaps[r.Msg.GetId()]
	if !ok || f.owner[s.Id] != auth.BearerFrom(ctx) {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "id: snapshot not found"))
	}
	return connect.NewResponse(&v1.GetSnapshotResponse{Snapshot: s}), nil
}

func (f *fakeSnapshots) ListSnapshots(ctx context.Context, _ *connect.Request[v1.ListSnapshotsRequest]) (*connect.Response[v1.ListSnapshotsResponse], error) {
	f.smu.Lock()
	defer f.smu.Unlock()
	out := &v1.ListSnapshotsResponse{}
	for id, s := range f.snaps {
		if f.owner[id] == auth.BearerFrom(ctx) {
			out.Snapshots = append(out.Snapshots, s)
		}
	}
	return connect.NewResponse(out), nil
}

func (f *fakeSnapshots) DeleteSnapshot(ctx context.Context, r *connect.Request[v1.DeleteSnapshotRequest]) (*connect.Response[v1.DeleteSnapshotResponse], error) {
	f.smu.Lock()
	defer f.smu.Unlock()
	if _, ok := f.snaps[r.Msg.GetId()]; !ok || f.owner[r.Msg.GetId()] != auth.BearerFrom(ctx) {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "id: snapshot not found"))
	}
	delete(f.snaps, r.Msg.GetId())
	return connect.NewResponse(&v1.DeleteSnapshotResponse{}), nil
}

// TestSnapshots: POST /sandboxes/{id}/snapshots answers 201 SnapshotInfo;
// GET /snapshots lists the key's own (filtered by sandboxID and name, in
// pages); a snapshot ID works as templateID (the create names the
// snapshot, not an image, and leaves user and workdir to it);
// DELETE /templates/{id} removes it; another key's sandbox or snapshot is
// 404 everywhere.
func TestSnapshots(t *testing.T) {
	h := newHarness(t)
	snaps := &fakeSnapshots{fakeAPI: h.api, snaps: map[string]*v1.Snapshot{}, owner: map[string]string{}}
	cfg := h.gw.cfg
	cfg.API, cfg.Snapshots = snaps, snaps
	gw, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.gw = gw
	w, m := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	id := m["sandboxID"].(string)
	if w, _ := h.do(h.keyB, "POST", "/sandboxes/"+id+"/snapshots", `{"name":"x"}`); w.Code != http.StatusNotFound {
		t.Fatalf("snapshot of another key's sandbox: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "POST", "/sandboxes/"+id+"/snapshots", `{"name":"a/b"}`); w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "name") {
		t.Fatalf("snapshot named a/b: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "POST", "/sandboxes/"+id+"/snapshots", `{"memory":true}`); w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "memory") {
		t.Fatalf("snapshot with memory: %d %s", w.Code, w.Body)
	}
	w, m = h.do(h.keyA, "POST", "/sandboxes/"+id+"/snapshots", `{"name":"first","memory":false}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("snapshot: %d %s", w.Code, w.Body)
	}
	snapID := m["snapshotID"].(string)
	if names, _ := m["names"].([]any); len(names) != 1 || names[0] != "first" {
		t.Fatalf("snapshot info %v", m)
	}
	if w, _ := h.do(h.keyA, "POST", "/sandboxes/"+id+"/snapshots", ``); w.Code != http.StatusCreated {
		t.Fatalf("snapshot without a body: %d %s", w.Code, w.Body)
	}
	list := func(key, query string) ([]snapshotInfoJSON, http.Header) {
		w, _ := h.do(key, "GET", "/snapshots"+query, "")
		if w.Code != http.StatusOK {
			t.Fatalf("list %s: %d %s", query, w.Code, w.Body)
		}
		var out []snapshotInfoJSON
		if err := json.Unmarshal(w.Body.Bytes(), &out); err != nil {
			t.Fatal(err)
		}
		return out, w.Header()
	}
	if l, _ := list(h.keyA, "?name=first&sandboxID="+id); len(l) != 1 || l[0].SnapshotID != snapID {
		t.Fatalf("list by name: %v", l)
	}
	if l, hdr := list(h.keyA, "?limit=1"); len(l) != 1 || hdr.Get("X-Next-Token") == "" {
		t.Fatalf("first page: %v, next %q", l, hdr.Get("X-Next-Token"))
	}
	if l, _ := list(h.keyB, ""); len(l) != 0 {
		t.Fatalf("another key lists %v", l)
	}
	w, m = h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"`+snapID+`"}`)
	if w.Code != http.StatusCreated || m["templateID"] != snapID {
		t.Fatalf("create from the snapshot: %d %s", w.Code, w.Body)
	}
	spec := h.api.sbs[m["sandboxID"].(string)].GetSpec()
	if spec.GetSnapshot() != snapID || spec.GetUser() != "" || spec.GetWorkdir() != "" {
		t.Fatalf("spec of a create from the snapshot: %v", spec)
	}
	if w, _ := h.do(h.keyB, "DELETE", "/templates/"+snapID, ""); w.Code != http.StatusNotFound {
		t.Fatalf("delete by another key: %d", w.Code)
	}
	if w, _ := h.do(h.keyA, "DELETE", "/templates/"+snapID, ""); w.Code != http.StatusNoContent {
		t.Fatalf("delete: %d %s", w.Code, w.Body)
	}
	if w, _ := h.do(h.keyA, "DELETE", "/templates/"+snapID, ""); w.Code != http.StatusNotFound {
		t.Fatalf("second delete: %d", w.Code)
	}
	if w, _ := h.do(h.keyA, "POST", "/v2/sandboxes", `{"templateID":"`+snapID+`"}`); w.Code != http.StatusNotFound {
		t.Fatalf("create from a deleted snapshot: %d %s", w.Code, w.Body)
	}
}
