// Package nodeclient is the one client of an OpenDsec node: its RPC
// services (NodeService, NodeImageService), the agent paths it proxies
// (<node>/agent/<sandbox-id>/...), the port tunnel through the agent, and
// the mapping of what a node answers to errdefs categories. The apiserver,
// the watcher and the E2B gateway reach nodes only through it.
//
// Which nodes exist and where they listen comes from a Directory
// (StaticDirectory: the config's nodes[] today); a Pool turns node IDs, or
// the node encoded in a sandbox ID, into cached Clients.
//
// It must not import internal/node or internal/runtime: the E2B gateway
// builds on it and stays free of the node's code.
package nodeclient

import (
	"net/http"
	"net/url"

	"github.com/kernflux/opendsec/api/gen/opendsec/node/v1/nodev1connect"
	"github.com/kernflux/opendsec/internal/auth"
)

// AgentPrefix is the path under which a node proxies each sandbox's agent:
// <node>/agent/<sandbox-id>/<agent path>.
const AgentPrefix = "/agent/"

// Options configure how Clients reach nodes.
type Options struct {
	// HTTPClient carries RPC and agent traffic; nil means DefaultHTTPClient
	// (cleartext HTTP/2). Port tunnels use a copy of its transport limited
	// to HTTP/1.1, which has Upgrade.
	HTTPClient *http.Client
	// Tokens supplies the node-scope service token added to every request
	// (a renewed auth.ServiceToken); nil adds none.
	Tokens auth.TokenSource
}

// DefaultHTTPClient returns the client components reach nodes with:
// unencrypted HTTP/2 (prior knowledge), so that every call, exec stream and
// file transfer is its own stream on a few connections, without timeouts
// (exec streams are long).
func DefaultHTTPClient() *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Protocols = new(http.Protocols)
	t.Protocols.SetUnencryptedHTTP2(true)
	// Many concurrent exec streams go to the same few nodes.
	t.MaxIdleConnsPerHost = 256
	return &http.Client{Transport: t}
}

// transports are the HTTP clients shared by every Client built with the
// same Options.
type transports struct {
	hc     *http.Client // RPC and agent traffic, with the token
	tunnel *http.Client // HTTP/1.1 only, for Upgrade: tcp, with the token
}

func newTransports(o Options) transports {
	base := o.HTTPClient
	if base == nil {
		base = DefaultHTTPClient()
	}
	// Tunnels need HTTP/1.1 (HTTP/2 has no Upgrade), whatever the client
	// speaks otherwise.
	tt := http.DefaultTransport.(*http.Transport).Clone()
	bt := base.Transport
	if ip, ok := bt.(*InProcess); ok {
		bt = ip.Next // tunnels go to the node's listener
	}
	if t, ok := bt.(*http.Transport); ok {
		tt = t.Clone()
	}
	tt.Protocols = new(http.Protocols)
	tt.Protocols.SetHTTP1(true)
	tt.ForceAttemptHTTP2 = false
	tunnel := &http.Client{Transport: tt}
	if o.Tokens == nil {
		return transports{hc: base, tunnel: tunnel}
	}
	return transports{hc: auth.ClientFrom(base, o.Tokens), tunnel: auth.ClientFrom(tunnel, o.Tokens)}
}

// Client reaches one node. Create it with New, or get it from a Pool. It
// is safe for concurrent use.
type Client struct {
	info   NodeInfo
	base   *url.URL
	tr     transports
	node   nodev1connect.NodeServiceClient
	images nodev1connect.NodeImageServiceClient
	snaps  nodev1connect.NodeSnapshotServiceClient
}

// New returns a Client for the node described by info (checked as
// StaticDirectory checks it).
func New(info NodeInfo, o Options) (*Client, error) {
	info, base, err := checkInfo("node", info)
	if err != nil {
		return nil, err
	}
	return newClient(info, base, newTransports(o)), nil
}

func newClient(info NodeInfo, base *url.URL, tr transports) *Client {
	return &Client{
		info:   info,
		base:   base,
		tr:     tr,
		node:   nodev1connect.NewNodeServiceClient(tr.hc, info.Addr),
		images: nodev1connect.NewNodeImageServiceClient(tr.hc, info.Addr),
		snaps:  nodev1connect.NewNodeSnapshotServiceClient(tr.hc, info.Addr),
	}
}

// ID is the node's 4-character ID.
func (c *Client) ID() string { return c.info.ID }

// Info is what the directory said about the node.
func (c *Client) Info() NodeInfo { return c.info }

// Node is the node's NodeService.
func (c *Client) Node() nodev1connect.NodeServiceClient { return c.node }

// Images is the node's NodeImageService (the shared image store).
func (c *Client) Images() nodev1connect.NodeImageServiceClient { return c.images }

// Snapshots is the node's NodeSnapshotService (the snapshots it keeps).
func (c *Client) Snapshots() nodev1connect.NodeSnapshotServiceClient { return c.snaps }

// HTTPClient sends requests to the node with its service token: for
// Connect clients of the agent (envd's process and filesystem services at
// AgentURL(id, "")) and plain agent requests such as /files.
func (c *Client) HTTPClient() *http.Client { return c.tr.hc }

// AgentURL is the URL of path (empty, or starting with /) on sandbox
// sandboxID's agent, through the node: <node>/agent/<id><path>. The result
// is the caller's to change (add a query, say).
func (c *Client) AgentURL(sandboxID, path string) *url.URL {
	u := *c.base
	u.Path = c.base.Path + AgentPrefix + sandboxID + path
	// An ID is one path segment, whatever it holds (sandbox IDs are
	// [a-z0-9] once routed; this only keeps a bad one from escaping).
	u.RawPath = c.base.EscapedPath() + AgentPrefix + url.PathEscape(sandboxID) + (&url.URL{Path: path}).EscapedPath()
	return &u
}
