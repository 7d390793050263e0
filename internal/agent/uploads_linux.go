package agent

import (
	"crypto/rand"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
)

// uploadTempPrefix starts the name of an upload's temp file.
const uploadTempPrefix = ".opendsec-upload-"

// uploadMemory is how long an upload's rename is remembered for watchers.
const uploadMemory = 10 * time.Second

// recentUploads remembers the files uploads renamed into place, so that
// directory watchers report them as envd does (it writes in place): CREATE
// for a new file, then WRITE, and nothing of the temp file. Only the temp
// files the agent made are hidden: a user's file with the same prefix is
// reported like any other.
type recentUploads struct {
	mu sync.Mutex
	// m maps a target path to whether it existed before the upload and
	// when it was renamed; guarded by mu.
	m map[string]recentUpload
	// temps maps the path of each temp file an upload made to when it was
	// renamed or removed (zero while the upload writes it); guarded by mu.
	temps map[string]time.Time
}

type recentUpload struct {
	existed bool
	at      time.Time
}

// note records that target is about to be replaced by an upload.
func (r *recentUploads) note(target string, existed bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	if r.m == nil {
		r.m = map[string]recentUpload{}
	}
	for p, u := range r.m {
		if now.Sub(u.at) > uploadMemory {
			delete(r.m, p)
		}
	}
	r.m[target] = recentUpload{existed: existed, at: now}
}

// lookup reports whether target was recently uploaded and whether it
// existed before.
func (r *recentUploads) lookup(target string) (existed, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	u, ok := r.m[target]
	if !ok || time.Since(u.at) > uploadMemory {
		return false, false
	}
	return u.existed, true
}

// uploadEvents rewrites the events of an upload's rename into place (a
// CREATE of the target) as envd's in-place write's events: envd opens the
// target (creating it when new), sets its mode and owner, then writes, so a
// watcher sees create, chmod, write for a new file and chmod, write for an
// existing one. ok is false for other paths.
func (r *recentUploads) uploadEvents(path, name string) ([]*fspb.FilesystemEvent, bool) {
	existed, ok := r.lookup(path)
	if !ok {
		return nil, false
	}
	var out []*fspb.FilesystemEvent
	if !existed {
		out = append(out, &fspb.FilesystemEvent{Name: name, Type: fspb.EventType_EVENT_TYPE_CREATE})
	}
	return append(out,
		&fspb.FilesystemEvent{Name: name, Type: fspb.EventType_EVENT_TYPE_CHMOD},
		&fspb.FilesystemEvent{Name: name, Type: fspb.EventType_EVENT_TYPE_WRITE}), true
}

// createTemp creates a new temp file for an upload in dir, remembered as
// the agent's own before it exists so that no watcher sees its events.
func (r *recentUploads) createTemp(dir string) (*os.File, error) {
	for range 100 {
		path := filepath.Join(dir, uploadTempPrefix+rand.Text())
		r.mu.Lock()
		if r.temps == nil {
			r.temps = map[string]time.Time{}
		}
		now := time.Now()
		for p, at := range r.temps {
			if !at.IsZero() && now.Sub(at) > uploadMemory {
				delete(r.temps, p)
			}
		}
		r.temps[path] = time.Time{}
		r.mu.Unlock()
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if err == nil {
			return f, nil
		}
		r.mu.Lock()
		delete(r.temps, path)
		r.mu.Unlock()
		if !errors.Is(err, fs.ErrExist) {
			return nil, err
		}
	}
	return nil, &fs.PathError{Op: "createtemp", Path: filepath.Join(dir, uploadTempPrefix+"*"), Err: fs.ErrExist}
}

// releaseTemp records that the temp file at path was renamed or removed;
// its late events stay hidden for uploadMemory.
func (r *recentUploads) releaseTemp(path string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.temps[path]; ok {
		r.temps[path] = time.Now()
	}
}

// isTemp reports whether path is (or recently was) an upload's temp file.
func (r *recentUploads) isTemp(path string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	at, ok := r.temps[path]
	return ok && (at.IsZero() || time.Since(at) <= uploadMemory)
}
