package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// agentVsockPort is the guest port the microvm backend reaches the agent
// on through Firecracker's vsock (the host writes "CONNECT 1024").
const agentVsockPort = 1024

// vsockListener accepts AF_VSOCK stream connections on one port. Every
// connection is one agent connection: no multiplexing is needed, unlike
// the virtio-serial port.
type vsockListener struct {
	fd   int
	port uint32
	once sync.Once
}

// listenVsock listens on port for any host (VMADDR_CID_ANY).
func listenVsock(port uint32) (*vsockListener, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("vsock socket (is vmw_vsock_virtio_transport loaded?): %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: port}); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("vsock bind port %d: %w", port, err)
	}
	if err := unix.Listen(fd, 64); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("vsock listen port %d: %w", port, err)
	}
	return &vsockListener{fd: fd, port: port}, nil
}

func (l *vsockListener) Accept() (net.Conn, error) {
	for {
		nfd, _, err := unix.Accept4(l.fd, unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
		if err == unix.EINTR || err == unix.ECONNABORTED {
			continue
		}
		if err != nil {
			if err == unix.EBADF || err == unix.EINVAL {
				return nil, net.ErrClosed
			}
			return nil, fmt.Errorf("vsock accept: %w", err)
		}
		return newFDConn(nfd, l.Addr()), nil
	}
}

// Close stops Accept (shutdown wakes a blocked accept(2)).
func (l *vsockListener) Close() error {
	l.once.Do(func() {
		_ = unix.Shutdown(l.fd, unix.SHUT_RDWR)
		_ = unix.Close(l.fd)
	})
	return nil
}

func (l *vsockListener) Addr() net.Addr { return vsockAddr(l.port) }

type vsockAddr uint32

func (a vsockAddr) Network() string { return "vsock" }
func (a vsockAddr) String() string  { return fmt.Sprintf("vsock:%d", uint32(a)) }

// fdConn is a connected stream socket of a family package net does not
// know, as a net.Conn: an os.File on a non-blocking fd (Go's poller serves
// its reads, writes and deadlines).
type fdConn struct {
	f    *os.File
	fd   int
	addr net.Addr
}

func newFDConn(fd int, addr net.Addr) *fdConn {
	return &fdConn{f: os.NewFile(uintptr(fd), "vsock"), fd: fd, addr: addr}
}

func (c *fdConn) Read(p []byte) (int, error)         { return c.f.Read(p) }
func (c *fdConn) Write(p []byte) (int, error)        { return c.f.Write(p) }
func (c *fdConn) Close() error                       { return c.f.Close() }
func (c *fdConn) LocalAddr() net.Addr                { return c.addr }
func (c *fdConn) RemoteAddr() net.Addr               { return c.addr }
func (c *fdConn) SetDeadline(t time.Time) error      { return c.f.SetDeadline(t) }
func (c *fdConn) SetReadDeadline(t time.Time) error  { return c.f.SetReadDeadline(t) }
func (c *fdConn) SetWriteDeadline(t time.Time) error { return c.f.SetWriteDeadline(t) }

// CloseWrite half-closes the connection (the proxy passes an end on).
func (c *fdConn) CloseWrite() error { return unix.Shutdown(c.fd, unix.SHUT_WR) }

// serveAgentVsock waits until the agent answers on sock, then bridges
// every vsock connection on agentVsockPort to it and prints the ready line.
func serveAgentVsock(ctx context.Context, sock string) error {
	hctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := waitHealthy(hctx, sock); err != nil {
		return err
	}
	l, err := listenVsock(agentVsockPort)
	if err != nil {
		return err
	}
	logf("agent ready (vsock)")
	return bridge(l, sock)
}
