package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// apiConfig points the inbound section at a running system.
type apiConfig struct {
	endpoint  string
	tokenFile string
	// netnsDir is the node's network.netns_dir, for the in-namespace
	// baseline; empty skips it.
	netnsDir string
	image    string
	rr       int
	conns    int
	bulkMiB  int
	rounds   int
}

// apiResult is the inbound section: a server in a sandbox reached through
// the API (ConnectPort) and, as the baseline, from inside the sandbox's
// network namespace over loopback.
type apiResult struct {
	cfg        apiConfig
	api, local *pathResult
}

const (
	echoPort = 7000
	httpPort = 8000
)

// inbound creates a sandbox with an echo server (busybox nc -ll -e cat) and
// an HTTP server with a bulkMiB file, then measures both paths, interleaved.
func inbound(ctx context.Context, c apiConfig) (_ *apiResult, err error) {
	tok, err := os.ReadFile(c.tokenFile)
	if err != nil {
		return nil, fmt.Errorf("read token: %w", err)
	}
	cl, err := opendsec.New(c.endpoint, opendsec.WithToken(strings.TrimSpace(string(tok))))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	sb, err := cl.CreateSandbox(ctx, &opendsec.SandboxSpec{Image: c.image, Labels: map[string]string{"opendsec-bench": "network"}})
	if err != nil {
		return nil, fmt.Errorf("create sandbox: %w", err)
	}
	defer func() {
		if serr := cl.StopSandbox(context.WithoutCancel(ctx), sb.Id); serr != nil && err == nil {
			err = fmt.Errorf("stop sandbox: %w", serr)
		}
	}()
	setup := fmt.Sprintf("mkdir -p /tmp/www && dd if=/dev/zero of=/tmp/www/big bs=1048576 count=%d 2>/dev/null", c.bulkMiB)
	p, err := cl.Exec(ctx, sb.Id, opendsec.ExecOptions{Command: []string{"/bin/sh", "-c", setup}})
	if err != nil {
		return nil, err
	}
	if st, err := p.Wait(); err != nil || st.ExitCode != 0 {
		return nil, fmt.Errorf("prepare the sandbox: %v %v", st, err)
	}
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	for _, cmd := range [][]string{
		{"nc", "-ll", "-p", fmt.Sprint(echoPort), "-e", "/bin/cat"},
		{"httpd", "-f", "-p", fmt.Sprintf("0.0.0.0:%d", httpPort), "-h", "/tmp/www"},
	} {
		if _, err := cl.Exec(sctx, sb.Id, opendsec.ExecOptions{Command: cmd}); err != nil {
			return nil, fmt.Errorf("start %s: %w", cmd[0], err)
		}
	}

	r := &apiResult{cfg: c,
		api:   &pathResult{name: "through the API", what: "`ConnectPort`: client → apiserver (gRPC, h2c) → node (`/agent/<id>/_opendsec/port/<port>`, HTTP/1.1 upgrade) → agent (unix socket) → 127.0.0.1:<port> in the sandbox"},
		local: &pathResult{name: "inside the sandbox", what: "a client in the sandbox's network namespace → 127.0.0.1:<port> (loopback; the baseline)"},
	}
	apiDial := func(ctx context.Context, port int) (io.ReadWriteCloser, error) {
		return cl.ConnectPort(ctx, sb.Id, uint32(port))
	}
	var localDial func(ctx context.Context, port int) (io.ReadWriteCloser, error)
	if c.netnsDir != "" {
		nsPath := filepath.Join(c.netnsDir, sb.Id)
		localDial = func(ctx context.Context, port int) (io.ReadWriteCloser, error) {
			return dialInNS(nsPath, fmt.Sprintf("127.0.0.1:%d", port))
		}
	}
	// Wait for both servers.
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := echoRR(ctx, apiDial, r.api, 1, 1, false)
		if err == nil {
			if _, err = httpGet(ctx, apiDial, "/big"); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("servers in the sandbox did not answer: %w", err)
		}
		time.Sleep(100 * time.Millisecond) // polling for the servers to listen
	}
	type side struct {
		res  *pathResult
		dial func(context.Context, int) (io.ReadWriteCloser, error)
	}
	sides := []side{{r.api, apiDial}}
	if localDial != nil {
		sides = append(sides, side{r.local, localDial})
	}
	for round := range c.rounds {
		fmt.Fprintf(os.Stderr, "== inbound round %d/%d\n", round+1, c.rounds)
		for i := range sides {
			s := sides[(i+round)%len(sides)]
			if err := echoRR(ctx, s.dial, s.res, c.rr, 1, true); err != nil {
				return nil, fmt.Errorf("%s: round trips: %w", s.res.name, err)
			}
			if err := echoRR(ctx, s.dial, s.res, 1, c.conns, true); err != nil {
				return nil, fmt.Errorf("%s: new connections: %w", s.res.name, err)
			}
			t0 := time.Now()
			n, err := httpGet(ctx, s.dial, "/big")
			if err != nil {
				return nil, fmt.Errorf("%s: bulk: %w", s.res.name, err)
			}
			if want := int64(c.bulkMiB) << 20; n != want {
				return nil, fmt.Errorf("%s: bulk: got %d bytes, want %d", s.res.name, n, want)
			}
			s.res.mbps = append(s.res.mbps, float64(n)/time.Since(t0).Seconds()/1e6)
		}
	}
	return r, nil
}

// echoRR opens conns connections to the echo port and does rr 64-byte round
// trips on each. With one connection the round trips are recorded (after
// warm-up); with several, each connection's open + first round trip + close
// is.
func echoRR(ctx context.Context, dial func(context.Context, int) (io.ReadWriteCloser, error), res *pathResult, rr, conns int, record bool) error {
	req, resp := bytes.Repeat([]byte("x"), 64), make([]byte, 64)
	for range conns {
		t0 := time.Now()
		c, err := dial(ctx, echoPort)
		if err != nil {
			return err
		}
		warm := 0
		if conns == 1 && record {
			warm = 50
		}
		for i := range warm + rr {
			t1 := time.Now()
			if _, err := c.Write(req); err != nil {
				c.Close()
				return err
			}
			if _, err := io.ReadFull(c, resp); err != nil {
				c.Close()
				return err
			}
			if record && conns == 1 && i >= warm {
				res.rr = append(res.rr, time.Since(t1))
			}
		}
		c.Close()
		if record && conns > 1 {
			res.conn = append(res.conn, time.Since(t0))
		}
	}
	return nil
}

// httpGet fetches path from the HTTP port over one connection (HTTP/1.0,
// half-close) and returns the body size.
func httpGet(ctx context.Context, dial func(context.Context, int) (io.ReadWriteCloser, error), path string) (int64, error) {
	c, err := dial(ctx, httpPort)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.0\r\n\r\n", path); err != nil {
		return 0, err
	}
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		if err := cw.CloseWrite(); err != nil {
			return 0, err
		}
	}
	// Skip the headers, count the body.
	var hdr []byte
	b := make([]byte, 1)
	for !bytes.HasSuffix(hdr, []byte("\r\n\r\n")) {
		if _, err := io.ReadFull(c, b); err != nil {
			return 0, fmt.Errorf("read headers: %w", err)
		}
		hdr = append(hdr, b[0])
		if len(hdr) > 64<<10 {
			return 0, fmt.Errorf("headers too long")
		}
	}
	if !bytes.Contains(hdr[:min(len(hdr), 20)], []byte(" 200 ")) {
		return 0, fmt.Errorf("status %q", strings.SplitN(string(hdr), "\r\n", 2)[0])
	}
	return io.Copy(io.Discard, c)
}
