package e2b

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// Build states, as E2B names them.
const (
	buildWaiting  = "waiting"
	buildBuilding = "building"
	buildReady    = "ready"
	buildError    = "error"
)

// defaultTag is the tag a build gets when none is asked for, and the one
// a template name without ":tag" means.
const defaultTag = "default"

// tplImagePrefix starts the names of the images template builds make:
// e2b-tpl/<templateID>:<buildID>. Only the template's owner starts them.
const tplImagePrefix = "e2b-tpl/"

// maxLogEntries bounds the log kept of one build.
const maxLogEntries = 20000

// maxBuildsKept bounds the finished builds a template keeps that no tag
// names (the oldest go first).
const maxBuildsKept = 10

// maxTemplatesPerPrincipal bounds the templates one principal may have.
const maxTemplatesPerPrincipal = 500

// waitingBuildTTL is how long a requested build may wait for its start
// before it is forgotten.
const waitingBuildTTL = 24 * time.Hour

type logEntryJSON struct {
	Timestamp time.Time `json:"timestamp"`
	Level     string    `json:"level"`
	Message   string    `json:"message"`
	Step      string    `json:"step,omitempty"`
}

type reasonJSON struct {
	Message    string         `json:"message"`
	Step       string         `json:"step,omitempty"`
	LogEntries []logEntryJSON `json:"logEntries,omitempty"`
}

// tplBuild is one build of a template.
type tplBuild struct {
	ID      string    `json:"id"`
	Status  string    `json:"status"`
	Created time.Time `json:"created"`
	Updated time.Time `json:"updated"`
	Tags    []string  `json:"tags"` // assigned when it is ready
	Image   string    `json:"image,omitempty"`
	User    string    `json:"user,omitempty"`
	Workdir string    `json:"workdir,omitempty"`
	// StartCmd and ReadyCmd run in each sandbox of the build at its start.
	StartCmd string         `json:"startCmd,omitempty"`
	ReadyCmd string         `json:"readyCmd,omitempty"`
	Logs     []logEntryJSON `json:"logs,omitempty"`
	Reason   *reasonJSON    `json:"reason,omitempty"`
	CPU      int            `json:"cpu,omitempty"`
	MemMB    int            `json:"memMB,omitempty"`
}

type tagRecord struct {
	BuildID string    `json:"buildID"`
	Created time.Time `json:"createdAt"`
}

// tplRecord is one template: a name of one principal, its builds and tags.
type tplRecord struct {
	ID      string    `json:"id"`
	Owner   string    `json:"owner"`
	Name    string    `json:"name"`
	Created time.Time `json:"created"`
	Updated time.Time `json:"updated"`
	Spawns  int64     `json:"spawns"`
	// LastSpawned is when a sandbox last started from it.
	LastSpawned *time.Time `json:"lastSpawned,omitempty"`
	// Public lets every principal of this gateway start it by its ID
	// (PATCH /templates/{id} {public}); only the owner lists, reads,
	// builds, tags or deletes it.
	Public bool                 `json:"public,omitempty"`
	Builds map[string]*tplBuild `json:"builds"`
	Tags   map[string]tagRecord `json:"tags"`
}

// tplStore holds the templates built through the gateway, saved as JSON
// in path (none: in memory only).
type tplStore struct {
	mu   sync.Mutex
	path string
	all  map[string]*tplRecord // by ID
}

func newTplStore(path string) (*tplStore, error) {
	s := &tplStore{path: path, all: map[string]*tplRecord{}}
	if path == "" {
		return s, nil
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return nil, fmt.Errorf("templates: %w", err)
	}
	if err := json.Unmarshal(b, &s.all); err != nil {
		return nil, fmt.Errorf("templates: %s: %w", path, err)
	}
	now := time.Now()
	for _, t := range s.all {
		for _, b := range t.Builds {
			if b.Status == buildWaiting || b.Status == buildBuilding {
				// The gateway stopped under it: nothing was made.
				b.Status, b.Updated = buildError, now
				b.Reason = &reasonJSON{Message: "the build was interrupted (the gateway restarted); build again"}
			}
		}
	}
	return s, nil
}

// saveLocked writes the store; s.mu is held.
func (s *tplStore) saveLocked() error {
	if s.path == "" {
		return nil
	}
	b, err := json.Marshal(s.all)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(s.path), 0o700); err != nil {
		return err
	}
	tmp := s.path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, s.path)
}

func newTemplateID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return "tpl-" + hex.EncodeToString(b)
}

func newBuildID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b)
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// splitTag splits "name:tag"; a name without one means defaultTag.
func splitTag(ref string) (name, tag string) {
	if i := strings.LastIndex(ref, ":"); i > 0 {
		return ref[:i], ref[i+1:]
	}
	return ref, defaultTag
}

