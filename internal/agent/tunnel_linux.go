package agent

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// defaultTunnelIdle bounds how long a tunnel waits for bytes in one
// direction after the other direction ended cleanly (a half-close): a
// server that never closes after EOF, or a caller that vanished, frees the
// tunnel's two connections and goroutines after this long without bytes.
const defaultTunnelIdle = 60 * time.Second

// tunnelBufSize is the copy buffer of one tunnel direction.
const tunnelBufSize = 32 << 10

// splice copies both ways until both directions are done, half-closing
// each side's write direction when the other side's reads end cleanly. An
// error in either direction (the caller dropped the connection, the server
// reset it) closes both connections at once; after a clean half-close the
// remaining direction ends after idle without bytes.
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
	run := func(d, other *tunnelDir) {
		defer wg.Done()
		if err := d.copy(); err != nil {
			abort()
			return
		}
		closeWrite(d.dst)
		other.bound()
	}
	go run(toUp, toClient)
	go run(toClient, toUp)
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
		cw.CloseWrite()
		return
	}
	c.Close()
}
