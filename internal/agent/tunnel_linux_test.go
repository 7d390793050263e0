package agent

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"
)

// openTunnel opens the agent's tunnel to port on 127.0.0.1.
func openTunnel(t *testing.T, e *env, port int) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("unix", e.sock)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "GET /_opendsec/port/%d HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n", port)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		c.Close()
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		c.Close()
		t.Fatalf("tunnel: %s", resp.Status)
	}
	return c, br
}

// serveLoopback runs fn for every connection to a fresh loopback port.
func serveLoopback(t *testing.T, fn func(net.Conn)) int {
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
	return ln.Addr().(*net.TCPAddr).Port
}

// Callers that drop their connection to a server that stays silent past
// the idle bound (it may compute for long: the connection is the
// sandbox's) leave nothing behind once the server answers: its writes
// fail.
func TestTunnelDroppedCallerSilentServer(t *testing.T) {
	e := newEnv(t, Config{})
	e.agent.tunnelIdle = 100 * time.Millisecond
	answer := make(chan struct{})
	var sawEOF, ended atomic.Int64
	port := serveLoopback(t, func(c net.Conn) {
		defer c.Close()
		io.Copy(io.Discard, c)
		sawEOF.Add(1)
		<-answer
		for {
			if _, err := c.Write([]byte("answer\n")); err != nil {
				ended.Add(1)
				return
			}
			time.Sleep(10 * time.Millisecond) // pacing, not synchronisation
		}
	})
	const n = 20
	for range n {
		c, _ := openTunnel(t, e, port)
		c.Write([]byte("x"))
		c.Close()
	}
	eventually(t, 5*time.Second, "the server to read EOF on every tunnel", func() bool { return sawEOF.Load() == n })
	close(answer)
	eventually(t, 5*time.Second, "the server's writes to fail on every dropped tunnel", func() bool { return ended.Load() == n })
	eventually(t, 5*time.Second, "the dropped tunnels to end", func() bool { return e.agent.tunnels.Load() == 0 })
}

// A caller that sends its request and half-closes gets the answer of a
// server that computes for longer than the idle bound first.
func TestTunnelHalfClosedCallerWaitsForSlowServer(t *testing.T) {
	e := newEnv(t, Config{})
	e.agent.tunnelIdle = 100 * time.Millisecond
	port := serveLoopback(t, func(c net.Conn) {
		defer c.Close()
		req, _ := io.ReadAll(c)            // until the caller half-closes
		time.Sleep(500 * time.Millisecond) // computing: 5 idle bounds
		fmt.Fprintf(c, "answer to %s", req)
	})
	c, br := openTunnel(t, e, port)
	defer c.Close()
	c.Write([]byte("question"))
	c.(*net.UnixConn).CloseWrite()
	got, err := io.ReadAll(br)
	if want := "answer to question"; err != nil || string(got) != want {
		t.Fatalf("got %q, %v; want %q", got, err, want)
	}
}

// After the server's half-close the caller's silence is bounded: a caller
// that never sends nor closes frees the tunnel after the idle bound, while
// the server keeps its side open.
func TestTunnelSilentCallerAfterServerEOF(t *testing.T) {
	e := newEnv(t, Config{})
	e.agent.tunnelIdle = 200 * time.Millisecond
	var serverDone atomic.Int64
	port := serveLoopback(t, func(c net.Conn) {
		defer c.Close()
		c.Write([]byte("bye"))
		c.(*net.TCPConn).CloseWrite()
		io.Copy(io.Discard, c) // ends when the tunnel closes the connection
		serverDone.Add(1)
	})
	c, br := openTunnel(t, e, port)
	defer c.Close()
	if got, err := io.ReadAll(br); err != nil || string(got) != "bye" {
		t.Fatalf("got %q, %v; want bye then EOF", got, err)
	}
	eventually(t, 5*time.Second, "the tunnel of a silent caller to end", func() bool { return e.agent.tunnels.Load() == 0 })
	eventually(t, 5*time.Second, "the server to see the tunnel closed", func() bool { return serverDone.Load() == 1 })
}

// A server that keeps writing notices a dropped caller at once: its writes
// fail, with no idle bound involved.
func TestTunnelDroppedCallerChattyServer(t *testing.T) {
	e := newEnv(t, Config{})
	var ended atomic.Int64
	port := serveLoopback(t, func(c net.Conn) {
		defer c.Close()
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for range tick.C {
			if _, err := c.Write([]byte("tick\n")); err != nil {
				ended.Add(1)
				return
			}
		}
	})
	const n = 10
	for range n {
		c, br := openTunnel(t, e, port)
		if line, err := br.ReadString('\n'); err != nil || line != "tick\n" {
			t.Fatalf("first line = %q, %v", line, err)
		}
		c.Close()
	}
	eventually(t, 5*time.Second, "the server's writes to fail on every dropped tunnel", func() bool { return ended.Load() == n })
	eventually(t, 5*time.Second, "the dropped tunnels to end", func() bool { return e.agent.tunnels.Load() == 0 })
}

// The idle bound only cuts silence: a half-closed tunnel whose server keeps
// sending lives past it and delivers everything.
func TestTunnelIdleBoundResetsOnBytes(t *testing.T) {
	e := newEnv(t, Config{})
	e.agent.tunnelIdle = 300 * time.Millisecond
	port := serveLoopback(t, func(c net.Conn) {
		defer c.Close()
		io.Copy(io.Discard, c) // until the caller half-closes
		for i := range 10 {
			fmt.Fprintf(c, "%d,", i)
			time.Sleep(100 * time.Millisecond) // pacing: 1 s in all, 0.1 s gaps
		}
	})
	c, br := openTunnel(t, e, port)
	defer c.Close()
	c.(*net.UnixConn).CloseWrite()
	got, err := io.ReadAll(br)
	if want := "0,1,2,3,4,5,6,7,8,9,"; err != nil || string(got) != want {
		t.Fatalf("got %q, %v; want %q", got, err, want)
	}
}