// get finds p's template by ID or name (a ":tag" is ignored).
func (s *tplStore) get(p, ref string) (*tplRecord, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.getLocked(p, ref)
}

func (s *tplStore) getLocked(p, ref string) (*tplRecord, bool) {
	if t, ok := s.all[ref]; ok && t.Owner == p {
		return t, true
	}
	name, _ := splitTag(ref)
	if t, ok := s.all[name]; ok && t.Owner == p {
		return t, true
	}
	for _, t := range s.all {
		if t.Owner == p && (t.Name == ref || t.Name == name) {
			return t, true
		}
	}
	return nil, false
}

// lockOwnTemplate locks the store and finds the caller's template ref (an
// ID, name or name:tag); the caller unlocks s.mu. When the caller has none
// it unlocks, runs missing or else answers 404, and returns false.
func (g *Gateway) lockOwnTemplate(w http.ResponseWriter, r *http.Request, ref string, missing func()) (*tplRecord, bool) {
	s := g.tpls
	s.mu.Lock()
	t, ok := s.getLocked(principal(r.Context()), ref)
	if ok {
		return t, true
	}
	s.mu.Unlock()
	if missing != nil {
		missing()
	} else {
		writeError(w, http.StatusNotFound, "template %q not found among your templates (GET /templates lists them)", ref)
	}
	return nil, false
}

// resolve finds the ready build p's template reference ("name", "name:tag",
// an ID) names: by its tag, default when none is given.
func (s *tplStore) resolve(p, ref string) (*tplRecord, *tplBuild, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.getLocked(p, ref)
	if !ok {
		return nil, nil, false
	}
	tag := defaultTag
	if ref != t.ID && ref != t.Name {
		_, tag = splitTag(ref)
	}
	return readyBuild(t, tag)
}

// readyBuild is t's finished build that tag names; t is returned either
// way. s.mu is held.
func readyBuild(t *tplRecord, tag string) (*tplRecord, *tplBuild, bool) {
	tr, ok := t.Tags[tag]
	if !ok {
		return t, nil, false
	}
	b, ok := t.Builds[tr.BuildID]
	if !ok || b.Status != buildReady {
		return t, nil, false
	}
	return t, b, true
}

// resolveStart is resolve, then another principal's public template by
// its ID ("tpl-...", "tpl-...:tag"): what p may start or build from.
func (s *tplStore) resolveStart(p, ref string) (*tplRecord, *tplBuild, bool) {
	if t, b, ok := s.resolve(p, ref); ok || t != nil {
		return t, b, ok
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	id, tag := splitTag(ref)
	t, ok := s.all[id]
	if !ok || !t.Public {
		return nil, nil, false
	}
	return readyBuild(t, tag)
}

// list is p's templates, oldest first.
func (s *tplStore) list(p string) []tplRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []tplRecord
	for _, t := range s.all {
		if t.Owner != p {
			continue
		}
		// Copies of the builds and tags: builds change them under s.mu.
		c := *t
		c.Builds = make(map[string]*tplBuild, len(t.Builds))
		for k, b := range t.Builds {
			bc := *b
			c.Builds[k] = &bc
		}
		c.Tags = maps.Clone(t.Tags)
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b tplRecord) int { return a.Created.Compare(b.Created) })
	return out
}

// pruneLocked drops finished builds no tag names beyond the newest
// maxBuildsKept, returning their images; s.mu is held.
func (t *tplRecord) pruneLocked() (images []string) {
	tagged := map[string]bool{}
	for _, tr := range t.Tags {
		tagged[tr.BuildID] = true
	}
	var old []*tplBuild
	for _, b := range t.Builds {
		if !tagged[b.ID] && (b.Status == buildReady || b.Status == buildError) {
			old = append(old, b)
		}
	}
	slices.SortFunc(old, func(a, b *tplBuild) int { return b.Created.Compare(a.Created) })
	for id, b := range t.Builds {
		if b.Status == buildWaiting && time.Since(b.Created) > waitingBuildTTL {
			delete(t.Builds, id)
		}
	}
	for i, b := range old {
		if b.Image != "" {
			// Its image is no longer started by any name.
			images = append(images, b.Image)
			b.Image = ""
		}
		if i >= maxBuildsKept {
			delete(t.Builds, b.ID)
		}
	}
	return images
}

// spawned counts a sandbox started from template id.
func (s *tplStore) spawned(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if t, ok := s.all[id]; ok {
		t.Spawns++
		now := time.Now().UTC()
		t.LastSpawned = &now
	}
}
