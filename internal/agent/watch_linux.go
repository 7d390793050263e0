package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// maxPolledEvents bounds the events a polling watcher holds between
// GetWatcherEvents calls (oldest dropped).
const maxPolledEvents = 10000

// dirWatch turns fsnotify events under root into envd FilesystemEvents.
type dirWatch struct {
	root         string
	recursive    bool
	includeEntry bool
	fsys         *filesystem
	w            *fsnotify.Watcher
}

type watchParams interface {
	GetPath() string
	GetRecursive() bool
	GetIncludeEntry() bool
	GetAllowNetworkMounts() bool
}

// Network filesystems whose change events are unreliable (statfs magics).
var networkFS = map[int64]string{
	0x6969: "nfs", 0xFF534D42: "cifs", 0x517B: "smb", 0xFE534D42: "smb2",
	0x5346414F: "afs", 0x00C36400: "ceph", 0x65735546: "fuse",
}

func (f *filesystem) newDirWatch(h interface{ Get(string) string }, req watchParams) (*dirWatch, error) {
	_, p, err := f.resolve(h, "path", req.GetPath())
	if err != nil {
		return nil, err
	}
	st, err := os.Stat(p)
	if err != nil {
		return nil, fsErr("watch", p, err)
	}
	if !st.IsDir() {
		return nil, errdefs.Invalid("path", "'%s' is not a directory; watch a directory", p)
	}
	if !req.GetAllowNetworkMounts() {
		var sfs unix.Statfs_t
		if err := unix.Statfs(p, &sfs); err == nil {
			if name, ok := networkFS[int64(sfs.Type)]; ok {
				return nil, errdefs.Invalid("allow_network_mounts", "'%s' is on a network filesystem (%s); set allow_network_mounts to watch it anyway", p, name)
			}
		}
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, errdefs.New(errdefs.ErrResourceExhausted, "create watcher: %s", err)
	}
	d := &dirWatch{root: p, recursive: req.GetRecursive(), includeEntry: req.GetIncludeEntry(), fsys: f, w: w}
	if err := d.add(p); err != nil {
		w.Close()
		return nil, err
	}
	return d, nil
}

// add watches dir, and with recursive every directory below it.
func (d *dirWatch) add(dir string) error {
	if !d.recursive {
		if err := d.w.Add(dir); err != nil {
			return fsErr("watch", dir, err)
		}
		return nil
	}
	return filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			if p == dir {
				return fsErr("watch", p, err)
			}
			return nil // vanished meanwhile
		}
		if !de.IsDir() {
			return nil
		}
		if err := d.w.Add(p); err != nil && p == dir {
			return fsErr("watch", p, err)
		}
		return nil
	})
}

var ops = []struct {
	op fsnotify.Op
	t  fspb.EventType
}{
	{fsnotify.Create, fspb.EventType_EVENT_TYPE_CREATE},
	{fsnotify.Write, fspb.EventType_EVENT_TYPE_WRITE},
	{fsnotify.Remove, fspb.EventType_EVENT_TYPE_REMOVE},
	{fsnotify.Rename, fspb.EventType_EVENT_TYPE_RENAME},
	{fsnotify.Chmod, fspb.EventType_EVENT_TYPE_CHMOD},
}

// convert maps one fsnotify event to one envd event per op.
func (d *dirWatch) convert(ev fsnotify.Event) []*fspb.FilesystemEvent {
	name, err := filepath.Rel(d.root, ev.Name)
	if err != nil {
		name = ev.Name
	}
	if d.fsys.uploads.isTemp(ev.Name) {
		return nil // an upload in progress; its rename is reported below
	}
	if d.recursive && ev.Has(fsnotify.Create) {
		if st, err := os.Lstat(ev.Name); err == nil && st.IsDir() {
			_ = d.add(ev.Name)
		}
	}
	if ev.Has(fsnotify.Create) {
		if out, ok := d.fsys.uploads.uploadEvents(ev.Name, name); ok {
			if d.includeEntry {
				if e, err := d.fsys.entry(ev.Name); err == nil {
					for _, fe := range out {
						fe.Entry = e
					}
				}
			}
			return out
		}
	}
	var out []*fspb.FilesystemEvent
	for _, o := range ops {
		if !ev.Has(o.op) {
			continue
		}
		fe := &fspb.FilesystemEvent{Name: name, Type: o.t}
		if d.includeEntry && (o.op == fsnotify.Create || o.op == fsnotify.Write || o.op == fsnotify.Chmod) {
			if e, err := d.fsys.entry(ev.Name); err == nil {
				fe.Entry = e
			}
		}
		out = append(out, fe)
	}
	return out
}

