// Package vmchan carries many agent connections over one VM serial port.
//
// A virtio-serial port is a single byte stream, and the agent speaks HTTP
// with many concurrent connections, so a yamux session runs on the port: the
// guest is the yamux server (Listen), the host the client (Dial, Open). See
// docs/vm-guest.md.
package vmchan

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// Backoff between attempts to open the port (or the host socket) again.
const (
	minRetry = 20 * time.Millisecond
	maxRetry = 500 * time.Millisecond
)

func yamuxConfig() *yamux.Config {
	c := yamux.DefaultConfig()
	c.LogOutput = io.Discard
	c.KeepAliveInterval = 5 * time.Second
	c.ConnectionWriteTimeout = 10 * time.Second
	return c
}

// listener is the guest side: it opens the port, serves one yamux session on
// it until the session breaks (the host went away: reads return EOF), and
// opens it again.
type listener struct {
	ctx    context.Context
	cancel context.CancelFunc
	conns  chan net.Conn
	addr   addr
	done   chan struct{}
}

type addr string

func (a addr) Network() string { return "vmchan" }
func (a addr) String() string  { return string(a) }

// Listen serves yamux sessions on the virtio-serial port devPath (e.g.
// /dev/virtio-ports/agent) and returns their streams as connections. It
// survives the host disconnecting and reconnecting: each host connection
// gets a new session. Close (or ctx) stops it.
func Listen(ctx context.Context, devPath string) (net.Listener, error) {
	if devPath == "" {
		return nil, fmt.Errorf("vmchan listen: %w: devPath is empty; give the virtio-serial port, e.g. /dev/virtio-ports/agent", errdefs.ErrInvalidArgument)
	}
	return listenOn(ctx, devPath, func() (io.ReadWriteCloser, error) { return openPort(devPath) }), nil
}

// listenOn is Listen over any way of opening the port (tests use a socket).
func listenOn(ctx context.Context, name string, open func() (io.ReadWriteCloser, error)) *listener {
	ctx, cancel := context.WithCancel(ctx)
	l := &listener{ctx: ctx, cancel: cancel, conns: make(chan net.Conn), addr: addr(name), done: make(chan struct{})}
	go l.loop(open)
	return l
}

func (l *listener) loop(open func() (io.ReadWriteCloser, error)) {
	defer close(l.done)
	wait := minRetry
	for l.ctx.Err() == nil {
		rw, err := open()
		if err != nil {
			if !l.pause(wait) {
				return
			}
			wait = min(2*wait, maxRetry)
			continue
		}
		start := time.Now()
		l.serve(rw)
		if time.Since(start) > time.Second {
			wait = minRetry
		}
		// The port reads EOF at once while no host is connected: back off.
		if !l.pause(wait) {
			return
		}
		wait = min(2*wait, maxRetry)
	}
}

func (l *listener) pause(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-l.ctx.Done():
		return false
	}
}

// serve runs sessions on the port rw, one per host session
// (portSplitter), until the port ends or the listener closes.
func (l *listener) serve(rw io.ReadWriteCloser) {
	defer func() { _ = rw.Close() }()
	p := &portSplitter{rw: rw}
	for l.ctx.Err() == nil {
		if !l.serveSession(p.next()) {
			return
		}
	}
}

// serveSession runs one yamux session on conn until it breaks; it says
// whether the port is still good for the next one.
func (l *listener) serveSession(conn *session) bool {
	s, err := yamux.Server(conn, yamuxConfig())
	if err != nil {
		return false
	}
	stop := context.AfterFunc(l.ctx, func() { _ = s.Close() })
	defer stop()
	defer func() { _ = s.Close() }()
	for {
		c, err := s.Accept()
		if err != nil {
			conn.p.mu.Lock()
			split := conn.gen != conn.p.gen
			conn.p.mu.Unlock()
			return split
		}
		select {
		case l.conns <- c:
		case <-l.ctx.Done():
			_ = c.Close()
			return false
		}
	}
}

func (l *listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.ctx.Done():
		return nil, net.ErrClosed
	}
}

// Close stops the listener; it does not wait for an open of the port in
// progress (the loop ends when that open returns).
func (l *listener) Close() error {
	l.cancel()
	return nil
}

func (l *listener) Addr() net.Addr { return l.addr }

// Client is the host side: one yamux session on QEMU's chardev unix socket,
// redialled when it breaks.
type Client struct {
	path string
	mu   sync.Mutex
	sess *yamux.Session
}

// Dial connects to the guest's agent port through QEMU's chardev socket.
func Dial(ctx context.Context, unixSocketPath string) (*Client, error) {
	if unixSocketPath == "" {
		return nil, fmt.Errorf("vmchan dial: %w: the socket path is empty; give the chardev socket's path", errdefs.ErrInvalidArgument)
	}
	c := &Client{path: unixSocketPath}
	if _, err := c.session(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Client) session(ctx context.Context) (*yamux.Session, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sess != nil && !c.sess.IsClosed() {
		return c.sess, nil
	}
	conn, err := DialUnix(ctx, c.path)
	if err != nil {
		return nil, fmt.Errorf("vmchan dial %s: %w: %w", c.path, errdefs.ErrUnavailable, err)
	}
	if conn, err = hello(ctx, conn); err != nil {
		return nil, fmt.Errorf("vmchan dial %s: %w: %w", c.path, errdefs.ErrUnavailable, err)
	}
	s, err := yamux.Client(conn, yamuxConfig())
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("vmchan session: %w", err)
	}
	c.sess = s
	return s, nil
}

