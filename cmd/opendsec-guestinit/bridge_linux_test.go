package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestFindPortByName(t *testing.T) {
	sys, dev := t.TempDir(), t.TempDir()
	for port, name := range map[string]string{"vport0p1": "other", "vport1p1": "agent"} {
		if err := os.MkdirAll(filepath.Join(sys, port), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(sys, port, "name"), []byte(name+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dev, port), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := findPort(ctx, sys, dev, "agent")
	if err != nil || got != filepath.Join(dev, "vport1p1") {
		t.Fatalf("findPort = %q, %v; want %s", got, err, filepath.Join(dev, "vport1p1"))
	}
	short, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	if _, err := findPort(short, sys, dev, "missing"); err == nil {
		t.Fatal("findPort of a missing port: no error")
	}
}

// TestProxyDispatchesIdentity: a stream whose first request is POST
// /opendsec/identity is answered by the init (a bad body: 400, and the
// agent never sees it); any other stream goes to the agent byte for byte.
func TestProxyDispatchesIdentity(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	seen := make(chan string, 4)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				seen <- req.Method + " " + req.URL.Path
				_, _ = io.WriteString(c, "HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
			}()
		}
	}()
	do := func(method, path, body string) int {
		t.Helper()
		host, guest := net.Pipe()
		go proxy(guest, sock)
		defer func() { _ = host.Close() }()
		req, _ := http.NewRequest(method, "http://agent"+path, strings.NewReader(body))
		if err := req.Write(host); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(host), req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	if code := do(http.MethodPost, "/opendsec/identity", "{broken"); code != http.StatusBadRequest {
		t.Fatalf("identity with a broken body: %d, want 400", code)
	}
	if code := do(http.MethodGet, "/health", ""); code != http.StatusNoContent {
		t.Fatalf("GET /health through the proxy: %d, want the agent's 204", code)
	}
	if got := <-seen; got != "GET /health" {
		t.Fatalf("the agent saw %q first, want GET /health (the identity request is the init's)", got)
	}
}

// The vsock connection adapter carries a stream both ways and passes a
// half close on (on a unix socketpair: this host has no vsock transport
// to connect through).
func TestFDConn(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, b := newFDConn(fds[0], vsockAddr(1024)), newFDConn(fds[1], vsockAddr(1024))
	defer a.Close()
	defer b.Close()
	if _, err := a.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if err := a.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(b)
	if err != nil || string(got) != "ping" {
		t.Fatalf("read %q %v", got, err)
	}
	if err := b.SetReadDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("deadline: %v", err)
	}
	if a.LocalAddr().String() != "vsock:1024" {
		t.Fatal(a.LocalAddr())
	}
}

// listenVsock binds the agent's port; a second bind of it fails, and
// Close makes Accept return net.ErrClosed.
func TestListenVsock(t *testing.T) {
	l, err := listenVsock(52000 + uint32(os.Getpid()%1000))
	if err != nil {
		t.Skipf("no AF_VSOCK on this host: %v", err)
	}
	if _, err := listenVsock(l.port); err == nil {
		t.Fatal("second bind of the port succeeded")
	}
	done := make(chan error, 1)
	go func() { _, err := l.Accept(); done <- err }()
	_ = l.Close()
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("accept after close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("accept did not return after Close")
	}
}

// TestSetBalloon binds and unbinds the balloon device found by its virtio
// device ID in a sysfs-shaped tree; a tree without one is os.ErrNotExist.
func TestSetBalloon(t *testing.T) {
	sys := t.TempDir()
	for name, id := range map[string]string{"virtio0": "0x0003", "virtio3": "0x0005"} {
		if err := os.MkdirAll(filepath.Join(sys, "devices", name), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(sys, "devices", name, "device"), []byte(id+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	drv := filepath.Join(sys, "drivers", "virtio_balloon")
	if err := os.MkdirAll(drv, 0o755); err != nil {
		t.Fatal(err)
	}
	// Bound: the driver's directory links the device.
	if err := os.Symlink("../../devices/virtio3", filepath.Join(drv, "virtio3")); err != nil {
		t.Fatal(err)
	}
	if err := setBalloon(sys, true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(drv, "bind")); err == nil {
		t.Fatal("bind written for a bound device")
	}
	if err := setBalloon(sys, false); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(drv, "unbind")); err != nil || string(b) != "virtio3" {
		t.Fatalf("unbind got %q, %v; want virtio3", b, err)
	}
	_ = os.Remove(filepath.Join(drv, "virtio3"))
	if err := setBalloon(sys, true); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(drv, "bind")); err != nil || string(b) != "virtio3" {
		t.Fatalf("bind got %q, %v; want virtio3", b, err)
	}
	if err := setBalloon(t.TempDir(), false); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("no device: %v, want os.ErrNotExist", err)
	}
}
