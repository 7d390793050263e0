package apiserver_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/apiserver"
)

// listenPort serves fn on a loopback listener standing in for port inside
// the fake sandbox.
func (e *env) listenPort(t *testing.T, port uint32, fn func(net.Conn)) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go fn(c)
		}
	}()
	a := e.nodes[0].agent
	a.mu.Lock()
	a.ports[port] = ln.Addr().String()
	a.mu.Unlock()
}

func startPort(id string, port uint32) *v1.ConnectPortRequest {
	return &v1.ConnectPortRequest{Msg: &v1.ConnectPortRequest_Start{Start: &v1.ConnectPortStart{SandboxId: id, Port: port}}}
}

// A stream carries bytes both ways, in order, and half-closes: the server
// in the sandbox reads EOF after close_write and can still answer.
func TestConnectPortStream(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	e.listenPort(t, 8000, func(c net.Conn) {
		defer c.Close()
		b, _ := io.ReadAll(c) // until the caller's close_write
		c.Write(b)
		c.Write([]byte("|eof"))
	})

	s := e.port.ConnectPort(t.Context())
	if err := s.Send(startPort(id, 8000)); err != nil {
		t.Fatal(err)
	}
	first, err := s.Receive()
	if err != nil || first.GetConnected() == nil {
		t.Fatalf("first response = %v, %v; want connected", first, err)
	}
	want := make([]byte, 1<<20)
	for i := range want {
		want[i] = byte(i * 7)
	}
	for off := 0; off < len(want); off += 40000 {
		chunk := want[off:min(off+40000, len(want))]
		if err := s.Send(&v1.ConnectPortRequest{Msg: &v1.ConnectPortRequest_Data{Data: chunk}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Send(&v1.ConnectPortRequest{Msg: &v1.ConnectPortRequest_CloseWrite{CloseWrite: true}}); err != nil {
		t.Fatal(err)
	}
	var got []byte
	for {
		m, err := s.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("receive after %d bytes: %v", len(got), err)
		}
		got = append(got, m.GetData()...)
	}
	if !bytes.Equal(got, append(want, "|eof"...)) {
		t.Fatalf("got %d bytes, want %d echoed + |eof", len(got), len(want))
	}
	s.CloseRequest()
}

// Ending the call closes the connection inside the sandbox.
func TestConnectPortCancelClosesConn(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	closed := make(chan error, 1)
	e.listenPort(t, 8000, func(c net.Conn) {
		defer c.Close()
		c.Write([]byte("hi"))
		_, err := io.Copy(io.Discard, c)
		closed <- err
	})
	ctx, cancel := context.WithCancel(t.Context())
	s := e.port.ConnectPort(ctx)
	s.Send(startPort(id, 8000))
	if m, err := s.Receive(); err != nil || m.GetConnected() == nil {
		t.Fatalf("first response = %v, %v", m, err)
	}
	if m, err := s.Receive(); err != nil || string(m.GetData()) != "hi" {
		t.Fatalf("data = %v, %v; want hi", m, err)
	}
	// A Go client resets the HTTP/2 stream when its context ends and the
	// response is closed.
	cancel()
	s.CloseResponse()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the connection in the sandbox stayed open after the call ended")
	}
}

func TestConnectPortErrors(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	open := func(first *v1.ConnectPortRequest) error {
		s := e.port.ConnectPort(t.Context())
		defer s.CloseResponse()
		if first != nil {
			s.Send(first)
		}
		s.CloseRequest()
		for {
			m, err := s.Receive()
			if err != nil {
				return err
			}
			if m.GetConnected() != nil {
				return nil
			}
		}
	}
	wantCode(t, open(startPort(id, 0)), connect.CodeInvalidArgument, "port: 0 must be between 1 and 65535")
	wantCode(t, open(startPort(id, 65536)), connect.CodeInvalidArgument, "port: 65536 must be between 1 and 65535")
	wantCode(t, open(&v1.ConnectPortRequest{Msg: &v1.ConnectPortRequest_Start{Start: &v1.ConnectPortStart{SandboxId: id, Port: 80, TimeoutMs: -1}}}),
		connect.CodeInvalidArgument, "timeout_ms")
	wantCode(t, open(nil), connect.CodeInvalidArgument, "start")
	wantCode(t, open(&v1.ConnectPortRequest{Msg: &v1.ConnectPortRequest_Data{Data: []byte("x")}}), connect.CodeInvalidArgument, "first message must be start")
	wantCode(t, open(startPort(id, 8001)), connect.CodeUnavailable, "port 8001 is not open in the sandbox")
	wantCode(t, open(startPort("n001zzzzzzzzzzzzzzzz", 8000)), connect.CodeNotFound, "not found")

	// A second start after the stream opened ends it with invalid_argument.
	e.listenPort(t, 8000, func(c net.Conn) { defer c.Close(); io.Copy(io.Discard, c) })
	s := e.port.ConnectPort(t.Context())
	s.Send(startPort(id, 8000))
	if m, err := s.Receive(); err != nil || m.GetConnected() == nil {
		t.Fatalf("first response = %v, %v", m, err)
	}
	s.Send(startPort(id, 8000))
	_, err := s.Receive()
	wantCode(t, err, connect.CodeInvalidArgument, "only the first message may be start")
}

// noRelaysLeft waits until earlier tests' calls have finished their relays,
// so that counting them means something.
func noRelaysLeft(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for apiserver.ActiveConnectPortRelays() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d relays of earlier calls still run", apiserver.ActiveConnectPortRelays())
		}
		time.Sleep(5 * time.Millisecond) // polling
	}
}