func (f *filesystem) WatchDir(ctx context.Context, req *connect.Request[fspb.WatchDirRequest], stream *connect.ServerStream[fspb.WatchDirResponse]) error {
	d, err := f.newDirWatch(req.Header(), req.Msg)
	if err != nil {
		return errdefs.ToConnect(err)
	}
	defer d.w.Close()
	if err := stream.Send(&fspb.WatchDirResponse{Event: &fspb.WatchDirResponse_Start{Start: &fspb.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	keepalive := keepaliveInterval(req.Header())
	ka := time.NewTimer(keepalive)
	defer ka.Stop()
	for {
		select {
		case ev, ok := <-d.w.Events:
			if !ok {
				return nil
			}
			for _, fe := range d.convert(ev) {
				if err := stream.Send(&fspb.WatchDirResponse{Event: &fspb.WatchDirResponse_Filesystem{Filesystem: fe}}); err != nil {
					return err
				}
			}
			ka.Reset(keepalive)
		case <-d.w.Errors:
			// Overflow or a vanished directory: keep going.
		case <-ka.C:
			if err := stream.Send(&fspb.WatchDirResponse{Event: &fspb.WatchDirResponse_Keepalive{Keepalive: &fspb.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
			ka.Reset(keepalive)
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return nil // the client's watch duration ended
			}
			return errdefs.ToConnect(ctx.Err())
		}
	}
}

// pollWatcher buffers events for GetWatcherEvents.
type pollWatcher struct {
	d      *dirWatch
	mu     sync.Mutex
	events []*fspb.FilesystemEvent
	done   chan struct{}
}

type watchers struct {
	mu   sync.Mutex
	byID map[string]*pollWatcher
}

func (pw *pollWatcher) run() {
	for {
		select {
		case ev, ok := <-pw.d.w.Events:
			if !ok {
				return
			}
			fes := pw.d.convert(ev)
			pw.mu.Lock()
			pw.events = append(pw.events, fes...)
			if over := len(pw.events) - maxPolledEvents; over > 0 {
				pw.events = append([]*fspb.FilesystemEvent(nil), pw.events[over:]...)
			}
			pw.mu.Unlock()
		case <-pw.d.w.Errors:
		case <-pw.done:
			return
		}
	}
}

func (f *filesystem) closeWatchers() {
	f.watch.mu.Lock()
	defer f.watch.mu.Unlock()
	for id, pw := range f.watch.byID {
		close(pw.done)
		pw.d.w.Close()
		delete(f.watch.byID, id)
	}
}

func (f *filesystem) CreateWatcher(ctx context.Context, req *connect.Request[fspb.CreateWatcherRequest]) (*connect.Response[fspb.CreateWatcherResponse], error) {
	d, err := f.newDirWatch(req.Header(), req.Msg)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	b := make([]byte, 12)
	rand.Read(b)
	id := hex.EncodeToString(b)
	pw := &pollWatcher{d: d, done: make(chan struct{})}
	f.watch.mu.Lock()
	f.watch.byID[id] = pw
	f.watch.mu.Unlock()
	go pw.run()
	return connect.NewResponse(&fspb.CreateWatcherResponse{WatcherId: id}), nil
}

func (f *filesystem) poller(id string) (*pollWatcher, error) {
	f.watch.mu.Lock()
	defer f.watch.mu.Unlock()
	pw := f.watch.byID[id]
	if pw == nil {
		return nil, errdefs.New(errdefs.ErrNotFound, "watcher %q not found", id)
	}
	return pw, nil
}

func (f *filesystem) GetWatcherEvents(ctx context.Context, req *connect.Request[fspb.GetWatcherEventsRequest]) (*connect.Response[fspb.GetWatcherEventsResponse], error) {
	pw, err := f.poller(req.Msg.GetWatcherId())
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	pw.mu.Lock()
	evs := pw.events
	pw.events = nil
	pw.mu.Unlock()
	return connect.NewResponse(&fspb.GetWatcherEventsResponse{Events: evs}), nil
}

func (f *filesystem) RemoveWatcher(ctx context.Context, req *connect.Request[fspb.RemoveWatcherRequest]) (*connect.Response[fspb.RemoveWatcherResponse], error) {
	f.watch.mu.Lock()
	pw := f.watch.byID[req.Msg.GetWatcherId()]
	delete(f.watch.byID, req.Msg.GetWatcherId())
	f.watch.mu.Unlock()
	if pw == nil {
		return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrNotFound, "watcher %q not found", req.Msg.GetWatcherId()))
	}
	close(pw.done)
	pw.d.w.Close()
	return connect.NewResponse(&fspb.RemoveWatcherResponse{}), nil
}
