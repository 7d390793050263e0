package opendsec

import (
	"context"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// Snapshot is a saved sandbox (SnapshotService). Start sandboxes from it
// with SandboxSpec{Snapshot: snap.GetId()}.
type Snapshot = opendsecv1.Snapshot

// CreateSnapshot saves sandbox id as a snapshot called name (empty: a name
// made of the sandbox ID and the time). The sandbox keeps running; it is
// frozen only while its changes are copied. On the container backend the
// snapshot holds the filesystem (GetMemory is false).
func (c *Client) CreateSnapshot(ctx context.Context, id, name string) (*Snapshot, error) {
	r, err := c.snapshots.CreateSnapshot(ctx, connect.NewRequest(&opendsecv1.CreateSnapshotRequest{SandboxId: id, Name: name}))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg.GetSnapshot(), nil
}

// GetSnapshot returns one of the caller's snapshots.
func (c *Client) GetSnapshot(ctx context.Context, id string) (*Snapshot, error) {
	r, err := c.snapshots.GetSnapshot(ctx, connect.NewRequest(&opendsecv1.GetSnapshotRequest{Id: id}))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg.GetSnapshot(), nil
}

// ListSnapshots returns the caller's snapshots (an admin's: every one),
// oldest first.
func (c *Client) ListSnapshots(ctx context.Context) ([]*Snapshot, error) {
	r, err := c.snapshots.ListSnapshots(ctx, connect.NewRequest(&opendsecv1.ListSnapshotsRequest{}))
	if err != nil {
		return nil, convertError(err)
	}
	return r.Msg.GetSnapshots(), nil
}

// DeleteSnapshot removes a snapshot and its image. Sandboxes started from
// it keep running.
func (c *Client) DeleteSnapshot(ctx context.Context, id string) error {
	_, err := c.snapshots.DeleteSnapshot(ctx, connect.NewRequest(&opendsecv1.DeleteSnapshotRequest{Id: id}))
	return convertError(err)
}
