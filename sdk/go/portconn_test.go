package opendsec_test

import (
	"bytes"
	"io"
	"strings"
	"testing"

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
