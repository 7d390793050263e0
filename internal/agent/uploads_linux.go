package agent

import (
	"path/filepath"
	"strings"
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
// for a new file, then WRITE, and nothing of the temp file.
type recentUploads struct {
	mu sync.Mutex
	// m maps a target path to whether it existed before the upload and
	// when it was renamed; guarded by mu.
	m map[string]recentUpload
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
// CREATE of the target) as envd's in-place write's events; ok is false for
// other paths.
func (r *recentUploads) uploadEvents(path, name string) ([]*fspb.FilesystemEvent, bool) {
	existed, ok := r.lookup(path)
	if !ok {
		return nil, false
	}
	var out []*fspb.FilesystemEvent
	if !existed {
		out = append(out, &fspb.FilesystemEvent{Name: name, Type: fspb.EventType_EVENT_TYPE_CREATE})
	}
	return append(out, &fspb.FilesystemEvent{Name: name, Type: fspb.EventType_EVENT_TYPE_WRITE}), true
}

func isUploadTemp(path string) bool {
	return strings.HasPrefix(filepath.Base(path), uploadTempPrefix)
}
