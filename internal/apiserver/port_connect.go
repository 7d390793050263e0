package apiserver

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// DefaultConnectTimeout bounds opening a ConnectPort stream without
// timeout_ms: reaching the agent and dialing the port inside the sandbox.
const DefaultConnectTimeout = 10 * time.Second

// connectPortChunk is the most bytes one ConnectPortResponse carries.
const connectPortChunk = 64 << 10

// ConnectPortIdleAfterEOF bounds the caller's silence (no data, no
// close_write) after the port's eof: the agent ends a tunnel whose caller
// stays silent this long after the sandbox side's EOF (its
// defaultTunnelIdle), and the call must not outlive its tunnel. Nothing
// shows the tunnel's end on the connection itself (the port's EOF was its
// last word, and reads after an EOF return EOF at once), so the call keeps
// the same clock.
const ConnectPortIdleAfterEOF = 60 * time.Second

// connectPortIdle, when positive, replaces ConnectPortIdleAfterEOF (tests).
var connectPortIdle atomic.Int64

func validateConnectPort(m *v1.ConnectPortStart) error {
	if m.GetPort() < 1 || m.GetPort() > 65535 {
		return errdefs.Invalid("port", "%d must be between 1 and 65535", m.GetPort())
	}
	if m.GetTimeoutMs() < 0 {
		return errdefs.Invalid("timeout_ms", "%d must be ≥ 0 (0 means %s)", m.GetTimeoutMs(), DefaultConnectTimeout)
	}
	return nil
}

// activeRelays counts ConnectPort relay goroutines still running (tests
// check that none outlives its call).
var activeRelays atomic.Int64

// requestBodyKey carries the request body of a PortService call in its
// context (see portServiceHandler).
type requestBodyKey struct{}

// portServiceHandler is the PortService handler with each request's body
// in its context, so ConnectPort can close it: that is the only way to end
// a stream.Receive blocked in another goroutine before the handler returns
// (connect forbids touching the stream after that).
func (s *Server) portServiceHandler(opts ...connect.HandlerOption) (string, http.Handler) {
	path, h := opendsecv1connect.NewPortServiceHandler(s, opts...)
	return path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), requestBodyKey{}, r.Body)))
	})
}

// closeRequestBody ends the call's request stream: a Receive blocked on it
// returns an error. Idempotent (HTTP/2 bodies; bidi streams need HTTP/2).
func closeRequestBody(ctx context.Context) {
	if b, ok := ctx.Value(requestBodyKey{}).(io.Closer); ok {
		_ = b.Close()
	}
}

// ConnectPort relays a raw TCP stream between the caller and a port inside
// the sandbox, through the same agent tunnel as HTTPRequest
// (GET <node>/agent/<id>/_opendsec/port/<port> with Upgrade: tcp). Half-
// closes travel both ways: close_write (or the end of the caller's stream)
// makes the port read EOF, and the port's EOF is sent as the eof event while
// the caller may keep writing; the call ends once both directions are done
// or either side fails, or when the caller stays silent for
// ConnectPortIdleAfterEOF after the eof (the tunnel ends then too). The
// relay goroutine never outlives the call.
func (s *Server) ConnectPort(ctx context.Context, stream *connect.BidiStream[v1.ConnectPortRequest, v1.ConnectPortResponse]) error {
	first, err := stream.Receive()
	if errors.Is(err, io.EOF) {
		return errdefs.Invalid("start", "the stream ended before the start message")
	}
	if err != nil {
		return err
	}
	st := first.GetStart()
	if st == nil {
		return errdefs.Invalid("start", "the first message must be start; data and close_write come after it")
	}
	a, err := s.agentFor(ctx, st.GetSandboxId())
	if err != nil {
		return err
	}
	if err := validateConnectPort(st); err != nil {
		return err
	}
	timeout := DefaultConnectTimeout
	if st.GetTimeoutMs() > 0 {
		timeout = time.Duration(st.GetTimeoutMs()) * time.Millisecond
	}
	dctx, cancelDial := context.WithTimeoutCause(ctx, timeout,
		errdefs.New(errdefs.ErrDeadlineExceeded, "connect to port %d did not finish within %s; raise timeout_ms", st.GetPort(), timeout))
	conn, err := a.node.DialPort(dctx, a.id, int(st.GetPort()))
	cancelDial()
	if err != nil {
		return err
	}
	bodyCtx := ctx

	// The connection closes when the call ends or the caller misbehaves, which
	// unblocks the read loop below.
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	var wg sync.WaitGroup
	defer func() {
		// Nothing may use the stream after the handler returns: end the
		// relay's Receive and wait for it.
		cancel(nil)
		stop()
		conn.Close()
		closeRequestBody(bodyCtx)
		wg.Wait()
	}()

	if err := stream.Send(&v1.ConnectPortResponse{Event: &v1.ConnectPortResponse_Connected{Connected: &v1.ConnectPortConnected{}}}); err != nil {
		return err
	}
	writeDone := make(chan struct{})
	heard := make(chan struct{}, 1) // a message from the caller arrived
	wg.Add(1)
	activeRelays.Add(1)
	go func() {
		defer wg.Done()
		defer activeRelays.Add(-1)
		relayToPort(stream, conn, cancel, writeDone, heard)
	}()

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
			break
		}
		if rerr != nil {
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
			return errdefs.New(errdefs.ErrUnavailable, "read from port %d: %s", st.GetPort(), rerr)
		}
	}
	// The port half-closed; the caller may still be writing.
	if err := stream.Send(&v1.ConnectPortResponse{Event: &v1.ConnectPortResponse_Eof{Eof: true}}); err != nil {
		return err
	}
	idle := ConnectPortIdleAfterEOF
	if d := connectPortIdle.Load(); d > 0 {
		idle = time.Duration(d)
	}
	silence := time.NewTimer(idle)
	defer silence.Stop()
	for {
		select {
		case <-writeDone:
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-heard:
			silence.Reset(idle)
		case <-silence.C:
			return errdefs.New(errdefs.ErrDeadlineExceeded,
				"port %d closed its side and the caller sent nothing for %s after; the sandbox's tunnel closes such a connection: send data or close_write sooner", st.GetPort(), idle)
		}
	}
}

// closeWriter is a connection whose write side can be closed alone.
type closeWriter interface {
	CloseWrite() error
}

// relayToPort writes the caller's data to conn until the caller half-closes
// or its stream ends, then closes writeDone; a protocol error or a failed
// write cancels the call (and closes writeDone too). Every message received
// is reported on heard (without blocking).
func relayToPort(stream *connect.BidiStream[v1.ConnectPortRequest, v1.ConnectPortResponse], conn io.ReadWriteCloser, cancel context.CancelCauseFunc, writeDone, heard chan<- struct{}) {
	defer close(writeDone)
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
		select {
		case heard <- struct{}{}:
		default:
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
				return
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
