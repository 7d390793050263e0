package e2b

import (
	"cmp"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// E2B's log levels, lowest first: a level filter keeps its level and the
// ones above it.
var logLevels = []string{"debug", "info", "warn", "error"}

// levelRank is the rank of a log level in logLevels; an unknown one ranks
// as info.
func levelRank(level string) int {
	if i := slices.Index(logLevels, level); i >= 0 {
		return i
	}
	return 1
}

// defaultPageLimit and maxPageLimit are E2B's paginationLimit (default
// 100, 1..100).
const (
	defaultPageLimit = 100
	maxPageLimit     = 100
)

// queryInt parses the query parameter name as an integer in [lo, hi];
// absent is def. A bad one is a 400 naming it.
func queryInt(r *http.Request, name string, def, lo, hi int64) (int64, error) {
	s := r.URL.Query().Get(name)
	if s == "" {
		return def, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < lo || n > hi {
		return 0, badQuery(name, "%q is not a number from %d to %d", s, lo, hi)
	}
	return n, nil
}

// queryEnum is the query parameter name, one of allowed; absent is def.
func queryEnum(r *http.Request, name, def string, allowed ...string) (string, error) {
	s := r.URL.Query().Get(name)
	if s == "" {
		return def, nil
	}
	if !slices.Contains(allowed, s) {
		return "", badQuery(name, "%q is not one of %s", s, strings.Join(allowed, ", "))
	}
	return s, nil
}

// page is the items of one page (limit, nextToken: the offset of the
// next item, as E2B's opaque token) and the token of the next page.
func page[T any](r *http.Request, items []T) ([]T, string, error) {
	limit, err := queryInt(r, "limit", defaultPageLimit, 1, maxPageLimit)
	if err != nil {
		return nil, "", err
	}
	off := 0
	if tok := r.URL.Query().Get("nextToken"); tok != "" {
		n, err := strconv.Atoi(tok)
		if err != nil || n < 0 || n > len(items) {
			return nil, "", badQuery("nextToken", "%q is not a token this list gave (X-Next-Token); start again without it", tok)
		}
		off = n
	}
	end := min(len(items), off+int(limit))
	next := ""
	if end < len(items) {
		next = strconv.Itoa(end)
	}
	return items[off:end], next, nil
}

// templateJSON is E2B's Template for t, whose builds are copies or held
// under the store's lock.
func templateJSON(t *tplRecord) map[string]any {
	var latest *tplBuild
	for _, b := range t.Builds {
		if latest == nil || b.Created.After(latest.Created) {
			latest = b
		}
	}
	if latest == nil {
		latest = &tplBuild{Status: buildWaiting}
	}
	var lastSpawned any
	if t.LastSpawned != nil {
		lastSpawned = *t.LastSpawned
	}
	return map[string]any{
		"templateID": t.ID, "buildID": latest.ID, "cpuCount": max(1, latest.CPU), "memoryMB": max(512, latest.MemMB),
		"diskSizeMB": 0, "public": t.Public, "aliases": []string{t.Name}, "names": []string{t.Name},
		"createdAt": t.Created, "updatedAt": t.Updated, "createdBy": nil, "lastSpawnedAt": lastSpawned,
		"spawnCount": t.Spawns, "buildCount": len(t.Builds), "envdVersion": EnvdVersion, "buildStatus": latest.Status,
	}
}

// buildsNewestFirst are t's builds, the newest first.
func buildsNewestFirst(t *tplRecord) []*tplBuild {
	out := make([]*tplBuild, 0, len(t.Builds))
	for _, b := range t.Builds {
		out = append(out, b)
	}
	slices.SortFunc(out, func(a, b *tplBuild) int {
		return cmp.Or(b.Created.Compare(a.Created), strings.Compare(a.ID, b.ID))
	})
	return out
}

// buildJSON is E2B's TemplateBuild.
func buildJSON(b *tplBuild) map[string]any {
	out := map[string]any{
		"buildID": b.ID, "status": b.Status, "createdAt": b.Created, "updatedAt": b.Updated,
		"cpuCount": max(1, b.CPU), "memoryMB": max(512, b.MemMB), "envdVersion": EnvdVersion,
	}
	if b.Status == buildReady || b.Status == buildError {
		out["finishedAt"] = b.Updated
	}
	return out
}

// getTemplate is GET /templates/{templateID}?limit=&nextToken= → E2B's
// TemplateWithBuilds: the caller's template with its builds, newest
// first, paged (X-Next-Token). Another principal's template, public or
// not, is 404: its builds are its owner's.
func (g *Gateway) getTemplate(w http.ResponseWriter, r *http.Request) {
	s := g.tpls
	t, ok := g.lockOwnTemplate(w, r, r.PathValue("id"), nil)
	if !ok {
		return
	}
	out := templateJSON(t)
	builds := buildsNewestFirst(t)
	pg, next, err := page(r, builds)
	if err != nil {
		s.mu.Unlock()
		writeErr(w, err)
		return
	}
	list := make([]map[string]any, 0, len(pg))
	for _, b := range pg {
		list = append(list, buildJSON(b))
	}
	s.mu.Unlock()
	out["builds"] = list
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
}

// patchTemplate is PATCH /templates/{templateID} (v1: 200, no body) and
// PATCH /v2/templates/{templateID} (200 {names}) with E2B's
// TemplateUpdateRequest {public?}. Public means every principal of this
// gateway may start the template (and build from it) by its ID; only its
// owner lists, reads, builds, tags, patches or deletes it.
func (g *Gateway) patchTemplate(v2 bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Public *bool `json:"public"`
		}
		if err := decode(r, &req); err != nil {
			writeErr(w, err)
			return
		}
		s := g.tpls
		t, ok := g.lockOwnTemplate(w, r, r.PathValue("id"), nil)
		if !ok {
			return
		}
		var err error
		if req.Public != nil && *req.Public != t.Public {
			t.Public = *req.Public
			t.Updated = time.Now().UTC()
			err = s.saveLocked()
		}
		name := t.Name
		s.mu.Unlock()
		if err != nil {
			writeErr(w, fmt.Errorf("save templates: %w", err))
			return
		}
		if !v2 {
			w.WriteHeader(http.StatusOK)
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"names": []string{name}})
	}
}

