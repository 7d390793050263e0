package opendsec

import (
	"context"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// portChunk is the most bytes one ConnectPort message carries.
const portChunk = 32 << 10

// PortConn is a TCP stream to a port inside a sandbox, opened with
// ConnectPort. Read returns io.EOF once the server in the sandbox closed its
// side (a half-close: Write keeps working until CloseWrite or Close);
// CloseWrite makes the server read EOF; Close ends both directions. One
// goroutine may Read while another Writes.
type PortConn struct {
	stream *connect.BidiStreamForClient[opendsecv1.ConnectPortRequest, opendsecv1.ConnectPortResponse]
	cancel context.CancelFunc

	sendMu      sync.Mutex  // Send and CloseRequest are not safe for concurrent use
	wroteClosed atomic.Bool // CloseWrite was sent

	readMu sync.Mutex
	buf    []byte // received, not yet read
	rerr   error  // sticky read error

	closeOnce sync.Once
}

// ConnectPortOptions tunes ConnectPort.
type ConnectPortOptions struct {
	// Timeout bounds opening the stream (reaching the sandbox and the
	// port); 0 means the server's default (10 s).
	Timeout time.Duration
}

// ConnectPort opens a TCP stream to port inside sandbox id and returns once
// the server in the sandbox accepted it. Nothing listening on the port is an
// unavailable error saying "connection refused in sandbox". ctx bounds the
// whole stream.
func (c *Client) ConnectPort(ctx context.Context, id string, port uint32, opts ...ConnectPortOptions) (*PortConn, error) {
	if port == 0 || port > 65535 {
		return nil, invalid("port", "must be between 1 and 65535, got %d", port)
	}
	var o ConnectPortOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	if o.Timeout < 0 {
		return nil, invalid("timeout", "must be ≥ 0, got %s", o.Timeout)
	}
	ctx, cancel := context.WithCancel(ctx)
	p := &PortConn{stream: c.ports.ConnectPort(ctx), cancel: cancel}
	start := &opendsecv1.ConnectPortStart{SandboxId: id, Port: port, TimeoutMs: o.Timeout.Milliseconds()}
	if err := p.stream.Send(&opendsecv1.ConnectPortRequest{Msg: &opendsecv1.ConnectPortRequest_Start{Start: start}}); err != nil && !isEOF(err) {
		p.Close()
		return nil, convertError(err)
	}
	resp, err := p.stream.Receive()
	if err != nil {
		p.Close()
		if isEOF(err) {
			return nil, &Error{Code: CodeInternal, Message: "port stream ended before it connected"}
		}
		return nil, convertError(err)
	}
	if resp.GetConnected() == nil {
		p.Close()
		return nil, &Error{Code: CodeInternal, Message: "port stream: the first response was not connected"}
	}
	return p, nil
}

// Read reads bytes the server in the sandbox sent.
func (p *PortConn) Read(b []byte) (int, error) {
	p.readMu.Lock()
	defer p.readMu.Unlock()
	for len(p.buf) == 0 {
		if p.rerr != nil {
			return 0, p.rerr
		}
		resp, err := p.stream.Receive()
		switch {
		case isEOF(err):
			p.rerr = io.EOF
		case err != nil:
			p.rerr = convertError(err)
		case resp.GetEof():
			// The server half-closed; the stream stays open for writing.
			p.rerr = io.EOF
		default:
			p.buf = resp.GetData()
		}
	}
	n := copy(b, p.buf)
	p.buf = p.buf[n:]
	return n, nil
}

// errPortClosed is returned by Write once the stream has ended.
var errPortClosed = &Error{Code: CodeFailedPrecondition, Message: "the port stream is closed"}

// Write sends b to the server in the sandbox.
func (p *PortConn) Write(b []byte) (int, error) {
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	n := 0
	for n < len(b) {
		k := min(len(b)-n, portChunk)
		if err := p.stream.Send(&opendsecv1.ConnectPortRequest{Msg: &opendsecv1.ConnectPortRequest_Data{Data: b[n : n+k]}}); err != nil {
			if isEOF(err) {
				return n, errPortClosed
			}
			return n, convertError(err)
		}
		n += k
	}
	return n, nil
}

// CloseWrite tells the server in the sandbox that no more data comes: it
// reads EOF. Reading goes on until it closes its side; once both sides
// are closed the stream ends.
func (p *PortConn) CloseWrite() error {
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	err := p.stream.Send(&opendsecv1.ConnectPortRequest{Msg: &opendsecv1.ConnectPortRequest_CloseWrite{CloseWrite: true}})
	if isEOF(err) {
		return errPortClosed
	}
	if err == nil {
		p.wroteClosed.Store(true)
	}
	return convertError(err)
}

// closeGrace bounds how long Close waits, after CloseWrite, for the server
// to end the stream by itself.
const closeGrace = 2 * time.Second

// Close ends the stream in both directions; the connection inside the
// sandbox is closed.
func (p *PortConn) Close() error {
	p.closeOnce.Do(func() {
		if p.wroteClosed.Load() {
			// Everything was sent, close_write last. A cancel now could
			// overtake frames still in the transport (the server would
			// lose the tail of the data: seen as a flaky port-forward
			// test), so end the request and let the server end the
			// stream, which it does once both sides are closed, for a
			// while: the timer's cancel unblocks the Receive below and a
			// Read waiting in its own.
			p.sendMu.Lock()
			_ = p.stream.CloseRequest()
			p.sendMu.Unlock()
			t := time.AfterFunc(closeGrace, p.cancel)
			p.readMu.Lock()
			for {
				if _, err := p.stream.Receive(); err != nil {
					break
				}
			}
			p.readMu.Unlock()
			t.Stop()
		}
		p.cancel()
		p.sendMu.Lock()
		_ = p.stream.CloseRequest()
		p.sendMu.Unlock()
		// The cancel above unblocks a Read waiting in Receive.
		p.readMu.Lock()
		_ = p.stream.CloseResponse()
		if p.rerr == nil {
			p.rerr = errPortClosed
		}
		p.buf = nil
		p.readMu.Unlock()
	})
	return nil
}

var _ io.ReadWriteCloser = (*PortConn)(nil)