// Open opens one stream to the guest's agent, redialling once when the
// session broke (the VM restarted, was restored, or the guest's end reset).
func (c *Client) Open(ctx context.Context) (net.Conn, error) {
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("vmchan open: %w", err)
		}
		s, err := c.session(ctx)
		if err != nil {
			return nil, err
		}
		st, err := s.OpenStream()
		if err == nil {
			return st, nil
		}
		_ = s.Close()
		if attempt > 0 || !errors.Is(err, yamux.ErrSessionShutdown) && !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("vmchan open: %w: %w", errdefs.ErrUnavailable, err)
		}
	}
}

// hello begins a host session on conn: it writes a hello (a ping with the
// flags flagHello and a random value) and returns conn read through a
// filter that skips what the guest sends until the answer to the hello
// (an ACK ping of the same value): anything before it is the end of an old
// session's output (split.go). The skip happens in the reader (yamux's
// receive loop), so a guest not up yet blocks nothing but that loop, as
// before the hello. A guest older than the hello answers it through
// yamux, with a plain ACK.
func hello(ctx context.Context, conn net.Conn) (net.Conn, error) {
	var b [4]byte
	_, _ = rand.Read(b[:])
	v := binary.BigEndian.Uint32(b[:]) | 1<<31 // never a small yamux ping ID
	if d, ok := ctx.Deadline(); ok {
		_ = conn.SetWriteDeadline(d)
	}
	if _, err := conn.Write(frame(typePing, flagHello, 0, v)); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("the hello: %w", err)
	}
	_ = conn.SetWriteDeadline(time.Time{})
	return &helloConn{Conn: conn, r: bufio.NewReaderSize(conn, 32<<10), value: v}, nil
}

// helloConn is a host session's connection, read after the answer to its
// hello. One goroutine reads it (yamux's receive loop).
type helloConn struct {
	net.Conn
	r        *bufio.Reader
	value    uint32
	answered bool
}

func (c *helloConn) Read(b []byte) (int, error) {
	if !c.answered {
		if err := c.skip(); err != nil {
			return 0, err
		}
		c.answered = true
	}
	return c.r.Read(b)
}

// skip reads frames up to and including the answer to the hello.
func (c *helloConn) skip() error {
	h := make([]byte, hdrLen)
	for skipped := 0; ; skipped++ {
		if _, err := io.ReadFull(c.r, h); err != nil {
			return fmt.Errorf("vmchan: the guest's answer to the hello (after %d other frames): %w", skipped, err)
		}
		if h[0] != 0 {
			return fmt.Errorf("vmchan: the guest's answer to the hello: not a yamux frame (version %d)", h[0])
		}
		length := binary.BigEndian.Uint32(h[8:12])
		if h[1] == typePing && binary.BigEndian.Uint16(h[2:4])&flagACK != 0 && length == c.value {
			return nil
		}
		if h[1] == typeData {
			if _, err := io.CopyN(io.Discard, c.r, int64(length)); err != nil {
				return fmt.Errorf("vmchan: the guest's answer to the hello: %w", err)
			}
		}
	}
}

// Close ends the session; a later Open dials again.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sess != nil {
		return c.sess.Close()
	}
	return nil
}

// IdentityPath is the guest init's route on the agent port that gives a VM
// restored from a snapshot its own identity (docs/vm-guest.md). The guest
// init answers it itself, before the agent, on a connection whose first
// request it is.
const IdentityPath = "/opendsec/identity"

// Identity is the body of POST IdentityPath. Empty fields are left as they
// are; the guest answers 204 once everything given is applied.
type Identity struct {
	Hostname string `json:"hostname,omitempty"`
	// MAC, Addr (with prefix) and Gateway are eth0's configuration.
	MAC     string `json:"mac,omitempty"`
	Addr    string `json:"ip,omitempty"`
	Gateway string `json:"gateway,omitempty"`
	// Entropy (32+ bytes) is mixed into the guest's RNG, which is then
	// reseeded (RNDADDENTROPY + RNDRESEEDCRNG).
	Entropy []byte `json:"entropy,omitempty"`
	// TimeNS is the host's CLOCK_REALTIME in nanoseconds; the guest steps
	// its clock to it.
	TimeNS int64 `json:"time_ns,omitempty"`
}

// BalloonPath is the guest init's route that binds or unbinds the guest's
// virtio_balloon driver, and with it free page reporting (docs/vm-guest.md).
// The vm backend unbinds it before a snapshot: a restore maps the snapshot's
// RAM file private, and QEMU (7.2) discards a reported page of a file-backed
// RAM block by punching a hole in the file, which would take the page from
// the snapshot and from every other restore of it.
const BalloonPath = "/opendsec/balloon"

// Balloon is the body of POST BalloonPath; the guest answers 204 once the
// driver is bound (FreePageReporting) or unbound, and 404 when the guest
// has no balloon device.
type Balloon struct {
	FreePageReporting bool `json:"free_page_reporting"`
}

// GuestConfig is the guest's configuration disk (JSON, NUL-padded): what
// does not fit on the kernel command line.
type GuestConfig struct {
	Env         []string `json:"env,omitempty"`
	User        string   `json:"user,omitempty"`
	Workdir     string   `json:"workdir,omitempty"`
	Nameservers []string `json:"nameservers,omitempty"`
}
