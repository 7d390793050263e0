package nodeclient

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// Pool hands out the Client of each node the Directory knows, built once
// and reused while the node's address stays the same. It is safe for
// concurrent use.
type Pool struct {
	dir Directory
	tr  transports

	mu sync.Mutex
	// clients by node ID; guarded by mu.
	clients map[string]*Client
}

// NewPool returns a Pool over dir; every Client it makes uses o.
func NewPool(dir Directory, o Options) *Pool {
	return &Pool{dir: dir, tr: newTransports(o), clients: map[string]*Client{}}
}

// Directory is the pool's directory.
func (p *Pool) Directory() Directory { return p.dir }

// Get returns the Client of node id. An unknown node is the directory's
// error (not_found for StaticDirectory).
func (p *Pool) Get(ctx context.Context, id string) (*Client, error) {
	info, err := p.dir.Lookup(ctx, id)
	if err != nil {
		return nil, err
	}
	return p.client(info)
}

// ForSandbox routes a sandbox ID to the Client of its node (the ID's first
// 4 characters). field names the request field carrying the ID in errors.
// A malformed ID is invalid_argument; a node the directory does not know
// is not_found, saying that the sandbox is not found and why.
func (p *Pool) ForSandbox(ctx context.Context, field, sandboxID string) (*Client, error) {
	if sandboxID == "" {
		return nil, errdefs.Invalid(field, "is empty; give a sandbox ID (list them with `opendsecctl sandbox list`)")
	}
	nodeID, err := sandboxid.Node(field, sandboxID)
	if err != nil {
		return nil, err
	}
	c, err := p.Get(ctx, nodeID)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, errdefs.New(errdefs.ErrNotFound, "sandbox %s not found: %s", sandboxID, err)
	}
	if err != nil {
		return nil, fmt.Errorf("find the node of sandbox %s: %w", sandboxID, err)
	}
	return c, nil
}

// ForSnapshot routes a snapshot ID (the same shape as a sandbox ID, and
// starting with the ID of the node that keeps it) to that node's Client.
// field names the request field in errors.
func (p *Pool) ForSnapshot(ctx context.Context, field, snapshotID string) (*Client, error) {
	nodeID, err := sandboxid.Snapshot(field, snapshotID)
	if err != nil {
		return nil, err
	}
	c, err := p.Get(ctx, nodeID)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, errdefs.New(errdefs.ErrNotFound, "%s: snapshot %s not found: %s", field, snapshotID, err)
	}
	if err != nil {
		return nil, fmt.Errorf("find the node of snapshot %s: %w", snapshotID, err)
	}
	return c, nil
}

// List returns the Client of every node in the directory, in its order.
func (p *Pool) List(ctx context.Context) ([]*Client, error) {
	infos, err := p.dir.List(ctx)
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	out := make([]*Client, 0, len(infos))
	for _, info := range infos {
		c, err := p.client(info)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// client returns the cached Client for info, replacing one made for
// another address.
func (p *Pool) client(info NodeInfo) (*Client, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c, ok := p.clients[info.ID]; ok && c.info == info {
		return c, nil
	}
	checked, base, err := checkInfo(fmt.Sprintf("nodes[%q]", info.ID), info)
	if err != nil {
		return nil, err
	}
	if c, ok := p.clients[info.ID]; ok && c.info == checked {
		return c, nil
	}
	c := newClient(checked, base, p.tr)
	p.clients[info.ID] = c
	return c, nil
}
