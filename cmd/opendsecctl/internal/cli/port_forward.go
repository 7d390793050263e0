package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

func (a *app) portForwardCommand() *cobra.Command {
	var address string
	cmd := &cobra.Command{
		Use:   "port-forward ID [LOCAL:]PORT",
		Short: "Forward a local TCP port to a port inside a sandbox",
		Long: `Listen on 127.0.0.1:LOCAL (default: the same number as PORT; 0 picks a free
port) and forward every connection to PORT inside the sandbox, through the
apiserver and the sandbox's node. Runs until interrupted (Ctrl-C).`,
		Example: `  opendsecctl sandbox port-forward n001sb0001 8000
  opendsecctl sandbox port-forward n001sb0001 9000:8000
  opendsecctl sandbox port-forward n001sb0001 0:8000   # a free local port`,
		Args: exactArgs(2, "ID and [LOCAL:]PORT"),
		RunE: func(cmd *cobra.Command, args []string) error {
			local, remote, err := parseForward(args[1])
			if err != nil {
				return err
			}
			if ip := net.ParseIP(address); ip == nil || !ip.IsLoopback() {
				return usagef("--address: %q is not a loopback IP; use 127.0.0.1 or ::1", address)
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			// An unknown sandbox fails here rather than on the first connection.
			if _, err := c.GetSandbox(cmd.Context(), args[0]); err != nil {
				return err
			}
			ln, err := net.Listen("tcp", net.JoinHostPort(address, strconv.Itoa(int(local))))
			if err != nil {
				return fmt.Errorf("listen on %s port %d: %w", address, local, err)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			fmt.Fprintf(a.stdout, "Forwarding from %s -> %s:%d\n", ln.Addr(), args[0], remote)
			return forwardPort(ctx, c, ln, args[0], remote, a.stderr)
		},
	}
	cmd.Flags().StringVar(&address, "address", "127.0.0.1", "loopback address to listen on")
	return cmd
}

// parseForward parses "[LOCAL:]PORT".
func parseForward(spec string) (local, remote uint32, err error) {
	l, r, hasLocal := strings.Cut(spec, ":")
	if !hasLocal {
		r = spec
	}
	parse := func(s string, allowZero bool) (uint32, bool) {
		n, err := strconv.ParseUint(s, 10, 32)
		if err != nil || n > 65535 || (n == 0 && !allowZero) {
			return 0, false
		}
		return uint32(n), true
	}
	remote, ok := parse(r, false)
	if !ok {
		return 0, 0, usagef("port: %q is not a port in the sandbox; use [LOCAL:]PORT with PORT in 1..65535, e.g. 8000 or 9000:8000", r)
	}
	if !hasLocal {
		return remote, remote, nil
	}
	local, ok = parse(l, true)
	if !ok {
		return 0, 0, usagef("local port: %q is not a port; use 0..65535 (0 picks a free port), e.g. 9000:8000", l)
	}
	return local, remote, nil
}

// portConnector opens streams to sandbox ports.
type portConnector interface {
	ConnectPort(ctx context.Context, id string, port uint32, opts ...opendsec.ConnectPortOptions) (*opendsec.PortConn, error)
}

// forwardPort accepts connections on ln until ctx ends and relays each one
// to port inside sandbox id. A connection that cannot be opened is reported
// on errw and closed; the others go on.
func forwardPort(ctx context.Context, c portConnector, ln net.Listener, id string, port uint32, errw io.Writer) error {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	var errMu sync.Mutex
	for {
		lc, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("accept: %w", err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := relayConn(ctx, c, lc, id, port); err != nil {
				errMu.Lock()
				fmt.Fprintf(errw, "error: connection from %s: %s\n", lc.RemoteAddr(), errText(err))
				errMu.Unlock()
			}
		}()
	}
}

func errText(err error) string {
	var oe *opendsec.Error
	if errors.As(err, &oe) && oe.Message != "" {
		return oe.Message
	}
	return err.Error()
}

// relayConn copies between a local connection and a stream to the sandbox
// port. Half-closes pass both ways: the local client's reaches the server
// in the sandbox, and the server's half-closes the local connection (the
// client reads EOF) while what the client still sends keeps going up.
func relayConn(ctx context.Context, c portConnector, lc net.Conn, id string, port uint32) error {
	defer lc.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	rc, err := c.ConnectPort(ctx, id, port)
	if err != nil {
		return err
	}
	defer rc.Close()
	up := make(chan error, 1)
	go func() {
		_, err := io.Copy(rc, lc)
		if err == nil {
			err = rc.CloseWrite()
		}
		up <- err
	}()
	_, downErr := io.Copy(lc, rc)
	if tc, ok := lc.(*net.TCPConn); ok && downErr == nil {
		// The server half-closed: pass it on, and keep relaying what the
		// local client still sends until it closes too.
		tc.CloseWrite()
	} else {
		// The stream failed: unblock the copy above, nothing more goes up.
		lc.SetReadDeadline(time.Now())
	}
	upErr := <-up
	if ctx.Err() != nil {
		return nil
	}
	if downErr != nil {
		return downErr
	}
	var ne net.Error
	if upErr != nil && !(errors.As(upErr, &ne) && ne.Timeout()) && opendsec.CodeOf(upErr) != opendsec.CodeFailedPrecondition {
		return upErr
	}
	return nil
}
