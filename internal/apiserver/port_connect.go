package apiserver

import (
	"context"
	"errors"
	"io"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// DefaultConnectTimeout bounds opening a ConnectPort stream without
// timeout_ms: reaching the agent and dialing the port inside the sandbox.
const DefaultConnectTimeout = 10 * time.Second

// connectPortChunk is the most bytes one ConnectPortResponse carries.
const connectPortChunk = 64 << 10

func validateConnectPort(m *v1.ConnectPortStart) error {
	if m.GetPort() < 1 || m.GetPort() > 65535 {
		return errdefs.Invalid("port", "%d must be between 1 and 65535", m.GetPort())
	}
	if m.GetTimeoutMs() < 0 {
		return errdefs.Invalid("timeout_ms", "%d must be ≥ 0 (0 means %s)", m.GetTimeoutMs(), DefaultConnectTimeout)
	}
	return nil
}

// ConnectPort relays a raw TCP stream between the caller and a port inside
// the sandbox, through the same agent tunnel as HTTPRequest
// (GET <node>/agent/<id>/_opendsec/port/<port> with Upgrade: tcp). Half-
// closes travel both ways: close_write (or the end of the caller's stream)
// makes the port read EOF, and the port's EOF ends the response stream.
func (s *Server) ConnectPort(ctx context.Context, stream *connect.BidiStream[v1.ConnectPortRequest, v1.ConnectPortResponse]) error {
	first, err := stream.Receive()
	if errors.Is(err, io.EOF) {
		return errdefs.ToConnect(errdefs.Invalid("start", "the stream ended before the start message"))
	}
	if err != nil {
		return err
	}
	st := first.GetStart()
	if st == nil {
		return errdefs.ToConnect(errdefs.Invalid("start", "the first message must be start; data and close_write come after it"))
	}
	a, err := s.agentFor(st.GetSandboxId())
	if err != nil {
		return errdefs.ToConnect(err)
	}
	if err := validateConnectPort(st); err != nil {
		return errdefs.ToConnect(err)
	}
	timeout := DefaultConnectTimeout
	if st.GetTimeoutMs() > 0 {
		timeout = time.Duration(st.GetTimeoutMs()) * time.Millisecond
	}
	dctx, cancelDial := context.WithTimeoutCause(ctx, timeout,
		errdefs.New(errdefs.ErrDeadlineExceeded, "connect to port %d did not finish within %s; raise timeout_ms", st.GetPort(), timeout))
	conn, err := s.dialPort(dctx, a, st.GetPort())
	cancelDial()
	if err != nil {
		return errdefs.ToConnect(err)
	}
	defer conn.Close()

	// The connection closes when the call ends or the caller misbehaves, which
	// unblocks the read loop below.
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()

	if err := stream.Send(&v1.ConnectPortResponse{Event: &v1.ConnectPortResponse_Connected{Connected: &v1.ConnectPortConnected{}}}); err != nil {
		return err
	}
	go relayToPort(stream, conn, cancel)

	buf := make([]byte, connectPortChunk)
	for {
		n, rerr := conn.Read(buf)
		if n > 0 {
			// Send copies nothing after it returns, so buf can be reused.
			if err := stream.Send(&v1.ConnectPortResponse{Event: &v1.ConnectPortResponse_Data{Data: buf[:n]}}); err != nil {
				return err
			}
		}
		if errors.Is(rerr, io.EOF) {
			return nil
		}
		if rerr != nil {
			if ctx.Err() != nil {
				return errdefs.ToConnect(context.Cause(ctx))
			}
			return errdefs.ToConnect(errdefs.New(errdefs.ErrUnavailable, "read from port %d: %s", st.GetPort(), rerr))
		}
	}
}

// closeWriter is a connection whose write side can be closed alone.
type closeWriter interface {
	CloseWrite() error
}

// relayToPort writes the caller's data to conn until the caller half-closes
// or its stream ends; a protocol error or a failed write cancels the call.
func relayToPort(stream *connect.BidiStream[v1.ConnectPortRequest, v1.ConnectPortResponse], conn io.ReadWriteCloser, cancel context.CancelCauseFunc) {
	halfClose := func() {
		if cw, ok := conn.(closeWriter); ok {
			if err := cw.CloseWrite(); err != nil {
				cancel(errdefs.New(errdefs.ErrUnavailable, "half-close the connection: %s", err))
			}
			return
		}
		cancel(errdefs.New(errdefs.ErrUnimplemented, "the tunnel cannot half-close; close the stream instead"))
	}
	for {
		m, err := stream.Receive()
		if errors.Is(err, io.EOF) {
			halfClose()
			return
		}
		if err != nil {
			cancel(err)
			return
		}
		switch msg := m.GetMsg().(type) {
		case *v1.ConnectPortRequest_Data:
			if _, err := conn.Write(msg.Data); err != nil {
				cancel(errdefs.New(errdefs.ErrUnavailable, "write to the port: %s", err))
				return
			}
		case *v1.ConnectPortRequest_CloseWrite:
			if msg.CloseWrite {
				halfClose()
			}
		case *v1.ConnectPortRequest_Start:
			cancel(errdefs.Invalid("start", "only the first message may be start"))
			return
		default:
			cancel(errdefs.Invalid("msg", "a message after start must be data or close_write"))
			return
		}
	}
}