// receiveUntilEnd reads responses until the stream ends and returns the
// data, whether eof came, and the end (nil for a clean end).
func receiveUntilEnd(s *connect.BidiStreamForClient[v1.ConnectPortRequest, v1.ConnectPortResponse]) ([]byte, bool, error) {
	var data []byte
	eof := false
	for {
		m, err := s.Receive()
		if errors.Is(err, io.EOF) {
			return data, eof, nil
		}
		if err != nil {
			return data, eof, err
		}
		data = append(data, m.GetData()...)
		eof = eof || m.GetEof()
	}
}

// A server that closes right after accepting while the caller keeps
// sending: the call ends with an error and its relay goroutine is gone by
// the time the caller sees the end (connect forbids using the stream after
// the handler returned).
func TestConnectPortServerClosesWhileCallerSends(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	e.listenPort(t, 8000, func(c net.Conn) { c.Close() })
	noRelaysLeft(t)

	for i := range 5 {
		s := e.port.ConnectPort(t.Context())
		if err := s.Send(startPort(id, 8000)); err != nil {
			t.Fatal(err)
		}
		if m, err := s.Receive(); err != nil || m.GetConnected() == nil {
			t.Fatalf("first response = %v, %v; want connected", m, err)
		}
		sendDone := make(chan struct{})
		go func() {
			defer close(sendDone)
			chunk := make([]byte, 16<<10)
			for s.Send(&v1.ConnectPortRequest{Msg: &v1.ConnectPortRequest_Data{Data: chunk}}) == nil {
			}
		}()
		// eof may or may not come first: the failed write can win the race
		// with reading the port's EOF.
		_, _, err := receiveUntilEnd(s)
		if n := apiserver.ActiveConnectPortRelays(); n != 0 {
			t.Fatalf("round %d: %d relay goroutines still run after the call ended (%v)", i, n, err)
		}
		// A server that closes with our data unread in its buffer sends a
		// reset, so the failure shows on the write or on the read.
		if !strings.Contains(fmt.Sprint(err), "read from port") {
			wantCode(t, err, connect.CodeUnavailable, "write to the port")
		} else {
			wantCode(t, err, connect.CodeUnavailable, "connection reset")
		}
		s.CloseRequest()
		<-sendDone
		s.CloseResponse()
	}
}

