package nodeclient

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// NodeInfo is what a Directory knows about one node.
type NodeInfo struct {
	// ID is the node's 4-character ID, the first 4 characters of the IDs
	// of its sandboxes.
	ID string
	// Addr is the node's base URL, http://host:port, without a trailing
	// slash.
	Addr string
}

// Directory says which nodes exist and where they listen. The apiserver,
// the watcher and the E2B gateway all read it (through a Pool), so it is
// defined here, next to the one client of a node, rather than three times
// where it is used. StaticDirectory serves the config's nodes[]; a
// directory of registered nodes can replace it without touching its users.
type Directory interface {
	// Lookup returns node id. A node the directory does not know is
	// errdefs.ErrNotFound, with a message naming it and what to check.
	Lookup(ctx context.Context, id string) (NodeInfo, error)
	// List returns every node, in a stable order.
	List(ctx context.Context) ([]NodeInfo, error)
}

// StaticDirectory is a fixed list of nodes (the config's nodes[]).
type StaticDirectory struct {
	nodes []NodeInfo
	byID  map[string]NodeInfo
}

var _ Directory = (*StaticDirectory)(nil)

// NewStaticDirectory checks nodes (IDs of 4 characters of [a-z0-9], each
// once; addresses http:// or https:// URLs) and returns a directory of
// them, in their order. Errors name the bad entry as nodes[i].
func NewStaticDirectory(nodes ...NodeInfo) (*StaticDirectory, error) {
	d := &StaticDirectory{byID: make(map[string]NodeInfo, len(nodes))}
	for i, n := range nodes {
		n, _, err := checkInfo(fmt.Sprintf("nodes[%d]", i), n)
		if err != nil {
			return nil, err
		}
		if _, dup := d.byID[n.ID]; dup {
			return nil, errdefs.Invalid(fmt.Sprintf("nodes[%d].id", i), "%q is listed twice; give each node its own ID", n.ID)
		}
		d.byID[n.ID] = n
		d.nodes = append(d.nodes, n)
	}
	return d, nil
}

// Lookup returns node id, or a not_found error naming it.
func (d *StaticDirectory) Lookup(_ context.Context, id string) (NodeInfo, error) {
	n, ok := d.byID[id]
	if !ok {
		return NodeInfo{}, errdefs.New(errdefs.ErrNotFound,
			"node %s is not among the %d configured nodes; check the ID, or add the node to nodes[] in the config of every apiserver, watcher and E2B gateway", id, len(d.nodes))
	}
	return n, nil
}

// List returns the nodes in their configured order.
func (d *StaticDirectory) List(context.Context) ([]NodeInfo, error) {
	return slices.Clone(d.nodes), nil
}

// checkInfo validates n (field names it in errors) and returns it with
// the trailing slashes of its address trimmed, and the parsed address.
func checkInfo(field string, n NodeInfo) (NodeInfo, *url.URL, error) {
	if err := sandboxid.ValidNode(n.ID); err != nil {
		return NodeInfo{}, nil, errdefs.Invalid(field+".id", "%q must be exactly 4 characters of [a-z0-9], e.g. \"n001\"", n.ID)
	}
	n.Addr = strings.TrimRight(n.Addr, "/")
	u, err := url.Parse(n.Addr)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return NodeInfo{}, nil, errdefs.Invalid(field+".address", "%q must be a URL like http://host:port", n.Addr)
	}
	return n, u, nil
}