// listTemplatesV2 is GET /v2/templates?limit=&nextToken=&teamID= → the
// caller's templates as E2B's Template[], oldest first, paged
// (X-Next-Token). teamID, if given, must be the caller's (GET /teams).
func (g *Gateway) listTemplatesV2(w http.ResponseWriter, r *http.Request) {
	p := principal(r.Context())
	if team := r.URL.Query().Get("teamID"); team != "" && team != p {
		writeError(w, http.StatusForbidden, "teamID: %q is not your team; your key's team is %q (GET /teams)", team, p)
		return
	}
	all := g.tpls.list(p)
	pg, next, err := page(r, all)
	if err != nil {
		writeErr(w, err)
		return
	}
	out := make([]map[string]any, 0, len(pg))
	for i := range pg {
		out = append(out, templateJSON(&pg[i]))
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
}

// maxBuildLogLimit bounds one page of build logs.
const maxBuildLogLimit = 1000

// templateBuildLogs is GET /templates/{templateID}/builds/{buildID}/logs
// → E2B's TemplateBuildLogsResponse {logs: BuildLogEntry[]} from the
// build's stored log: cursor (ms since the epoch; forward: entries at or
// after it, oldest first; backward: at or before it, newest first;
// default the build's start or now), limit (1..1000, default 100),
// direction (forward|backward), level (the lowest level kept), source
// (temporary|persistent: both are the one stored log). Only the
// template's owner reads it.
func (g *Gateway) templateBuildLogs(w http.ResponseWriter, r *http.Request) {
	limit, err := queryInt(r, "limit", 100, 1, maxBuildLogLimit)
	if err != nil {
		writeErr(w, err)
		return
	}
	cursor, err := queryInt(r, "cursor", -1, 0, 1<<53)
	if err != nil {
		writeErr(w, err)
		return
	}
	dir, err := queryEnum(r, "direction", "forward", "forward", "backward")
	if err != nil {
		writeErr(w, err)
		return
	}
	level, err := queryEnum(r, "level", "debug", logLevels...)
	if err != nil {
		writeErr(w, err)
		return
	}
	if _, err := queryEnum(r, "source", "temporary", "temporary", "persistent"); err != nil {
		writeErr(w, err)
		return
	}
	tid, bid := r.PathValue("id"), r.PathValue("buildID")
	s := g.tpls
	t, ok := g.lockOwnTemplate(w, r, tid, nil)
	if !ok {
		return
	}
	b, ok := t.Builds[bid]
	if !ok {
		s.mu.Unlock()
		writeError(w, http.StatusNotFound, "build %q of template %q not found", bid, tid)
		return
	}
	logs := slices.Clone(b.Logs)
	s.mu.Unlock()
	out := filterLogs(logs, func(e logEntryJSON) (time.Time, string) { return e.Timestamp, e.Level }, cursor, int(limit), dir == "backward", level)
	writeJSON(w, http.StatusOK, map[string]any{"logs": out})
}

// filterLogs is E2B's paging of a log: entries at or after cursor (ms; <0:
// from the start) oldest first, or with backward at or before it (<0:
// now) newest first, at the level given or above, at most limit.
func filterLogs[T any](entries []T, at func(T) (time.Time, string), cursor int64, limit int, backward bool, level string) []T {
	out := []T{}
	lowest := levelRank(level)
	keep := func(e T) bool {
		ts, lvl := at(e)
		if levelRank(lvl) < lowest {
			return false
		}
		if cursor < 0 {
			return true
		}
		ms := ts.UnixMilli()
		if backward {
			return ms <= cursor
		}
		return ms >= cursor
	}
	if backward {
		for i := len(entries) - 1; i >= 0 && len(out) < limit; i-- {
			if keep(entries[i]) {
				out = append(out, entries[i])
			}
		}
		return out
	}
	for _, e := range entries {
		if len(out) >= limit {
			break
		}
		if keep(e) {
			out = append(out, e)
		}
	}
	return out
}

// teams is GET /teams → the key's principal as E2B's one Team (teamID and
// name are the principal, apiKey the key the request carried, isDefault
// true); other principals are never listed.
func (g *Gateway) teams(w http.ResponseWriter, r *http.Request) {
	p := principal(r.Context())
	writeJSON(w, http.StatusOK, []map[string]any{{
		"teamID": p, "name": p, "apiKey": strings.TrimSpace(r.Header.Get("X-API-Key")), "isDefault": true,
	}})
}

// badQuery is a 400 naming the query parameter.
func badQuery(name, format string, args ...any) error {
	return errdefs.Invalid(name, format, args...)
}
