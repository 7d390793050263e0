package opendsec_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

func TestConnectPort(t *testing.T) {
	srv := opendsectest.New(t, token)
	c := newClient(t, srv)
	sb := create(t, c)
	conn, err := c.ConnectPort(t.Context(), sb.Id, 8000)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// More than one message's worth, so Write splits it.
	want := bytes.Repeat([]byte("0123456789abcdef"), 10<<10)
	done := make(chan error, 1)
	go func() {
		_, err := conn.Write(want)
		if err == nil {
			err = conn.CloseWrite()
		}
		done <- err
	}()
	got, err := io.ReadAll(conn)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("write: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("echo: got %d bytes, want %d", len(got), len(want))
	}
	conn.Close()
	if _, err := conn.Read(make([]byte, 1)); err == nil {
		t.Fatal("read after close succeeded")
	}

	for _, port := range []uint32{0, 65536} {
		if _, err := c.ConnectPort(t.Context(), sb.Id, port); !opendsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "port") {
			t.Fatalf("port %d: %v, want invalid argument naming port", port, err)
		}
	}
	if _, err := c.ConnectPort(t.Context(), sb.Id, 1); !opendsec.IsUnavailable(err) || !strings.Contains(err.Error(), "connection refused in sandbox") {
		t.Fatalf("closed port: %v", err)
	}
	if _, err := c.ConnectPort(t.Context(), "nope", 8000); !opendsec.IsNotFound(err) {
		t.Fatalf("unknown sandbox: %v", err)
	}
}

// halfClosingPort is a PortService whose port sends "hello", half-closes
// (eof) and then reads what the caller sends until close_write.
type halfClosingPort struct {
	opendsecv1connect.UnimplementedPortServiceHandler
	got chan string
}

func (h halfClosingPort) ConnectPort(ctx context.Context, stream *connect.BidiStream[opendsecv1.ConnectPortRequest, opendsecv1.ConnectPortResponse]) error {
	if _, err := stream.Receive(); err != nil {
		return err
	}
	for _, ev := range []*opendsecv1.ConnectPortResponse{
		{Event: &opendsecv1.ConnectPortResponse_Connected{Connected: &opendsecv1.ConnectPortConnected{}}},
		{Event: &opendsecv1.ConnectPortResponse_Data{Data: []byte("hello")}},
		{Event: &opendsecv1.ConnectPortResponse_Eof{Eof: true}},
	} {
		if err := stream.Send(ev); err != nil {
			return err
		}
	}
	var got []byte
	for {
		m, err := stream.Receive()
		if err != nil && !errors.Is(err, io.EOF) {
			return err
		}
		if err != nil || m.GetCloseWrite() {
			h.got <- string(got)
			return nil
		}
		got = append(got, m.GetData()...)
	}
}

// The server's half-close ends reading while writing goes on.
func TestPortConnServerHalfClose(t *testing.T) {
	h := halfClosingPort{got: make(chan string, 1)}
	mux := http.NewServeMux()
	mux.Handle(opendsecv1connect.NewPortServiceHandler(h))
	srv := httptest.NewUnstartedServer(mux)
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	srv.Config.Protocols = &p
	srv.Start()
	defer srv.Close()
	c, err := opendsec.New(srv.URL, opendsec.WithToken(token))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	conn, err := c.ConnectPort(t.Context(), "sb", 8000)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	read := make(chan string, 1)
	go func() {
		b, err := io.ReadAll(conn)
		if err != nil {
			b = append(b, " error: "+err.Error()...)
		}
		read <- string(b)
	}()
	select {
	case got := <-read:
		if got != "hello" {
			t.Fatalf("read %q, want hello then EOF", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Read did not return EOF after the server's half-close")
	}
	if _, err := conn.Write([]byte("still ")); err != nil {
		t.Fatalf("write after the server's eof: %v", err)
	}
	if _, err := conn.Write([]byte("writing")); err != nil {
		t.Fatalf("write after the server's eof: %v", err)
	}
	if err := conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-h.got:
		if got != "still writing" {
			t.Fatalf("the server read %q, want \"still writing\"", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the server never saw close_write")
	}
}
