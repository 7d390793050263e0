package agent

import (
	"context"
	"sync"

	"connectrpc.com/connect"

	fspb "github.com/kernflux/opendsec/api/gen/filesystem"
	"github.com/kernflux/opendsec/internal/errdefs"
)

type pollWatcher struct{}

type watchers struct {
	mu   sync.Mutex
	byID map[string]*pollWatcher
}

func (f *filesystem) closeWatchers() {}

func (f *filesystem) WatchDir(ctx context.Context, req *connect.Request[fspb.WatchDirRequest], stream *connect.ServerStream[fspb.WatchDirResponse]) error {
	return errdefs.ToConnect(errdefs.New(errdefs.ErrUnimplemented, "WatchDir is not implemented yet"))
}

func (f *filesystem) CreateWatcher(ctx context.Context, req *connect.Request[fspb.CreateWatcherRequest]) (*connect.Response[fspb.CreateWatcherResponse], error) {
	return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrUnimplemented, "CreateWatcher is not implemented yet"))
}

func (f *filesystem) GetWatcherEvents(ctx context.Context, req *connect.Request[fspb.GetWatcherEventsRequest]) (*connect.Response[fspb.GetWatcherEventsResponse], error) {
	return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrUnimplemented, "GetWatcherEvents is not implemented yet"))
}

func (f *filesystem) RemoveWatcher(ctx context.Context, req *connect.Request[fspb.RemoveWatcherRequest]) (*connect.Response[fspb.RemoveWatcherResponse], error) {
	return nil, errdefs.ToConnect(errdefs.New(errdefs.ErrUnimplemented, "RemoveWatcher is not implemented yet"))
}
