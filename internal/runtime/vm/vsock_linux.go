package vm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// vhostVsockPath is the host's vhost-vsock device.
const vhostVsockPath = "/dev/vhost-vsock"

// vhostVsock says whether this host can give VMs a vhost-vsock device
// (path opens read-write), and why.
func vhostVsock(path string) (bool, string) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	switch {
	case err == nil:
		_ = f.Close()
		return true, path + " opens"
	case errors.Is(err, os.ErrNotExist):
		return false, "no " + path + ": the vhost_vsock module is not loaded (modprobe vhost_vsock) or this host is itself a VM whose kernel has none"
	default:
		return false, "open " + path + ": " + err.Error()
	}
}

// vhostVsockSetGuestCID is VHOST_VSOCK_SET_GUEST_CID, _IOW(0xAF, 0x60, __u64).
const vhostVsockSetGuestCID = 0x4008af60

// cidTakenOnHost says whether another vhost-vsock device on the host (a
// VM of another node or program) has cid: setting it on a device of our
// own fails with EADDRINUSE then. The device is closed at once, so the
// CID is free again; QEMU sets it on its own device moments later.
func cidTakenOnHost(cid uint32) bool {
	f, err := os.OpenFile(vhostVsockPath, os.O_RDWR, 0)
	if err != nil {
		return false
	}
	defer func() { _ = f.Close() }()
	v := uint64(cid)
	_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), vhostVsockSetGuestCID, uintptr(unsafe.Pointer(&v)))
	return e == unix.EADDRINUSE
}

// dialVsock connects to port on guest cid over AF_VSOCK, within ctx.
func dialVsock(ctx context.Context, cid, port uint32) (net.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("vsock connect %s: %w: %w", vsockAddr{cid: cid, port: port}, errdefs.ErrCanceled, err)
	}
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("vsock socket: %w: %w", errdefs.ErrUnavailable, err)
	}
	addr := vsockAddr{cid: cid, port: port}
	err = unix.Connect(fd, &unix.SockaddrVM{CID: cid, Port: port})
	if err != nil && !errors.Is(err, unix.EINPROGRESS) {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("vsock connect %s: %w: %w", addr, errdefs.ErrUnavailable, err)
	}
	if err != nil {
		// In progress: poll in short slices, so ctx is looked at between them.
		if err := waitConnected(ctx, fd); err != nil {
			_ = unix.Close(fd)
			switch {
			case errors.Is(ctx.Err(), context.Canceled):
				return nil, fmt.Errorf("vsock connect %s: %w: %w", addr, errdefs.ErrCanceled, ctx.Err())
			case ctx.Err() != nil:
				return nil, fmt.Errorf("vsock connect %s: %w: %w", addr, errdefs.ErrDeadlineExceeded, ctx.Err())
			}
			return nil, fmt.Errorf("vsock connect %s: %w: %w", addr, errdefs.ErrUnavailable, err)
		}
	}
	// Non-blocking: os.NewFile registers it with Go's poller.
	return &vsockConn{f: os.NewFile(uintptr(fd), "vsock"), fd: fd, addr: addr}, nil
}

// waitConnected waits until a non-blocking connect on fd has ended: nil
// once the socket has a peer, else its error (or ctx's).
func waitConnected(ctx context.Context, fd int) error {
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		n, err := unix.Poll(pfd, 50)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return err
		}
		if n == 0 || err != nil {
			continue
		}
		soErr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			return err
		}
		if soErr != 0 {
			return unix.Errno(soErr)
		}
		if _, err := unix.Getpeername(fd); err == nil {
			return nil
		}
		// Ready without a peer and without an error: it was reset.
		return unix.ECONNRESET
	}
}

type vsockAddr struct{ cid, port uint32 }

func (a vsockAddr) Network() string { return "vsock" }
func (a vsockAddr) String() string  { return fmt.Sprintf("vsock:%d:%d", a.cid, a.port) }

// vsockConn is a connected AF_VSOCK stream socket (package net does not
// know the family): an os.File on a non-blocking fd, served by Go's poller.
type vsockConn struct {
	f    *os.File
	fd   int
	addr net.Addr
}

func (c *vsockConn) Read(p []byte) (int, error)         { return c.f.Read(p) }
func (c *vsockConn) Write(p []byte) (int, error)        { return c.f.Write(p) }
func (c *vsockConn) Close() error                       { return c.f.Close() }
func (c *vsockConn) LocalAddr() net.Addr                { return c.addr }
func (c *vsockConn) RemoteAddr() net.Addr               { return c.addr }
func (c *vsockConn) SetDeadline(t time.Time) error      { return c.f.SetDeadline(t) }
func (c *vsockConn) SetReadDeadline(t time.Time) error  { return c.f.SetReadDeadline(t) }
func (c *vsockConn) SetWriteDeadline(t time.Time) error { return c.f.SetWriteDeadline(t) }

// CloseWrite half-closes the connection.
func (c *vsockConn) CloseWrite() error { return unix.Shutdown(c.fd, unix.SHUT_WR) }