// The port's half-close arrives as eof while the caller still writes; the
// call ends cleanly once the caller half-closes too.
func TestConnectPortServerHalfClose(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	e.listenPort(t, 8000, func(c net.Conn) {
		defer c.Close()
		c.Write([]byte("hello"))
		c.(*net.TCPConn).CloseWrite()
		io.Copy(io.Discard, c)
	})
	noRelaysLeft(t)
	s := e.port.ConnectPort(t.Context())
	defer s.CloseResponse()
	s.Send(startPort(id, 8000))
	if m, err := s.Receive(); err != nil || m.GetConnected() == nil {
		t.Fatalf("first response = %v, %v; want connected", m, err)
	}
	var got []byte
	for {
		m, err := s.Receive()
		if err != nil {
			t.Fatalf("receive after %q: %v; want data then eof", got, err)
		}
		got = append(got, m.GetData()...)
		if m.GetEof() {
			break
		}
	}
	if string(got) != "hello" {
		t.Fatalf("data before eof = %q, want hello", got)
	}
	if n := apiserver.ActiveConnectPortRelays(); n != 1 {
		t.Fatalf("%d relays run after eof, want 1 (the caller may still write)", n)
	}
	if err := s.Send(&v1.ConnectPortRequest{Msg: &v1.ConnectPortRequest_CloseWrite{CloseWrite: true}}); err != nil {
		t.Fatal(err)
	}
	if data, _, err := receiveUntilEnd(s); err != nil || len(data) > 0 {
		t.Fatalf("after close_write: data %q, end %v; want a clean end", data, err)
	}
	if n := apiserver.ActiveConnectPortRelays(); n != 0 {
		t.Fatalf("%d relays still run after the call ended", n)
	}
}

// After the port's eof a caller that stays silent does not hold the call
// open past the tunnel's life: the call ends after the idle bound (the
// agent closes such a tunnel, and nothing on the connection shows it). A
// caller that keeps sending is not cut.
func TestConnectPortSilentCallerAfterEOF(t *testing.T) {
	e := setup(t, nil, "n001")
	id := e.create(busybox()).GetId()
	apiserver.SetConnectPortIdle(t, 300*time.Millisecond)
	got := make(chan []byte, 1)
	e.listenPort(t, 8000, func(c net.Conn) {
		defer c.Close()
		c.Write([]byte("bye"))
		c.(*net.TCPConn).CloseWrite()
		b, _ := io.ReadAll(c)
		got <- b
	})
	noRelaysLeft(t)
	open := func() *connect.BidiStreamForClient[v1.ConnectPortRequest, v1.ConnectPortResponse] {
		s := e.port.ConnectPort(t.Context())
		t.Cleanup(func() { s.CloseRequest(); s.CloseResponse() })
		s.Send(startPort(id, 8000))
		for {
			m, err := s.Receive()
			if err != nil {
				t.Fatalf("receive before eof: %v", err)
			}
			if m.GetEof() {
				return s
			}
		}
	}
	end := func(s *connect.BidiStreamForClient[v1.ConnectPortRequest, v1.ConnectPortResponse]) error {
		ended := make(chan error, 1)
		go func() {
			_, _, err := receiveUntilEnd(s)
			ended <- err
		}()
		select {
		case err := <-ended:
			return err
		case <-time.After(10 * time.Second):
			t.Fatal("the call of a silent caller still runs 10 s after the port's eof")
			return nil
		}
	}

	s := open()
	wantCode(t, end(s), connect.CodeDeadlineExceeded, "the caller sent nothing")
	if n := apiserver.ActiveConnectPortRelays(); n != 0 {
		t.Fatalf("%d relays still run after the call ended", n)
	}

	// Sending more often than the bound keeps the call: 6 sends 100 ms
	// apart span twice the bound.
	s = open()
	for i := range 6 {
		if err := s.Send(&v1.ConnectPortRequest{Msg: &v1.ConnectPortRequest_Data{Data: []byte{'a' + byte(i)}}}); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
		time.Sleep(100 * time.Millisecond) // pacing, not synchronisation
	}
	if err := s.Send(&v1.ConnectPortRequest{Msg: &v1.ConnectPortRequest_CloseWrite{CloseWrite: true}}); err != nil {
		t.Fatal(err)
	}
	if err := end(s); err != nil {
		t.Fatalf("a caller that kept sending: %v; want a clean end", err)
	}
	<-got // the first call's server
	if b := <-got; string(b) != "abcdef" {
		t.Fatalf("the port read %q, want abcdef", b)
	}
}
