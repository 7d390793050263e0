package agent

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
)

func TestWatchDirRecursive(t *testing.T) {
	e := newEnv(t, Config{})
	dir := t.TempDir()
	os.Mkdir(filepath.Join(dir, "sub"), 0o755)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	s, err := e.fs.WatchDir(ctx, connect.NewRequest(&fspb.WatchDirRequest{Path: dir, Recursive: true, IncludeEntry: true}))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() || s.Msg().GetStart() == nil {
		t.Fatalf("first event: %v %v", s.Msg(), s.Err())
	}
	os.WriteFile(filepath.Join(dir, "sub", "file.txt"), []byte("x"), 0o644)
	for s.Receive() {
		fe := s.Msg().GetFilesystem()
		if fe != nil && fe.Name == "sub/file.txt" && fe.Type == fspb.EventType_EVENT_TYPE_CREATE {
			if fe.Entry == nil || fe.Entry.Path != filepath.Join(dir, "sub", "file.txt") {
				t.Fatalf("entry = %v", fe.Entry)
			}
			return
		}
	}
	t.Fatalf("no create event for sub/file.txt: %v", s.Err())
}

func TestWatchErrors(t *testing.T) {
	e := newEnv(t, Config{})
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	os.WriteFile(file, nil, 0o644)
	for path, code := range map[string]connect.Code{filepath.Join(dir, "nope"): connect.CodeNotFound, file: connect.CodeInvalidArgument} {
		s, err := e.fs.WatchDir(t.Context(), connect.NewRequest(&fspb.WatchDirRequest{Path: path}))
		if err == nil {
			s.Receive()
			err = s.Err()
		}
		if connect.CodeOf(err) != code {
			t.Errorf("watch %s: %v, want %s", path, err, code)
		}
		if _, err := e.fs.CreateWatcher(t.Context(), connect.NewRequest(&fspb.CreateWatcherRequest{Path: path})); connect.CodeOf(err) != code {
			t.Errorf("create watcher %s: %v, want %s", path, err, code)
		}
	}
	if _, err := e.fs.GetWatcherEvents(t.Context(), connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: "nope"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("unknown watcher: %v", err)
	}
}

func TestPollingWatcher(t *testing.T) {
	e := newEnv(t, Config{})
	ctx := t.Context()
	dir := t.TempDir()
	cw, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&fspb.CreateWatcherRequest{Path: dir}))
	if err != nil {
		t.Fatal(err)
	}
	id := cw.Msg.WatcherId
	os.WriteFile(filepath.Join(dir, "a.txt"), []byte("x"), 0o644)
	os.Remove(filepath.Join(dir, "a.txt"))
	var seen []fspb.EventType
	eventually(t, 10*time.Second, "create and remove events", func() bool {
		ev, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		for _, fe := range ev.Msg.Events {
			if fe.Name == "a.txt" {
				seen = append(seen, fe.Type)
			}
		}
		return len(seen) > 0 && seen[0] == fspb.EventType_EVENT_TYPE_CREATE && seen[len(seen)-1] == fspb.EventType_EVENT_TYPE_REMOVE
	})
	if _, err := e.fs.RemoveWatcher(ctx, connect.NewRequest(&fspb.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("removed watcher: %v", err)
	}
}

// An upload writes a temp file and renames it into place; watchers must see
// what envd's in-place write shows: CREATE then WRITE of the target (only
// WRITE when it existed), and nothing of the temp file.
func TestWatchSeesUploadsAsInPlaceWrites(t *testing.T) {
	e := newEnv(t, Config{})
	ctx := t.Context()
	dir := t.TempDir()
	cw, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&fspb.CreateWatcherRequest{Path: dir}))
	if err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(dir, "up.txt")
	var seen []*fspb.FilesystemEvent
	waitFor := func(want ...fspb.EventType) {
		t.Helper()
		seen = nil
		eventually(t, 10*time.Second, "upload events", func() bool {
			ev, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: cw.Msg.WatcherId}))
			if err != nil {
				t.Fatal(err)
			}
			seen = append(seen, ev.Msg.Events...)
			return len(seen) >= len(want)
		})
		var got []fspb.EventType
		for _, fe := range seen {
			if fe.Name != "up.txt" {
				t.Fatalf("event for %q: %v", fe.Name, seen)
			}
			got = append(got, fe.Type)
		}
		if len(got) != len(want) {
			t.Fatalf("events %v; want %v", got, want)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("events %v; want %v", got, want)
			}
		}
	}
	for _, want := range [][]fspb.EventType{
		{fspb.EventType_EVENT_TYPE_CREATE, fspb.EventType_EVENT_TYPE_CHMOD, fspb.EventType_EVENT_TYPE_WRITE},
		{fspb.EventType_EVENT_TYPE_CHMOD, fspb.EventType_EVENT_TYPE_WRITE},
	} {
		resp, b := e.do(t, "POST", filesURL(target), strings.NewReader("data"), map[string]string{"Content-Type": "application/octet-stream"})
		if resp.StatusCode != 200 {
			t.Fatalf("upload: %d %s", resp.StatusCode, b)
		}
		waitFor(want...)
	}
}

// Only the agent's own temp files are hidden: a user's file that merely
// shares their prefix is reported, while an upload next to it still shows
// nothing of its temp file.
func TestWatchReportsUserFilesWithUploadPrefix(t *testing.T) {
	e := newEnv(t, Config{})
	ctx := t.Context()
	dir := t.TempDir()
	cw, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&fspb.CreateWatcherRequest{Path: dir}))
	if err != nil {
		t.Fatal(err)
	}
	user := uploadTempPrefix + "x"
	if err := os.WriteFile(filepath.Join(dir, user), []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	resp, b := e.do(t, "POST", filesURL(filepath.Join(dir, "up.txt")), strings.NewReader("data"), map[string]string{"Content-Type": "application/octet-stream"})
	if resp.StatusCode != 200 {
		t.Fatalf("upload: %d %s", resp.StatusCode, b)
	}
	var seen []*fspb.FilesystemEvent
	has := func(name string, typ fspb.EventType) bool {
		for _, fe := range seen {
			if fe.Name == name && fe.Type == typ {
				return true
			}
		}
		return false
	}
	eventually(t, 10*time.Second, "events of the user's file and the upload", func() bool {
		ev, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: cw.Msg.WatcherId}))
		if err != nil {
			t.Fatal(err)
		}
		seen = append(seen, ev.Msg.Events...)
		return has(user, fspb.EventType_EVENT_TYPE_CREATE) && has(user, fspb.EventType_EVENT_TYPE_WRITE) && has("up.txt", fspb.EventType_EVENT_TYPE_WRITE)
	})
	for _, fe := range seen {
		if fe.Name != user && fe.Name != "up.txt" {
			t.Fatalf("event for %q (the upload's temp file?): %v", fe.Name, seen)
		}
	}
}
