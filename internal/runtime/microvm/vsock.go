package microvm

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// DialVsock connects to port on the guest through Firecracker's vsock
// unix socket udsPath: the host writes "CONNECT <port>\n" and Firecracker
// answers "OK <host port>\n" once the guest accepted. The returned
// connection carries the guest's stream from there.
func DialVsock(ctx context.Context, udsPath string, port uint32) (net.Conn, error) {
	c, err := vmchan.DialUnix(ctx, udsPath)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrUnavailable, "vsock socket %s: %w", udsPath, err)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.Close() })
	defer stop()
	if _, err := fmt.Fprintf(c, "CONNECT %d\n", port); err != nil {
		_ = c.Close()
		return nil, errdefs.New(errdefs.ErrUnavailable, "vsock connect to port %d: %w", port, err)
	}
	br := bufio.NewReaderSize(c, 64)
	line, err := br.ReadString('\n')
	if err != nil {
		_ = c.Close()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("vsock connect to port %d: %w", port, ctx.Err())
		}
		return nil, errdefs.New(errdefs.ErrUnavailable, "vsock connect to port %d: no answer from the guest (%w)", port, err)
	}
	if !strings.HasPrefix(line, "OK ") {
		_ = c.Close()
		return nil, errdefs.New(errdefs.ErrUnavailable, "vsock connect to port %d: firecracker answered %q", port, strings.TrimSpace(line))
	}
	if br.Buffered() > 0 {
		return &bufConn{Conn: c, r: br}, nil
	}
	return c, nil
}

// bufConn is a conn whose first bytes were read past the handshake line.
type bufConn struct {
	net.Conn
	r *bufio.Reader
}

func (b *bufConn) Read(p []byte) (int, error) { return b.r.Read(p) }
