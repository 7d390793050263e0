package nodeclient

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// NoAutoResumeHeader on a call through a node's agent path keeps a paused
// sandbox paused: the node answers failed precondition, with the header,
// instead of resuming it (node.NoAutoResumeHeader).
const NoAutoResumeHeader = "Opendsec-No-Auto-Resume"

type noAutoResumeKey struct{}

// WithoutAutoResume returns ctx marked so that DialPort with it asks the
// node not to resume a paused sandbox (NoAutoResumeHeader).
func WithoutAutoResume(ctx context.Context) context.Context {
	return context.WithValue(ctx, noAutoResumeKey{}, true)
}

// AutoResumeOff reports whether ctx was made by WithoutAutoResume.
func AutoResumeOff(ctx context.Context) bool {
	off, _ := ctx.Value(noAutoResumeKey{}).(bool)
	return off
}

// PortPath is the agent path of the tunnel to a port inside the sandbox
// (HTTP/1.1 GET with Upgrade: tcp; the agent dials the port on loopback in
// the sandbox's network namespace).
func PortPath(port int) string { return fmt.Sprintf("/_opendsec/port/%d", port) }

// DialPort opens a raw TCP stream to port inside sandbox sandboxID:
// GET <node>/agent/<id>/_opendsec/port/<port> with Upgrade: tcp, over
// HTTP/1.1. ctx bounds opening the tunnel only; the stream lives until it
// is closed. The connection half-closes (CloseWrite: the port reads EOF
// while its answers still arrive). It has no deadlines: SetDeadline and its
// kin do nothing, so bound an exchange with a context that closes the
// connection. A refusal is a *ResponseError (port not open: unavailable,
// 502; a paused sandbox: failed_precondition; an unknown one: not_found),
// a node that cannot be reached is unavailable.
func (c *Client) DialPort(ctx context.Context, sandboxID string, port int) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, errdefs.Invalid("port", "%d must be between 1 and 65535", port)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.AgentURL(sandboxID, PortPath(port)).String(), nil)
	if err != nil {
		return nil, fmt.Errorf("tunnel request: %w", err)
	}
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "tcp")
	if AutoResumeOff(ctx) {
		req.Header.Set(NoAutoResumeHeader, "1")
	}
	resp, err := c.tr.tunnel.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, errdefs.New(errdefs.ErrUnavailable, "open tunnel to port %d of sandbox %s through node %s: %s", port, sandboxID, c.info.ID, err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		defer resp.Body.Close()
		return nil, MapResponse(resp, fmt.Sprintf("open tunnel to port %d", port))
	}
	rwc, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		resp.Body.Close()
		return nil, errdefs.New(errdefs.ErrInternal, "open tunnel to port %d: the upgraded connection is not writable", port)
	}
	return &tunnelConn{ReadWriteCloser: rwc, remote: tunnelAddr(fmt.Sprintf("%s/%s:%d", c.info.ID, sandboxID, port))}, nil
}

// tunnelConn is an upgraded HTTP body as a net.Conn.
type tunnelConn struct {
	io.ReadWriteCloser
	remote tunnelAddr
}

// CloseWrite half-closes the stream (net/http's upgraded body can).
func (c *tunnelConn) CloseWrite() error {
	if cw, ok := c.ReadWriteCloser.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errdefs.New(errdefs.ErrUnimplemented, "the tunnel cannot half-close")
}

func (c *tunnelConn) LocalAddr() net.Addr              { return tunnelAddr("local") }
func (c *tunnelConn) RemoteAddr() net.Addr             { return c.remote }
func (c *tunnelConn) SetDeadline(time.Time) error      { return nil }
func (c *tunnelConn) SetReadDeadline(time.Time) error  { return nil }
func (c *tunnelConn) SetWriteDeadline(time.Time) error { return nil }

// tunnelAddr names one end of a port tunnel: <node>/<sandbox>:<port>.
type tunnelAddr string

func (tunnelAddr) Network() string  { return "opendsec-tunnel" }
func (a tunnelAddr) String() string { return string(a) }
