package cli

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	opendsec "github.com/kernflux/opendsec/sdk/go"
	"github.com/kernflux/opendsec/sdk/go/opendsectest"
)

// syncBuffer is a bytes.Buffer safe for the forwarder's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// The forwarder relays each local connection to the sandbox port (the
// fake's echo server), several at once, and reports a refused port without
// stopping.
func TestPortForwardRelays(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv)
	c, err := opendsec.New(srv.Addr(), opendsec.WithToken(token))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	forward := func(port uint32) (string, *syncBuffer, func()) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		errw := &syncBuffer{}
		done := make(chan error, 1)
		go func() { done <- forwardPort(ctx, c, ln, id, port, errw) }()
		return ln.Addr().String(), errw, func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("forwardPort: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Error("forwardPort did not return after its context ended")
			}
		}
	}

	addr, _, stop := forward(8000)
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lc, err := net.Dial("tcp", addr)
			if err != nil {
				t.Error(err)
				return
			}
			defer lc.Close()
			msg := strings.Repeat(fmt.Sprintf("conn %d;", i), 20000)
			go func() {
				io.WriteString(lc, msg)
				lc.(*net.TCPConn).CloseWrite()
			}()
			lc.SetDeadline(time.Now().Add(20 * time.Second))
			got, err := io.ReadAll(lc)
			if err != nil || string(got) != msg {
				t.Errorf("conn %d: got %d bytes (%v), want %d echoed", i, len(got), err, len(msg))
			}
		}()
	}
	wg.Wait()
	stop()

	// Nothing listens on port 1 in the fake: the local connection is
	// closed and the reason printed.
	addr, errw, stop := forward(1)
	defer stop()
	lc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	lc.SetDeadline(time.Now().Add(10 * time.Second))
	if b, _ := io.ReadAll(lc); len(b) != 0 {
		t.Fatalf("refused port sent %q", b)
	}
	lc.Close()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(errw.String(), "connection refused in sandbox") {
		if time.Now().After(deadline) {
			t.Fatalf("stderr = %q, want the refusal", errw.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A server that half-closes first: the local client reads its data and EOF,
// and what the client sends afterwards still reaches the server.
func TestPortForwardServerHalfClose(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv)
	c, err := opendsec.New(srv.Addr(), opendsec.WithToken(token))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	errw := &syncBuffer{}
	go func() { done <- forwardPort(ctx, c, ln, id, 2, errw) }()
	defer func() {
		cancel()
		<-done
	}()
	lc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close()
	lc.SetDeadline(time.Now().Add(20 * time.Second))
	got, err := io.ReadAll(lc) // ends at the server's half-close
	if err != nil || string(got) != "hello\n" {
		t.Fatalf("read %q (%v), want hello and EOF", got, err)
	}
	if _, err := io.WriteString(lc, "still here"); err != nil {
		t.Fatalf("write after the server's half-close: %v", err)
	}
	lc.(*net.TCPConn).CloseWrite()
	deadline := time.Now().Add(10 * time.Second)
	for string(srv.HalfClosedPortGot()) != "still here" {
		if time.Now().After(deadline) {
			t.Fatalf("server got %q after its half-close, want %q (port-forward said %q)", srv.HalfClosedPortGot(), "still here", errw.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestPortForwardBadInput(t *testing.T) {
	srv := opendsectest.New(t, token)
	id := createOne(t, srv)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{id, "0"}, `port: "0" is not a port in the sandbox`},
		{[]string{id, "70000"}, `port: "70000"`},
		{[]string{id, "http"}, `port: "http"`},
		{[]string{id, "x:8000"}, `local port: "x"`},
		{[]string{id, "65536:8000"}, `local port: "65536"`},
		{[]string{id, "8000", "--address", "0.0.0.0"}, `--address: "0.0.0.0" is not a loopback IP`},
		{[]string{id}, "takes ID and [LOCAL:]PORT"},
		{[]string{"n001nope", "8000"}, "not found"},
	} {
		r := run(t, srv, "", append([]string{"sandbox", "port-forward"}, tc.args...)...)
		if r.code != 1 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("port-forward %v: exit %d, stderr %q; want 1 and %q", tc.args, r.code, r.stderr, tc.want)
		}
	}
}

func TestParseForward(t *testing.T) {
	for spec, want := range map[string][2]uint32{"8000": {8000, 8000}, "9000:8000": {9000, 8000}, "0:22": {0, 22}, ":22": {0, 0}} {
		l, r, err := parseForward(spec)
		if spec == ":22" {
			// An empty local port is not a number.
			if err == nil {
				t.Errorf("%q: no error", spec)
			}
			continue
		}
		if err != nil || l != want[0] || r != want[1] {
			t.Errorf("%q = %d, %d, %v; want %v", spec, l, r, err, want)
		}
	}
}
