package vmchan

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// chardev stands in for QEMU's `-chardev socket,server=on`: the host dials
// the unix socket, and the guest's "port" is the accepted end. While no host
// is connected the guest's open blocks (a real port reads EOF; the listener
// reopens either way).
func chardev(t *testing.T) (path string, open func() (io.ReadWriteCloser, error)) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return path, func() (io.ReadWriteCloser, error) { return ln.Accept() }
}

func serveHTTP(t *testing.T, l net.Listener) {
	t.Helper()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = fmt.Fprintf(w, "hello %s", r.URL.Path)
	}), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
}

func httpClient(c *Client) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return c.Open(ctx) },
	}, Timeout: 20 * time.Second}
}

func get(t *testing.T, hc *http.Client, p string) {
	t.Helper()
	resp, err := hc.Get("http://agent" + p)
	if err != nil {
		t.Fatalf("GET %s: %v", p, err)
	}
	b, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if string(b) != "hello "+p {
		t.Fatalf("GET %s = %q", p, b)
	}
}

func TestFiftyConcurrentStreams(t *testing.T) {
	ctx := context.Background()
	path, open := chardev(t)
	l := listenOn(ctx, path, open)
	t.Cleanup(func() { _ = l.Close() })
	serveHTTP(t, l)
	c, err := Dial(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	hc := httpClient(c)
	tr := hc.Transport.(*http.Transport)
	tr.MaxConnsPerHost, tr.MaxIdleConnsPerHost = 50, 50
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			get(t, hc, fmt.Sprintf("/s%d", i))
		}()
	}
	close(start)
	wg.Wait()
}

func TestReconnectAfterHostGoesAway(t *testing.T) {
	ctx := context.Background()
	path, open := chardev(t)
	l := listenOn(ctx, path, open)
	t.Cleanup(func() { _ = l.Close() })
	serveHTTP(t, l)
	for round := range 3 {
		c, err := Dial(ctx, path)
		if err != nil {
			t.Fatal(err)
		}
		hc := httpClient(c)
		get(t, hc, fmt.Sprintf("/round%d", round))
		// The host drops the connection (QEMU's chardev disconnects; the
		// guest's port reads EOF); the next host gets a new session.
		hc.CloseIdleConnections()
		_ = c.Close()
	}
	// One Client survives its session breaking: Open redials.
	c, err := Dial(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	get(t, httpClient(c), "/before")
	c.mu.Lock()
	_ = c.sess.Close()
	c.mu.Unlock()
	get(t, httpClient(c), "/after")
}

func TestBadInput(t *testing.T) {
	if _, err := Listen(context.Background(), ""); err == nil {
		t.Fatal("Listen with no path: no error")
	}
	if _, err := Dial(context.Background(), ""); err == nil {
		t.Fatal("Dial with no path: no error")
	}
	if _, err := Dial(context.Background(), filepath.Join(t.TempDir(), "none")); err == nil {
		t.Fatal("Dial of a missing socket: no error")
	}
}

// persistentPort stands in for a virtio-serial port whose guest never
// reads an end of file: every host connection to the returned socket path
// feeds the same guest port (as QEMU's chardev does when the guest did not
// look while one host left and the next came: a pause, a restore).
func persistentPort(t *testing.T) (path string, open func() (io.ReadWriteCloser, error)) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	guest, host := net.Pipe()
	t.Cleanup(func() { _ = guest.Close(); _ = host.Close() })
	var mu sync.Mutex
	var cur net.Conn
	go func() { // guest -> the current host connection
		buf := make([]byte, 32<<10)
		for {
			n, err := host.Read(buf)
			if err != nil {
				return
			}
			mu.Lock()
			if cur != nil {
				_, _ = cur.Write(buf[:n])
			}
			mu.Unlock()
		}
	}()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			cur = c
			mu.Unlock()
			// One client at a time, as QEMU's chardev; no end of file
			// for the guest when it leaves.
			_, _ = io.Copy(host, c)
		}
	}()
	opened := false
	return path, func() (io.ReadWriteCloser, error) {
		if opened {
			select {} // the port never ends here
		}
		opened = true
		return guest, nil
	}
}

// TestNewHostSessionWithoutEOF: a host that goes away while the guest
// serves streams, and a new host on the same port (no end of file for the
// guest): the guest starts a new session at the new host's first stream,
// so the new host's requests work, however many the old one made.
func TestNewHostSessionWithoutEOF(t *testing.T) {
	ctx := context.Background()
	path, open := persistentPort(t)
	l := listenOn(ctx, path, open)
	t.Cleanup(func() { _ = l.Close() })
	serveHTTP(t, l)
	for round := range 3 {
		c, err := Dial(ctx, path)
		if err != nil {
			t.Fatal(err)
		}
		hc := httpClient(c)
		for i := range 5 + 10*round {
			get(t, hc, fmt.Sprintf("/round%d/%d", round, i))
		}
		// One stream left open in the guest's session when the host goes.
		open, err := c.Open(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = open.Write([]byte("GET /half"))
		hc.CloseIdleConnections()
		_ = c.Close()
	}
}
