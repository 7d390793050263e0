package agent

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// defaultTunnelIdle bounds how long a tunnel waits for the caller after
// the sandbox side ended cleanly (a half-close): a caller that vanished, or
// never closes, frees the tunnel's two connections and goroutines after
// this long without bytes from it.
const defaultTunnelIdle = 60 * time.Second

// tunnelBufSize is the copy buffer of one tunnel direction.
const tunnelBufSize = 32 << 10

// splice copies both ways until both directions are done, half-closing
// each side's write direction when the other side's reads end cleanly. An
// error in either direction (the caller dropped the connection, the server
// reset it) closes both connections at once.
//
// Only the caller's silence is bounded, and only after the sandbox side's
// EOF: after the caller's half-close (a request sent nc -N style) the
// server may compute for as long as it likes before answering; the
// connection is the sandbox's own resource, and a caller gone meanwhile
// shows as a failed write when the server answers, or ends with the
// server's close.
func splice(client net.Conn, up net.Conn, clientR io.Reader, idle time.Duration) {
	var closeOnce sync.Once
	abort := func() {
		closeOnce.Do(func() {
			client.Close()
			up.Close()
		})
	}
	defer abort()

	toUp := &tunnelDir{dst: up, src: clientR, srcConn: client, idle: idle}
	toClient := &tunnelDir{dst: client, src: up, srcConn: up, idle: idle}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		if err := toUp.copy(); err != nil {
			abort()
			return
		}
		closeWrite(up)
	}()
	go func() {
		defer wg.Done()
		if err := toClient.copy(); err != nil {
			abort()
			return
		}
		closeWrite(client)
		toUp.bound()
	}()
	wg.Wait()
}

// tunnelDir is one direction of a tunnel.
type tunnelDir struct {
	dst     net.Conn
	src     io.Reader
	srcConn net.Conn // whose read deadline bounds src
	idle    time.Duration
	bounded atomic.Bool
}

// bound makes reads in this direction fail after d.idle without bytes.
func (d *tunnelDir) bound() {
	d.bounded.Store(true)
	_ = d.srcConn.SetReadDeadline(time.Now().Add(d.idle))
}

// copy copies until src's clean EOF (nil) or any error.
func (d *tunnelDir) copy() error {
	buf := make([]byte, tunnelBufSize)
	for {
		n, err := d.src.Read(buf)
		if n > 0 {
			if d.bounded.Load() {
				_ = d.srcConn.SetReadDeadline(time.Now().Add(d.idle))
			}
			if _, werr := d.dst.Write(buf[:n]); werr != nil {
				return werr
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite() // the peer may have closed already
		return
	}
	c.Close()
}
